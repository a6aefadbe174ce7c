"""The 3DGAN's training recipes: named sets of tuning settings ``train 3dgan`` starts from.

``--recipe learning`` (the default with PyTorch) is the recipe of the three-seed learning
test (``bench/results/learning-vm-prospective-standing.json``: 80 epochs x 16 steps on
2 ranks, every seed passed); ``--recipe cern2019`` is the setup of CERN's 2019 trainer
behind the papers (the default with TensorFlow, which implements no other). A tuning flag
given on the command line overrides the recipe's value; :attr:`TrainConfig.overrides
<.config.TrainConfig.overrides>` names those. A resumed run without ``--recipe`` takes the
checkpoint's recipe (:func:`for_resume`), so it goes on with the settings it started with.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from ..core.errors import UserError


@dataclass(frozen=True)
class Recipe:
    """The tuning settings of one recipe (the fields of ``TrainConfig`` they set)."""

    batch_size: int           # per rank
    lr: float                 # per rank, before --lr-scaling
    optimizer: str
    warmup_epochs: float
    lr_decay: str             # training/schedule.py; "step": a tenth after 80 % of the steps
    cell_scale: float         # the networks see the cells in GeV x cell_scale
    validate_bn: str          # the judged and exported generator's BatchNorm statistics

    def settings(self) -> dict:
        return asdict(self)


RECIPES = {
    "learning": Recipe(batch_size=16, lr=2e-4, optimizer="adam", warmup_epochs=0.0,
                       lr_decay="step", cell_scale=100.0, validate_bn="standing"),
    "cern2019": Recipe(batch_size=16, lr=1e-3, optimizer="adam", warmup_epochs=0.0,
                       lr_decay="none", cell_scale=1.0, validate_bn="moving"),
}
TUNED = tuple(Recipe.__dataclass_fields__)   # the settings a recipe sets
DEFAULT = {"pytorch": "learning", "tensorflow": "cern2019"}
LEGACY = "cern2019"   # checkpoints written before recipes: the defaults of the time
HELP = ("3dgan: the tuning settings to start from; a flag given overrides its value. "
        "learning (default with PyTorch): --batch-size 16 --lr 2e-4 --lr-decay step "
        "--cell-scale 100 --validate-bn standing, the recipe that passed the three-seed "
        "learning test; cern2019 (default with TensorFlow): CERN's 2019 trainer, --batch-size "
        "16 --lr 1e-3 --lr-decay none --cell-scale 1 --validate-bn moving (docs/3dgan.md)")


def choose(name: str | None, framework: str) -> str:
    """The recipe a run uses: ``name`` (``--recipe``) or the framework's default."""
    name = name or DEFAULT[framework]
    if name not in RECIPES:
        raise UserError(f"--recipe {name}: no such recipe",
                        f"use one of {', '.join(RECIPES)} (train --help says what each sets)")
    if framework == "tensorflow" and name != "cern2019":
        raise UserError(f"--recipe {name} is implemented for PyTorch only (its --cell-scale "
                        f"and --validate-bn)",
                        "use --recipe cern2019 (the default with --framework tensorflow), or "
                        "--framework pytorch")
    return name


def apply(values: dict, name: str, overrides: tuple[str, ...]) -> dict:
    """``values`` (``TrainConfig`` fields) with recipe ``name``'s settings, except those in
    ``overrides`` (given on the command line)."""
    out = dict(values)
    out.update({k: v for k, v in RECIPES[name].settings().items() if k not in overrides})
    out["recipe"] = name
    return out


def for_resume(values: dict, saved: dict) -> tuple[dict, str | None]:
    """A resumed 3DGAN run's settings (``TrainConfig`` fields) given its checkpoint's
    ``saved`` config: without ``--recipe`` on the command line, the checkpoint's recipe
    (``cern2019`` for a checkpoint from before recipes), the flags given still overriding.
    Returns (the fields, a note for the log when the recipe changed, else None)."""
    if values.get("recipe") is None or "recipe" in values.get("overrides", ()):
        return values, None
    name = saved.get("recipe") or LEGACY
    if name == values["recipe"]:
        return values, None
    if name not in RECIPES:
        raise UserError(f"--resume: the checkpoint was trained with recipe {name!r}, which "
                        "this hpcai does not know",
                        f"give --recipe with one of {', '.join(RECIPES)} to resume with it")
    note = (f"--resume: recipe {name}, as the checkpoint's"
            + ("" if "recipe" in saved else " (written before recipes: the defaults then)")
            + f", not the default {values['recipe']} (give --recipe to change it)")
    return apply(values, name, values.get("overrides", ())), note


def settings_line(cfg) -> str | None:
    """For ``hpcai-launch --dry-run``: the recipe a 3DGAN ``TrainConfig`` starts from and the
    values of every setting it tunes (flags given included), or None for another model."""
    if cfg.recipe is None:
        return None
    values = [(key.replace("_", "-"), getattr(cfg, key)) for key in TUNED]
    settings = ", ".join(f"{name} {value:g}" if isinstance(value, float) else f"{name} {value}"
                         for name, value in values)
    resumed = (" (a resumed run takes its checkpoint's recipe)"
               if cfg.resume and "recipe" not in cfg.overrides else "")
    head = describe(cfg.recipe, cfg.overrides).removesuffix(", ")
    return f"{cfg.model}, {head}{resumed}: {settings}"


def describe(name: str | None, overrides: tuple[str, ...]) -> str:
    """For the start-up line: "recipe NAME, " (with the flags that override it), or ""."""
    if name is None:
        return ""
    flags = ["--" + key.replace("_", "-") for key in overrides if key != "recipe"]
    return f"recipe {name}" + (f" ({' '.join(flags)} given)" if flags else "") + ", "
