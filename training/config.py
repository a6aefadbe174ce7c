"""Training configuration: the parsed ``train`` command line, frozen, and its checks.

Everything that can be wrong with it is found here, before MPI starts and before anything is
written: the data directory and its HDF5 layout, the output directory, the comm backend.
:func:`check_command` parses a ``train``/``hpcai-train``/``python -m hpcai.training``
command line without running it, so ``hpcai-launch``, ``sbatch`` and ``sweep`` refuse a
usage error once, before any rank starts. Importing this module imports no framework.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

from ..core.errors import UserError
from .command import TRAIN_PROGRAMS, train_arguments
from ..models.gan3d_spec import LOSS_WEIGHTS
from . import recipes
from .schedule import DECAYS

MODELS = ("3dgan", "resnet50", "resnet-tiny")
COMMS = ("mpi", "gloo", "horovod", "nccl")
FRAMEWORKS = ("pytorch", "tensorflow")
LR_DECAYS = tuple(DECAYS)   # training/schedule.py owns the decays
TF_MODELS = ("3dgan", "resnet50")

DEFAULTS = {  # ResNets: per-rank batch, base lr (before scaling), optimiser (3dgan: recipes.py)
    "resnet50": (32, 0.0125, "sgd"),
    "resnet-tiny": (16, 0.0125, "sgd"),
}
IMAGE_DEFAULTS = {"samples": 256, "image_size": 224, "classes": 1000}   # ResNet only
BUCKET_MB = 4.0
VALIDATE_EVERY, VALIDATE_EVENTS = 1, 256   # 3dgan physics validation
DEVICES = ("cpu", "cuda")
# The per-rank peak GFLOP/s that "% of peak" divides by, where --peak-gflops is not given: a
# site that knows its nodes' peak sets it (e.g. in its profile's [env]); unset, every run
# measures it (a 2048^3 GEMM probe on every rank: 2-4 s at start-up on this machine).
PEAK_ENV = "HPCAI_PEAK_GFLOPS"
VALIDATE_BN = ("moving", "standing")   # 3dgan: --validate-bn
PRECISIONS = ("fp32", "tf32", "bf16")   # --precision: torch_trainer.precision_settings


@dataclass(frozen=True)
class TrainConfig:
    model: str
    out: str
    epochs: int = 2
    batch_size: int = 16              # per rank; parse() puts the model's default
    lr: float = 1e-3                  # per rank, scaled by world size; parse(): model default
    lr_scaling: str = "linear"
    warmup_epochs: float = 0.0
    lr_decay: str = "none"            # "cosine", "step": training/schedule.py
    optimizer: str = "adam"           # parse(): the model's default
    data: str | None = None
    generate_events: int = 0          # >0: generate this many showers into OUT/data first
    samples: int = 256                # synthetic images per epoch (ResNet)
    image_size: int = 224
    classes: int = 1000
    comm: str = "mpi"
    framework: str = "pytorch"
    bucket_mb: float = BUCKET_MB
    overlap: bool = True
    allreduce_progress: str | None = None   # hook | thread; None: the MPI family's
    verify_every: int = 50
    bn: str = "local"
    checkpoint_every: int = 0         # steps; 0 = end of each epoch only
    keep: int = 3
    resume: bool = False
    seed: int = 1234
    peak_gflops: float = 0.0
    max_steps: int = 0                # per epoch, 0 = all
    channels_last: bool = True        # measured faster here for both models
    prefetch: bool = True
    eval_samples: int = 32            # fixed samples evaluated by rank 0 after each epoch
    stall_timeout: float | None = None  # s without progress that ends the job; None: auto, 0: off
    test_files: int | None = None     # 3dgan held-out files; None: 10 % (>= 1 of >= 2 files)
    validate_every: int = VALIDATE_EVERY     # epochs between physics validations (0: last only)
    validate_events: int = VALIDATE_EVENTS   # held-out events per validation (0: none)
    validate_draws: int = 1           # generated showers per held-out event and validation
    bn_axis: str = "channels"         # 3dgan BatchNorm over "channels" or "depth" ([CERN])
    d_bn_in_g_steps: str = "freeze"   # 3dgan D's BatchNorm statistics in the G steps
    cell_scale: float = 1.0           # 3dgan cells seen by the networks: GeV x cell_scale
    device: str = "cpu"               # "cuda": each rank on GPU (local rank mod GPUs)
    loss_weights: tuple[float, float, float] = LOSS_WEIGHTS   # 3dgan (BCE, aux, ecal)
    generator_ema: float | None = None   # 3dgan: decay of the generator's weight average
    validate_bn: str = "moving"       # 3dgan: the judged generator's BatchNorm statistics
    recipe: str | None = None         # 3dgan: recipes.py (parse() puts the default)
    overrides: tuple[str, ...] = ()   # 3dgan: the recipe's settings given as flags (and
                                      # "recipe" when --recipe was given)
    precision: str = "fp32"           # "tf32", "bf16" (autocast): --device cuda only

    @property
    def mpi_overlap(self) -> bool:
        """Whether hpcai's engine reduces PyTorch gradients over MPI on the CPU while backward
        runs: the runs ``--allreduce-progress`` is for."""
        return mpi_overlap(self.framework, self.comm, self.device, self.overlap)

    @property
    def memory_format(self) -> str:
        """The convolutions' input and weight layout: "channels_last" or "contiguous"."""
        return "channels_last" if self.channels_last else "contiguous"

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def out_dir(self) -> Path:
        return Path(self.out)

    @property
    def checkpoint_dir(self) -> Path:
        return self.out_dir / "checkpoints"


def mpi_overlap(framework: str, comm: str, device: str, overlap: bool) -> bool:
    """See :attr:`TrainConfig.mpi_overlap` (also for the options before the config exists)."""
    return framework == "pytorch" and comm == "mpi" and device == "cpu" and overlap


# settings a resumed run may change without it meaning anything for the training
_RESUME_NEUTRAL = frozenset({"resume", "out", "overrides"})


def changed_settings(saved: dict, now: dict) -> list[str]:
    """The training settings of ``now`` that differ from a checkpoint's ``saved`` (both
    ``TrainConfig.to_dict()``), as "name old -> new"; lists and tuples compare alike."""
    def norm(value):
        return tuple(value) if isinstance(value, (list, tuple)) else value

    return [f"{key} {norm(saved[key])!r} -> {norm(now[key])!r}" for key in sorted(now)
            if key in saved and key not in _RESUME_NEUTRAL and norm(saved[key]) != norm(now[key])]


def make_parser() -> argparse.ArgumentParser:
    from ..core.cli import Parser

    p = Parser(prog="hpcai-train",
                description="Synchronous data-parallel training over MPI (run it under "
                            "hpcai-launch: `hpcai-launch -N 2 -- train 3dgan ...`).")
    p.add_argument("model", choices=MODELS)
    p.add_argument("--out", default="out", help="output directory (logs, checkpoints)")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--recipe", choices=tuple(recipes.RECIPES), default=None,
                   help=recipes.HELP)
    p.add_argument("--batch-size", type=int, default=None,
                   help="per rank (default: 3dgan the recipe's, resnet50 32, resnet-tiny 16)")
    p.add_argument("--lr", type=float, default=None,
                   help="per-rank base learning rate (multiplied by the world size; "
                        "default: the model's, for 3dgan the recipe's)")
    p.add_argument("--lr-scaling", choices=("linear", "none"), default="linear")
    p.add_argument("--warmup-epochs", type=float, default=None,
                   help="0: no warm-up (default 0)")
    p.add_argument("--lr-decay", choices=LR_DECAYS, default=None,
                   help="after the warm-up (default: none; 3dgan: the recipe's): none (a "
                        "constant rate, as CERN's trainer), "
                        "cosine (half a cosine from the rate down to 0 at the end of the "
                        "last epoch, counted in --epochs x steps per epoch) or step (the "
                        "rate for the first 80 %% of those steps, a tenth of it after)")
    p.add_argument("--optimizer", choices=("adam", "rmsprop", "sgd"), default=None,
                   help="default: the recipe's (adam) for 3dgan, sgd for the ResNets")
    p.add_argument("--data", help="directory of Ele*_*.h5 files (3dgan)")
    p.add_argument("--generate", type=int, default=0, metavar="EVENTS",
                   help="first generate EVENTS synthetic showers into OUT/data (3dgan)")
    p.add_argument("--samples", type=int, default=None,
                   help="synthetic images (resnet; default 256)")
    p.add_argument("--image-size", type=int, default=None, help="resnet; default 224")
    p.add_argument("--classes", type=int, default=None, help="resnet; default 1000")
    p.add_argument("--comm", choices=COMMS, default=None,
                   help="gradient allreduce: mpi (hpcai's fused buckets over mpi4py; the "
                        "default on the CPU), gloo (torch.distributed, PyTorch only), horovod "
                        "(if built) or nccl (the same buckets over torch.distributed's NCCL, "
                        "--device cuda only, its default; ranks that share a GPU fall back "
                        "to mpi)")
    p.add_argument("--framework", choices=FRAMEWORKS, default="pytorch",
                   help="tensorflow: the Keras 3 models, trained by the same engine")
    p.add_argument("--bucket-mb", type=float, default=None,
                   help=f"allreduce fusion bucket (default {BUCKET_MB:g}; not with TensorFlow "
                        "and --comm horovod, where Horovod fuses)")
    p.add_argument("--no-overlap", action="store_true",
                   help="blocking allreduce after backward instead of overlapping it")
    p.add_argument("--allreduce-progress", choices=("hook", "thread"), default=None,
                   help="--comm mpi: who makes the MPI calls: backward's thread once "
                        "backward has ended (hook) or a communication thread while backward "
                        "goes on (thread, needs MPI_THREAD_SERIALIZED); default: the MPI "
                        "family's (Open MPI: thread; MPICH and Intel MPI: hook)")
    p.add_argument("--verify-every", type=int, default=50,
                   help="check replicas are identical every K steps (0: epoch ends only)")
    p.add_argument("--bn", choices=("local", "average"), default="local",
                   help="BatchNorm running stats: per rank, or averaged over ranks each epoch")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps (0: per epoch)")
    p.add_argument("--keep", type=int, default=3, help="checkpoints to keep (0: all)")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--peak-gflops", type=float, default=None,
                   help=f"per-rank peak to divide by (default: ${PEAK_ENV} where set, else "
                        "measured with a GEMM probe)")
    p.add_argument("--max-steps", type=int, default=0,
                   help="cap steps per epoch (tests; 0: no cap)")
    p.add_argument("--channels-first", action="store_true",
                   help="keep NCDHW/NCHW memory layout (default: channels-last, which ran "
                        "1.3x (3DGAN) and 1.15x (ResNet50) faster on this CPU)")
    p.add_argument("--no-prefetch", action="store_true")
    p.add_argument("--eval-samples", type=int, default=32,
                   help="fixed samples rank 0 evaluates after each epoch (0: none)")
    p.add_argument("--stall-timeout", type=float, default=None, metavar="SECONDS",
                   help="end the job (MPI_Abort, exit 124, naming the rank, host and step) "
                        "when a rank makes no progress for this long in a step, the per-step "
                        "preemption check, an epoch end or a checkpoint; a value given applies "
                        "from the first step, which includes tracing and warm-up (default: "
                        "300 s until the second step is done and the first time through each "
                        "phase, else max(60 s, 10 x the longest step); 0: off)")
    p.add_argument("--test-files", type=int, default=None, metavar="K",
                   help="3dgan: hold out the last K data files (sorted) for validation, never "
                        "trained on (default: 10 %% of the files, at least 1 when there are 2 "
                        "or more; with --generate, K extra files from their own seed)")
    p.add_argument("--validate-every", type=int, default=None, metavar="EPOCHS",
                   help="3dgan: physics validation on held-out events every EPOCHS epochs and "
                        "after the last (0: after the last only); writes OUT/physics.json and "
                        "PNGs")
    p.add_argument("--validate-events", type=int, default=None, metavar="N",
                   help="3dgan: held-out events per validation, shared by the ranks "
                        "(default 256; 0: no physics validation)")
    p.add_argument("--validate-draws", type=int, default=None, metavar="K",
                   help="3dgan: generated showers per held-out event in each validation, each "
                        "from its own fixed latent vector (default 1); more draws shrink the "
                        "standard error of the generated side")
    p.add_argument("--bn-axis", choices=("channels", "depth"), default="channels",
                   help="3dgan BatchNorm: per channel (default) or per calorimeter layer as "
                        "CERN's channels-first run did (872,736 / 73,646 parameters; "
                        "docs/3dgan.md)")
    p.add_argument("--d-bn-in-g-steps", choices=("freeze", "update"), default="freeze",
                   help="3dgan: the discriminator's BatchNorm moving statistics during the "
                        "generator steps: left alone (default) or updated as CERN's trainer "
                        "does (docs/3dgan.md)")
    p.add_argument("--cell-scale", type=float, default=None, metavar="S",
                   help="3dgan: the networks see the cells in GeV x S (default: the "
                        "recipe's; 1 as CERN's 2019 trainer behind the papers, 100 as its "
                        "2020 version); the ecal "
                        "loss, physics validation and generated showers stay in GeV "
                        "(docs/3dgan.md)")
    p.add_argument("--loss-weights", type=loss_weights, default=None, metavar="BCE,AUX,ECAL",
                   help="3dgan: the weights of the real/fake cross-entropy, the energy "
                        "regression and the ECAL-sum MAPE in every loss (default 8,0.2,0.1 "
                        "as CERN's trainer; any other is a departure, docs/3dgan.md)")
    p.add_argument("--generator-ema", type=float, default=None, metavar="DECAY",
                   help="3dgan: also keep an exponential moving average of the generator's "
                        "weights (0 < DECAY < 1; 0.99 averages about the last 100 steps); "
                        "physics validation then judges the average, with the raw generator "
                        "beside it, and export-onnx exports it. Off by default, as CERN's "
                        "trainer (a departure, docs/3dgan.md)")
    p.add_argument("--validate-bn", choices=VALIDATE_BN, default=None,
                   help="3dgan: the BatchNorm statistics the trained generator is judged and "
                        "exported with (default: the recipe's): its moving averages (as "
                        "CERN's predict), or standing ones, measured afresh for its weights at "
                        "each validation on fixed inputs (the moving averages lag the weights; "
                        "docs/3dgan.md)")
    p.add_argument("--device", choices=DEVICES, default="cpu",
                   help="cuda: each rank computes on a GPU (its local rank modulo the GPUs "
                        "it sees); gradients are averaged with NCCL (--comm nccl, the default) "
                        "or through host memory over MPI (--comm mpi); broadcasts and replica "
                        "checks go through host memory. PyTorch only")
    p.add_argument("--precision", choices=PRECISIONS, default=None,
                   help="--device cuda: fp32 (no TF32 anywhere), tf32 (TF32 matrix products "
                        "and convolutions; the default there) or bf16 (autocast to bfloat16 "
                        "where it applies, TF32 elsewhere); the CPU runs fp32 only. The "
                        "%% of peak is against a GEMM in the same precision")
    return p


def loss_weights(text: str) -> tuple[float, float, float]:
    """``--loss-weights``: three finite numbers >= 0, not all 0 (argparse reports a
    ValueError as an invalid value)."""
    values = tuple(float(v) for v in text.split(","))
    if (len(values) != 3 or not all(0 <= v < float("inf") for v in values)
            or not any(values)):
        raise ValueError(text)
    return values   # type: ignore[return-value]


def parse(argv: list[str]) -> TrainConfig:
    """The ``train`` command line, checked (:func:`check_options`, :func:`check_numbers`);
    an option left out takes the model's default, for 3dgan its recipe's
    (``recipes.py``)."""
    ns = make_parser().parse_args(argv)
    check_options(ns)
    given = {key: getattr(ns, key) for key in recipes.TUNED if getattr(ns, key) is not None}
    if ns.model == "3dgan":
        name = recipes.choose(ns.recipe, ns.framework)
        overrides = tuple(key for key in recipes.TUNED if key in given)
        tuned = recipes.apply(given, name, overrides)
        tuned["overrides"] = overrides + (("recipe",) if ns.recipe else ())
    else:
        batch, lr, opt = DEFAULTS[ns.model]
        tuned = {"batch_size": batch, "lr": lr, "optimizer": opt, "warmup_epochs": 0.0,
                 "lr_decay": "none", **given}
    image = {key: getattr(ns, key) if getattr(ns, key) is not None else value
             for key, value in IMAGE_DEFAULTS.items()}
    cfg = TrainConfig(
        model=ns.model, out=ns.out, epochs=ns.epochs, **tuned, lr_scaling=ns.lr_scaling,
        data=ns.data,
        generate_events=ns.generate, **image,
        comm=ns.comm or ("nccl" if ns.device == "cuda" else "mpi"), framework=ns.framework,
        bucket_mb=BUCKET_MB if ns.bucket_mb is None else ns.bucket_mb,
        overlap=not ns.no_overlap, allreduce_progress=ns.allreduce_progress,
        verify_every=ns.verify_every,
        bn=ns.bn, checkpoint_every=ns.checkpoint_every, keep=ns.keep, resume=ns.resume,
        seed=ns.seed, max_steps=ns.max_steps,
        peak_gflops=env_peak_gflops() if ns.peak_gflops is None else ns.peak_gflops,
        channels_last=not ns.channels_first, prefetch=not ns.no_prefetch,
        eval_samples=ns.eval_samples, stall_timeout=ns.stall_timeout,
        test_files=ns.test_files,
        validate_every=VALIDATE_EVERY if ns.validate_every is None else ns.validate_every,
        validate_events=(VALIDATE_EVENTS if ns.validate_events is None
                         else ns.validate_events),
        validate_draws=1 if ns.validate_draws is None else ns.validate_draws,
        bn_axis=ns.bn_axis,
        d_bn_in_g_steps=ns.d_bn_in_g_steps,
        device=ns.device,
        loss_weights=LOSS_WEIGHTS if ns.loss_weights is None else ns.loss_weights,
        generator_ema=ns.generator_ema,
        precision=ns.precision or ("tf32" if ns.device == "cuda" else "fp32"))
    check_numbers(cfg)
    return cfg


def env_peak_gflops(env=os.environ) -> float:
    """:data:`PEAK_ENV`'s value; 0.0 (measure) when it is unset or empty."""
    text = env.get(PEAK_ENV, "").strip()
    if not text:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 < value < float("inf"):
        raise UserError(f"{PEAK_ENV}={text!r} is not a positive number of GFLOP/s",
                        f"set it to the per-rank peak (for example {PEAK_ENV}=50), or unset "
                        "it to measure the peak with a GEMM probe")
    return value


def check_options(ns: argparse.Namespace) -> None:
    """Options this model or framework would ignore are refused, not dropped."""
    if ns.model == "3dgan":
        for key in IMAGE_DEFAULTS:
            if getattr(ns, key) is not None:
                flag = "--" + key.replace("_", "-")
                raise UserError(f"{flag} is for the ResNet models; 3dgan trains on showers",
                                "leave it out; 3dgan reads --data DIR or --generate EVENTS")
        if ns.data and ns.generate:
            raise UserError("--data and --generate together: --generate would be ignored",
                            "give one: --data DIR (Ele*_*.h5 files) or --generate EVENTS")
    else:
        gan_only = (("--data", ns.data), ("--generate", ns.generate),
                    ("--test-files", ns.test_files is not None),
                    ("--validate-every", ns.validate_every is not None),
                    ("--validate-events", ns.validate_events is not None),
                    ("--validate-draws", ns.validate_draws is not None),
                    ("--bn-axis", ns.bn_axis != "channels"),
                    ("--d-bn-in-g-steps", ns.d_bn_in_g_steps != "freeze"),
                    ("--recipe", ns.recipe is not None),
                    ("--cell-scale", ns.cell_scale is not None),
                    ("--loss-weights", ns.loss_weights is not None),
                    ("--generator-ema", ns.generator_ema is not None),
                    ("--validate-bn", ns.validate_bn is not None))
        for flag, value in gan_only:
            if value:
                raise UserError(f"{flag} is for 3dgan; {ns.model} trains on synthetic images",
                                "leave it out; --samples, --image-size and --classes shape "
                                "the images")
    if ns.framework == "tensorflow":
        for flag, value, default in (("--bn-axis", ns.bn_axis, "channels"),
                                     ("--d-bn-in-g-steps", ns.d_bn_in_g_steps, "freeze"),
                                     ("--cell-scale", ns.cell_scale or 1.0, 1.0),
                                     ("--loss-weights", ns.loss_weights or LOSS_WEIGHTS,
                                      LOSS_WEIGHTS),
                                     ("--generator-ema", ns.generator_ema, None),
                                     ("--validate-bn", ns.validate_bn or "moving",
                                      "moving")):
            if value != default:
                raise UserError(f"{flag} {value} is implemented for PyTorch only",
                                f"use --framework pytorch, or leave {flag} out ({default})")
    if ns.device != "cpu" and (ns.framework != "pytorch"
                               or ns.comm not in (None, "mpi", "nccl")):
        raise UserError(f"--device {ns.device} is implemented for --framework pytorch with "
                        f"--comm nccl or mpi only, not --framework {ns.framework} --comm "
                        f"{ns.comm or 'mpi'}",
                        "use --framework pytorch (the default) and leave --comm out (nccl), "
                        "or leave --device out (cpu)")
    if ns.comm == "nccl" and ns.device != "cuda":
        raise UserError("--comm nccl averages GPU gradients and needs --device cuda",
                        "add --device cuda on a GPU node, or leave --comm out (mpi)")
    if ns.precision not in (None, "fp32") and ns.device != "cuda":
        raise UserError(f"--precision {ns.precision} is for --device cuda; the CPU trains "
                        "in fp32", "add --device cuda on a GPU node, or leave --precision out")
    if ns.allreduce_progress is not None:
        comm = ns.comm or ("nccl" if ns.device == "cuda" else "mpi")
        if not mpi_overlap(ns.framework, comm, ns.device, not ns.no_overlap):
            raise UserError(
                f"--allreduce-progress is for PyTorch on the CPU with --comm mpi, overlapping "
                f"backward; this run uses --framework {ns.framework} --comm {comm}"
                f"{' --device cuda' if ns.device == 'cuda' else ''}"
                f"{' --no-overlap' if ns.no_overlap else ''}",
                "leave --allreduce-progress out (the others make their own calls)")
    if ns.bucket_mb is not None and ns.framework == "tensorflow" and ns.comm == "horovod":
        raise UserError("--bucket-mb has no effect with --framework tensorflow --comm "
                        "horovod: Horovod fuses the tensors itself",
                        "leave it out (HOROVOD_FUSION_THRESHOLD sets Horovod's fusion "
                        "buffer), or use --comm mpi")


def check_numbers(cfg: TrainConfig) -> None:
    """Counts that must be positive and values that must not be negative. A 0 is never
    read as "the default": ``--batch-size 0`` is an error, not the model's 16."""
    positive = (("--epochs", cfg.epochs), ("--batch-size", cfg.batch_size),
                ("--validate-draws", cfg.validate_draws),
                ("--samples", cfg.samples),
                ("--image-size", cfg.image_size), ("--classes", cfg.classes))
    for name, value in positive:
        if value < 1:
            raise UserError(f"{name} must be at least 1, got {value}", f"give {name} 1 or more")
    if cfg.lr <= 0:
        raise UserError(f"--lr must be positive, got {cfg.lr:g}",
                        "e.g. --lr 0.001, or leave it out for the model's default")
    if cfg.bucket_mb <= 0:
        raise UserError(f"--bucket-mb must be positive, got {cfg.bucket_mb:g}",
                        "e.g. --bucket-mb 4")
    if not 0 < cfg.cell_scale < float("inf"):
        raise UserError(f"--cell-scale must be a positive number, got {cfg.cell_scale:g}",
                        "e.g. --cell-scale 100 (CERN's 2020 trainer), or leave it out (the "
                        "recipe's)")
    not_negative = (("--generate", cfg.generate_events), ("--verify-every", cfg.verify_every),
                    ("--checkpoint-every", cfg.checkpoint_every),
                    ("--max-steps", cfg.max_steps), ("--eval-samples", cfg.eval_samples),
                    ("--seed", cfg.seed), ("--warmup-epochs", cfg.warmup_epochs),
                    ("--peak-gflops", cfg.peak_gflops), ("--keep", cfg.keep),
                    ("--test-files", cfg.test_files or 0),
                    ("--validate-every", cfg.validate_every),
                    ("--validate-events", cfg.validate_events))
    for name, value in not_negative:
        if value < 0:
            raise UserError(f"{name} must not be negative, got {value:g}",
                            f"give {name} 0 or more (train --help says what 0 means)")
    if cfg.lr_decay != "none" and cfg.warmup_epochs >= cfg.epochs:
        raise UserError(f"--lr-decay {cfg.lr_decay} with --warmup-epochs {cfg.warmup_epochs:g} "
                        f"and --epochs {cfg.epochs}: the warm-up fills the run, so the decay "
                        "would never start",
                        "give fewer warm-up epochs than --epochs, or leave --lr-decay out")
    if cfg.generator_ema is not None and not 0 < cfg.generator_ema < 1:
        raise UserError(f"--generator-ema must lie between 0 and 1, got {cfg.generator_ema:g}",
                        "e.g. --generator-ema 0.99 (about the last 100 steps), or leave it "
                        "out for no average")
    if cfg.stall_timeout is not None and not cfg.stall_timeout >= 0:
        raise UserError(f"--stall-timeout must be 0 (off) or positive, got {cfg.stall_timeout}",
                        "e.g. --stall-timeout 120, or leave it out for the automatic bound")


def check_command(command: Sequence[str], program: str | None = None) -> TrainConfig | None:
    """Parse a training command's arguments as every rank would, without running it: a
    usage error or a bad number is a :class:`UserError` naming the command. None for other
    commands, for ``--help``, and when ``program`` (the file ``command[0]`` resolves to) is
    readable and is not hpcai's entry point (someone else's ``train``). Nothing is read but
    ``program``: the data and output directories are the ranks' to check."""
    args = train_arguments(command)
    if args is None or "-h" in args or "--help" in args:
        return None
    if program is not None and os.path.basename(command[0]) in TRAIN_PROGRAMS:
        try:
            with open(program, "rb") as f:
                if b"hpcai.training" not in f.read(4096):
                    return None
        except OSError:
            pass
    try:
        return parse(args)
    except UserError as exc:
        what = " ".join(command[:len(command) - len(args)])
        raise UserError(f"{what}: {exc.message}", exc.hint) from None


def check_output_dir(out: Path) -> None:
    """The output directory exists or can be made, and is writable; nothing is left behind.

    Tried for real (a temporary file in the nearest existing ancestor), since permission bits
    say little to root and nothing about read-only mounts.
    """
    import tempfile

    existing = out
    while not existing.exists():
        existing = existing.parent
    problem = None
    if not existing.is_dir():
        problem = f"{existing} is not a directory"
    else:
        try:
            fd, name = tempfile.mkstemp(prefix=".hpcai-write-test-", dir=existing)
            os.close(fd)
            os.unlink(name)
        except OSError as exc:
            problem = f"cannot write in {existing}: {exc.strerror}"
    if problem:
        raise UserError(f"output directory {out} is not writable ({problem})",
                        "choose a writable --out, e.g. on $SCRATCH or $HOME")


def check_device(cfg: TrainConfig) -> None:
    """--device cuda: this rank's PyTorch sees a CUDA GPU (before MPI starts)."""
    if cfg.device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise UserError(f"--device cuda, but PyTorch {torch.__version__} sees no CUDA GPU on "
                        "this node (torch.cuda.is_available() is False)",
                        "leave --device out (cpu), or run on a GPU node with a PyTorch built "
                        "for CUDA")


def check_framework(cfg: TrainConfig) -> None:
    """TensorFlow and Keras 3 import, and the model exists in Keras (before MPI starts)."""
    if cfg.framework != "tensorflow":
        return
    missing = [m for m in ("tensorflow", "keras") if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"--framework tensorflow, but {' and '.join(missing)} cannot be "
                        "imported in this Python",
                        "pip install -r requirements.txt (tensorflow-cpu and keras), or use "
                        "--framework pytorch (the default)")
    if cfg.model not in TF_MODELS:
        raise UserError(f"{cfg.model} has no TensorFlow version",
                        f"use --framework pytorch, or one of {', '.join(TF_MODELS)}")
    if cfg.comm == "gloo":
        raise UserError("--comm gloo is torch.distributed's backend and cannot average "
                        "TensorFlow gradients", "use --comm mpi (the default) or horovod")


def horovod_package() -> Path | None:
    """The installed ``horovod`` package directory (found without importing it), or None."""
    spec = importlib.util.find_spec("horovod")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def horovod_built(framework: str) -> bool:
    """Horovod's compiled MPI ops for ``framework`` ("torch" or "tensorflow") are installed."""
    package = horovod_package()
    return package is not None and any((package / framework).glob("mpi_lib*.so"))


def horovod_mpi_abi(package_dir: str | os.PathLike) -> tuple[str, str] | None:
    """(MPI ABI as ``MPI4PY_MPIABI`` names it, soname) that Horovod's compiled ops link
    against, read from their ELF DT_NEEDED (no import, nothing loaded), or None if no MPI
    library is named."""
    from ..launcher.mpi.abi import family_of_soname
    from ..launcher.mpi.elf import read_elf

    for lib in sorted(Path(package_dir).glob("*/mpi_lib*.so")):
        for needed in read_elf(lib).needed:
            family = family_of_soname(needed)
            if family:
                return family.mpi4py_abi, needed
    return None


def check_comm(comm: str, framework: str = "pytorch") -> None:
    """--comm horovod: the Horovod ops import, and were built for this job's MPI ABI (the
    launcher says which in MPI4PY_MPIABI); a mismatch would crash inside MPI_Init."""
    if comm != "horovod":
        return
    module = "horovod.tensorflow" if framework == "tensorflow" else "horovod.torch"
    package = horovod_package()
    if package is not None:
        linked = horovod_mpi_abi(package)
        job_abi = os.environ.get("MPI4PY_MPIABI", "")
        if linked and job_abi and linked[0] != job_abi:
            raise UserError(f"--comm horovod, but Horovod is built against {linked[1]} "
                            f"({linked[0]} ABI) and this job runs on a {job_abi}-ABI MPI",
                            "launch with the MPI Horovod was built with (e.g. --mpi openmpi), "
                            "rebuild it with scripts/build-horovod.sh with that MPI's mpicxx "
                            "first on PATH, or use --comm mpi")
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - ImportError, or a broken build's errors
        raise UserError(f"--comm horovod, but {module} cannot be imported ({exc})",
                        "use --comm mpi (the default), or build Horovod with "
                        "scripts/build-horovod.sh (see README)") from exc
