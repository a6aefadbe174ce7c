"""`train` on a GPU against a plain PyTorch loop on the same GPU, in one run (issue 40).

Each configuration (model, batch, precision, memory format) is measured in pairs of trials,
the two sides in alternating order (A B, B A, ...):

- **plain**: the loop as PyTorch's documentation writes it, in this process: torchvision's
  ResNet-50 (hpcai's ``models/resnet.py`` where torchvision does not import, and for
  ``--model resnet-tiny``), SGD with momentum 0.9, ``cudnn.benchmark``, one batch made on
  the device beforehand, channels-last and ``torch.autocast`` to bfloat16 where the
  configuration says so; for the 3DGAN, hpcai's ``gan3d.gan_iteration`` on one batch on the
  device, with no engine around it. It times the same number of steps as hpcai's steady
  epochs, after warm-up steps.
- **hpcai**: ``train`` as users run it, a new process per trial (``hpcai-launch -N 1 --
  train ...`` where hpcai-launch is on PATH, else ``python -m hpcai.training``), read back
  from its ``epochs.jsonl``: the mean samples/s of the epochs after the first, so start-up,
  cuDNN autotuning and the first epoch are left out on both sides.

Both sides set the same switches for a precision: fp32 turns TF32 off for matrix products
and convolutions, tf32 turns it on for both, bf16 is autocast with TF32 on for what stays in
float32. The ratio hpcai / plain of each pair is judged against 0.95; for the 3DGAN, hpcai's
samples/s over the 158 samples/s measured before this work (issue 40) is judged against 3.
Configurations get pairs in rounds until the Student-t 95 % interval of the mean ratio
excludes the target (at least ``--min-pairs``), ``--max-pairs`` is reached, or ``--budget-s``
would be exceeded; secondary configurations (``--gan-variants``) get a pair in a round only
when every primary one has its minimum. One JSON file (``--json``) holds the provenance,
settings, every trial, the ratios with their intervals and a verdict per configuration.

``--profile PATH`` instead profiles the 3DGAN's training step as ``train`` runs it (hpcai's
``GanTask.train_step`` on batches gathered on the device) with ``torch.profiler`` and writes
the 25 operators with the most self time on the device (CPU time on the CPU), as a table
(PATH) and as JSON (PATH with ``.json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import provenance  # noqa: E402

RESNET_TARGET = 0.95     # hpcai / plain, ResNet
GAN_TARGET = 3.0         # hpcai / GAN_BEFORE, 3DGAN batch 64
GAN_BEFORE = 158.0       # samples/s of train 3dgan --device cuda --batch-size 64 (issue 40)
T95 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179,
       2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086)   # two-sided, df 1..20


@dataclass
class Config:
    key: str
    model: str                 # resnet50, resnet-tiny or 3dgan
    batch: int
    precision: str
    memory_format: str
    steps: int                 # per epoch
    primary: bool = True
    plain: list[float] = field(default_factory=list)
    hpcai: list[float] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def gan(self) -> bool:
        return self.model == "3dgan"

    def ratios(self) -> list[float]:
        if self.gan:
            return [h / GAN_BEFORE for h in self.hpcai]
        return [h / p for h, p in zip(self.hpcai, self.plain)]

    @property
    def target(self) -> float:
        return GAN_TARGET if self.gan else RESNET_TARGET


def interval(values: list[float]) -> dict:
    """Mean, Student-t 95 % interval (None below 2 values), median, min, max."""
    n = len(values)
    out = {"n": n, "mean": None, "ci95": None, "median": None, "min": None, "max": None}
    if not n:
        return out
    mean = statistics.fmean(values)
    out.update(mean=round(mean, 4), median=round(statistics.median(values), 4),
               min=round(min(values), 4), max=round(max(values), 4))
    if n >= 2:
        half = T95[min(n - 1, len(T95)) - 1] * statistics.stdev(values) / math.sqrt(n)
        out["ci95"] = [round(mean - half, 4), round(mean + half, 4)]
    return out


def verdict(stats: dict, target: float) -> str:
    """met / missed when the whole interval is on one side of the target, else
    unresolved."""
    if stats["ci95"] is None:
        return "unresolved"
    lo, hi = stats["ci95"]
    return "met" if lo >= target else "missed" if hi < target else "unresolved"


def decided(cfg: Config, min_pairs: int) -> bool:
    stats = interval(cfg.ratios())
    return stats["n"] >= min_pairs and verdict(stats, cfg.target) != "unresolved"


# -- precision switches, shared by nothing: each side sets them (hpcai: precision_settings) --
def set_precision(torch, precision: str, device: str) -> None:
    if device == "cuda":
        torch.backends.cudnn.benchmark = True
        torch.backends.cuda.matmul.allow_tf32 = precision != "fp32"
        torch.backends.cudnn.allow_tf32 = precision != "fp32"


def autocast(torch, precision: str, device: str):
    if precision == "bf16" and device == "cuda":
        return torch.autocast(device_type="cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# -- the plain side -----------------------------------------------------------------------
def resnet_net(model: str):
    if model == "resnet50":
        try:
            import torchvision

            return torchvision.models.resnet50(), "torchvision.models.resnet50"
        except ImportError:
            pass
    from hpcai.models import resnet

    if model == "resnet50":
        return resnet.resnet50(), "hpcai models/resnet.py resnet50 (no torchvision)"
    return resnet.resnet_tiny(num_classes=1000), "hpcai models/resnet.py resnet_tiny"


def plain_step(torch, cfg: Config, device: str, image_size: int):
    """(one training step, what the model is) of the plain loop for ``cfg``."""
    import torch.nn.functional as F

    if cfg.gan:
        from hpcai.models import gan3d

        fmt = torch.channels_last_3d
        G = gan3d.Generator().to(device)
        D = gan3d.Discriminator().to(device)
        if cfg.memory_format == "channels_last":
            G, D = G.to(memory_format=fmt), D.to(memory_format=fmt)
        opt_g = torch.optim.Adam(G.parameters(), lr=1e-3)
        opt_d = torch.optim.Adam(D.parameters(), lr=1e-3)
        x = torch.rand(cfg.batch, 1, 25, 25, 25, device=device)
        if cfg.memory_format == "channels_last":
            x = x.contiguous(memory_format=fmt)
        e = torch.rand(cfg.batch, device=device) * 4.9 + 0.1
        rng = torch.Generator(device).manual_seed(0)

        def step() -> None:
            with autocast(torch, cfg.precision, device):
                gan3d.gan_iteration(G, D, opt_g, opt_d, x, e, rng, host=False)

        return step, "hpcai models/gan3d.py gan_iteration, Adam, no engine"
    fmt = torch.channels_last
    net, what = resnet_net(cfg.model)
    net = net.to(device)
    if cfg.memory_format == "channels_last":
        net = net.to(memory_format=fmt)
    opt = torch.optim.SGD(net.parameters(), lr=0.0125, momentum=0.9, weight_decay=1e-4)
    x = torch.randn(cfg.batch, 3, image_size, image_size, device=device)
    if cfg.memory_format == "channels_last":
        x = x.contiguous(memory_format=fmt)
    y = torch.randint(0, 1000, (cfg.batch,), device=device)

    def step() -> None:
        with autocast(torch, cfg.precision, device):
            loss = F.cross_entropy(net(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step, what + ", SGD momentum 0.9"


def plain_trial(cfg: Config, args) -> tuple[float, str]:
    import torch

    set_precision(torch, cfg.precision, args.device)
    step, what = plain_step(torch, cfg, args.device, args.image_size)
    for _ in range(args.warmup):
        step()
    sync(torch, args.device)
    n = cfg.steps * (args.epochs - 1)
    start = time.perf_counter()
    for _ in range(n):
        step()
    sync(torch, args.device)
    rate = n * cfg.batch / (time.perf_counter() - start)
    del step
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return rate, what


# -- the hpcai side -----------------------------------------------------------------------
def launcher(args) -> list[str]:
    if args.launch:
        return shlex.split(args.launch)
    if shutil.which("hpcai-launch"):
        return ["hpcai-launch", "-N", "1", "--", "train"]
    return [sys.executable, "-m", "hpcai.training"]


def train_argv(cfg: Config, args, out: Path, data: Path | None) -> list[str]:
    argv = [cfg.model, "--device", args.device, "--batch-size", str(cfg.batch),
            "--epochs", str(args.epochs), "--max-steps", str(cfg.steps), "--eval-samples", "0",
            "--verify-every", "0", "--keep", "1", "--out", str(out)]
    if args.device == "cuda":
        argv += ["--precision", cfg.precision]
    if cfg.memory_format == "contiguous":
        argv.append("--channels-first")
    if cfg.gan:
        argv += ["--data", str(data), "--validate-events", "0"]
    else:
        argv += ["--image-size", str(args.image_size), "--samples", str(cfg.batch * cfg.steps)]
    return argv


def hpcai_trial(cfg: Config, args, work: Path, data: Path | None,
                timeout: float) -> tuple[float, dict]:
    """samples/s of the epochs after the first, and the run's details."""
    out = Path(tempfile.mkdtemp(prefix="train-", dir=work))
    argv = launcher(args) + train_argv(cfg, args, out, data)
    start = time.perf_counter()
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                             stdin=subprocess.DEVNULL, check=False)
        wall = time.perf_counter() - start
        if run.returncode != 0:
            raise RuntimeError(f"{shlex.join(argv)} exited {run.returncode}: "
                               f"{(run.stderr or run.stdout)[-1500:]}")
        records = [json.loads(line) for line in (out / "epochs.jsonl").read_text().splitlines()]
    finally:
        shutil.rmtree(out, ignore_errors=True)
    steady = [r["samples_per_s"] for r in records[1:]]
    if not steady:
        raise RuntimeError(f"{shlex.join(argv)} wrote {len(records)} epoch record(s)")
    last = records[-1]
    info = {"argv": argv[len(launcher(args)):], "wall_s": round(wall, 2),
            "epochs_samples_per_s": [r["samples_per_s"] for r in records],
            "precision": last.get("precision"), "memory_format": last.get("memory_format"),
            "pct_of_peak": last["pct_of_peak"], "peak": last["peak"],
            "comm": last["provenance"]["comm"], "data_s": last["data_s"]}
    return statistics.fmean(steady), info


def gan_data(work: Path, events: int) -> Path:
    """Two files of ``events`` generated showers (training and held out)."""
    from hpcai.training.showers import generate

    data = work / "gan-data"
    generate(data, n_files=2, events_per_file=events, seed=1234)
    return data


# -- the run ------------------------------------------------------------------------------
def configs(args) -> list[Config]:
    out = []
    for batch in args.batches:
        for precision in args.precisions:
            out.append(Config(f"{args.model}-b{batch}-{precision}-{args.memory_format}",
                              args.model, batch, precision, args.memory_format,
                              args.steps or max(8, 2048 // batch)))
    if args.gan_batch:
        gan = [(args.precisions[0], args.memory_format, True)]
        if args.gan_variants:
            gan += [("bf16", args.memory_format, False),
                    (args.precisions[0], "contiguous" if args.memory_format == "channels_last"
                     else "channels_last", False)]
        for precision, fmt, primary in gan:
            if args.device != "cuda" and precision != "fp32":
                continue
            out.append(Config(f"3dgan-b{args.gan_batch}-{precision}-{fmt}", "3dgan",
                              args.gan_batch, precision, fmt, args.gan_steps, primary))
    return out


def pair(cfg: Config, args, work: Path, data: Path | None, left: float, log) -> None:
    """One trial of each side, plain first in odd pairs; raises on a failed trial."""
    order = ("plain", "hpcai") if len(cfg.hpcai) % 2 == 0 else ("hpcai", "plain")
    got = {}
    for side in order:
        if side == "plain":
            got["plain"], what = plain_trial(cfg, args)
            if what not in cfg.notes:
                cfg.notes.append(what)
        else:
            got["hpcai"], info = hpcai_trial(cfg, args, work, data, timeout=max(left, 30))
            log.append({"config": cfg.key, **info})
    cfg.plain.append(round(got["plain"], 3))
    cfg.hpcai.append(round(got["hpcai"], 3))
    print(f"{cfg.key}: plain {got['plain']:.1f}, hpcai {got['hpcai']:.1f} samples/s "
          f"(pair {len(cfg.hpcai)})", flush=True)


def document(args, info: dict, todo: list[Config], failures: list[str], log: list[dict],
             elapsed: float) -> dict:
    """The result as it stands (written after every pair, so a run cut short keeps it)."""
    import torch

    rows = []
    for cfg in todo:
        stats = interval(cfg.ratios())
        rows.append({
            "key": cfg.key, "model": cfg.model, "batch": cfg.batch, "precision": cfg.precision,
            "memory_format": cfg.memory_format, "steps_per_epoch": cfg.steps,
            "primary": cfg.primary,
            "ratio_of": ("hpcai / 158 samples/s (before, issue 40)" if cfg.gan
                         else "hpcai / plain"),
            "target": cfg.target, "plain_samples_per_s": cfg.plain,
            "hpcai_samples_per_s": cfg.hpcai,
            "hpcai_over_plain": interval([h / p for h, p in zip(cfg.hpcai, cfg.plain)]),
            "ratio": stats, "verdict": verdict(stats, cfg.target), "plain_is": cfg.notes})
    judged = [r["verdict"] for r in rows if r["primary"]]
    overall = ("met" if judged and all(v == "met" for v in judged)
               else "missed" if "missed" in judged else "unresolved")
    cuda = args.device == "cuda"
    return {
        "benchmark": "gpu_parity",
        "provenance": {**info, "torch": torch.__version__, "cuda": torch.version.cuda,
                       "cudnn": torch.backends.cudnn.version() if cuda else None,
                       "gpu": torch.cuda.get_device_name() if cuda else None,
                       "torchvision": _version("torchvision")},
        "settings": {"device": args.device, "image_size": args.image_size,
                     "epochs_per_hpcai_trial": args.epochs, "warmup_steps": args.warmup,
                     "budget_s": args.budget_s, "min_pairs": args.min_pairs,
                     "max_pairs": args.max_pairs, "launcher": launcher(args),
                     "interval": "Student t 95 % of the mean of per-pair ratios",
                     "precisions": "fp32: TF32 off; tf32: TF32 on for matmul and cuDNN; "
                                   "bf16: autocast to bfloat16, TF32 on (both sides)"},
        "rows": rows, "verdict": overall, "failures": failures, "hpcai_runs": log,
        "elapsed_s": round(elapsed, 1),
    }


def run_parity(args) -> dict:
    start = time.perf_counter()
    info = provenance()
    todo = configs(args)
    work = Path(tempfile.mkdtemp(prefix="gpu-parity-"))
    log: list[dict] = []
    failures: list[str] = []

    def save() -> dict:
        doc = document(args, info, todo, failures, log, time.perf_counter() - start)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
        return doc

    try:
        data = (gan_data(work, args.gan_batch * args.gan_steps)
                if any(c.gan for c in todo) else None)
        pair_s: dict[str, float] = {}
        failed: set[str] = set()
        while True:
            primary_short = any(c.primary and len(c.hpcai) < args.min_pairs
                                and not decided(c, args.min_pairs) for c in todo)
            ran = False
            for cfg in todo:
                if (len(cfg.hpcai) >= args.max_pairs or decided(cfg, args.min_pairs)
                        or cfg.key in failed or (not cfg.primary and primary_short)):
                    continue
                left = args.budget_s - (time.perf_counter() - start)
                if left < pair_s.get(cfg.key, args.first_pair_s):
                    continue
                t0 = time.perf_counter()
                try:
                    pair(cfg, args, work, data, left, log)
                except (RuntimeError, subprocess.TimeoutExpired, OSError) as exc:
                    failed.add(cfg.key)
                    failures.append(f"{cfg.key}: {exc}"[:2000])
                    print(f"{cfg.key}: trial failed: {str(exc)[:400]}", flush=True)
                pair_s[cfg.key] = time.perf_counter() - t0
                ran = True
                save()
            if not ran:
                break
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return save()


def _version(name: str) -> str | None:
    try:
        return __import__(name).__version__
    except ImportError:
        return None


def run_profile(args) -> dict:
    """The 3DGAN's training step as ``train`` runs it, under torch.profiler."""
    import numpy as np
    import torch
    from torch.profiler import ProfilerActivity, profile

    from hpcai.training import config, tasks
    from hpcai.training.device_data import DeviceData
    from hpcai.training.torch_trainer import precision_settings

    device = torch.device(args.device)
    precision = args.precisions[0]
    argv = ["3dgan", "--generate", "1", "--device", args.device, "--batch-size",
            str(args.gan_batch)]
    if args.device == "cuda":
        argv += ["--precision", precision]
    if args.memory_format == "contiguous":
        argv.append("--channels-first")
    cfg = config.parse(argv)
    precision_settings(cfg.precision, device)
    task = tasks.make_task(cfg, cfg.lr, device)
    work = Path(tempfile.mkdtemp(prefix="gpu-profile-"))
    try:
        from hpcai.training.shower_data import ShowerReader, find_files, validate

        gan_data(work, args.gan_batch * 4)
        reader = ShowerReader(validate(find_files(work / "gan-data")))
        data = DeviceData(reader, device)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    batches = [data.read(np.arange(i * args.gan_batch, (i + 1) * args.gan_batch) % len(data))
               for i in range(4)]

    def steps(n: int) -> float:
        sync(torch, args.device)
        t0 = time.perf_counter()
        for i in range(n):
            x, e = batches[i % len(batches)]
            task.train_step(x, e, torch.Generator(device).manual_seed(i), None)
        sync(torch, args.device)
        return (time.perf_counter() - t0) / n

    steps(args.warmup)
    plain_s = steps(args.profile_steps)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if args.device == "cuda"
                                           else [])
    with profile(activities=activities) as prof:
        profiled_s = steps(args.profile_steps)
    sort = "self_device_time_total" if args.device == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    table = averages.table(sort_by=sort, row_limit=25, max_name_column_width=60)
    rows = []
    for ev in averages:
        device_us = getattr(ev, "self_device_time_total", None)
        if device_us is None:
            device_us = getattr(ev, "self_cuda_time_total", 0)
        rows.append({"name": ev.key, "calls": ev.count,
                     "self_device_us": round(float(device_us or 0), 1),
                     "self_cpu_us": round(float(ev.self_cpu_time_total), 1)})
    key = "self_device_us" if args.device == "cuda" else "self_cpu_us"
    rows.sort(key=lambda r: -r[key])
    total = sum(r[key] for r in rows)
    header = (f"3DGAN training step (hpcai GanTask.train_step) on "
              f"{torch.cuda.get_device_name() if args.device == 'cuda' else 'the CPU'}, batch "
              f"{args.gan_batch}, precision {cfg.precision}, {cfg.memory_format}; "
              f"{args.profile_steps} steps after {args.warmup} warm-up: "
              f"{plain_s * 1e3:.1f} ms/step unprofiled ({args.gan_batch / plain_s:.1f} "
              f"samples/s), {profiled_s * 1e3:.1f} ms/step profiled; sorted by {sort}\n")
    Path(args.profile).write_text(header + table + "\n")
    doc = {"benchmark": "gpu_profile_3dgan", "provenance": provenance(),
           "torch": torch.__version__, "batch": args.gan_batch, "precision": cfg.precision,
           "memory_format": cfg.memory_format, "steps": args.profile_steps,
           "ms_per_step": round(plain_s * 1e3, 2),
           "ms_per_step_profiled": round(profiled_s * 1e3, 2),
           "samples_per_s": round(args.gan_batch / plain_s, 1), "sorted_by": key,
           "total_self_us": round(total, 1), "top": rows[:25]}
    Path(args.profile).with_suffix(".json").write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", type=Path, help="write the result here (parity)")
    p.add_argument("--profile", type=Path, help="profile the 3DGAN step instead; the table")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--model", choices=("resnet50", "resnet-tiny"), default="resnet50")
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--batches", type=lambda s: [int(v) for v in s.split(",") if v],
                   default=[64, 256], help="ResNet batches (empty: none)")
    p.add_argument("--precisions", type=lambda s: s.split(","), default=None,
                   help="default tf32,bf16 on cuda, fp32 on cpu")
    p.add_argument("--memory-format", choices=("channels_last", "contiguous"),
                   default="channels_last")
    p.add_argument("--steps", type=int, default=0,
                   help="ResNet steps per epoch (default max(8, 2048 / batch))")
    p.add_argument("--epochs", type=int, default=3, help="per hpcai trial; the first is "
                   "left out, the plain side times as many steps as the others")
    p.add_argument("--warmup", type=int, default=10, help="plain side's untimed steps")
    p.add_argument("--gan-batch", type=int, default=64, help="0: no 3DGAN")
    p.add_argument("--gan-steps", type=int, default=10, help="3DGAN steps per epoch")
    p.add_argument("--gan-variants", action="store_true",
                   help="also bf16 and the other memory format for the 3DGAN (secondary)")
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=360)
    p.add_argument("--first-pair-s", type=float, default=25,
                   help="time a configuration's first pair is assumed to need")
    p.add_argument("--min-pairs", type=int, default=3)
    p.add_argument("--max-pairs", type=int, default=8)
    p.add_argument("--launch", default="",
                   help="command before the train arguments (default: hpcai-launch -N 1 -- "
                        "train if on PATH, else this python -m hpcai.training)")
    args = p.parse_args(argv)
    if args.precisions is None:
        args.precisions = ["tf32", "bf16"] if args.device == "cuda" else ["fp32"]
    if not args.json and not args.profile:
        p.error("give --json PATH (parity) or --profile PATH")
    if args.device == "cpu" and set(args.precisions) != {"fp32"}:
        p.error("the CPU runs fp32 only")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.profile:
        doc = run_profile(args)
        print(Path(args.profile).read_text(), flush=True)
        print(f"profile: {doc['ms_per_step']} ms/step, {doc['samples_per_s']} samples/s",
              flush=True)
        return 0
    doc = run_parity(args)
    for row in doc["rows"]:
        r = row["ratio"]
        ci = "none" if r["ci95"] is None else f"[{r['ci95'][0]:.3f}, {r['ci95'][1]:.3f}]"
        print(f"{row['key']}: {row['ratio_of']} mean {r['mean']} 95% {ci} (n={r['n']}), "
              f"target >= {row['target']}: {row['verdict']}", flush=True)
    print(f"verdict: {doc['verdict']} ({doc['elapsed_s']} s); {args.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
