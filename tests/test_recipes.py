"""3DGAN recipes (training/recipes.py): the default is the recipe of the three-seed learning
test, ``--recipe cern2019`` the old defaults, flags given override a recipe, and a resumed run
keeps its checkpoint's recipe."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import base_env, run
from hpcai.core.errors import UserError
from hpcai.training import recipes
from hpcai.training.config import parse
from jobs import train

# bench/results/learning-vm-prospective-standing.json: budget.batch_per_rank and train_args
# (--cell-scale 100 --lr 2e-4 --lr-decay step --validate-bn standing), optimizer and warm-up
# at the defaults of that run (adam, 0)
PROSPECTIVE = {"batch_size": 16, "lr": 2e-4, "optimizer": "adam", "warmup_epochs": 0.0,
               "lr_decay": "step", "cell_scale": 100.0, "validate_bn": "standing"}
CERN2019 = {"batch_size": 16, "lr": 1e-3, "optimizer": "adam", "warmup_epochs": 0.0,
            "lr_decay": "none", "cell_scale": 1.0, "validate_bn": "moving"}


def tuned(cfg) -> dict:
    return {key: getattr(cfg, key) for key in PROSPECTIVE}


def test_the_default_is_the_prospective_tests_recipe():
    cfg = parse(["3dgan", "--generate", "8"])
    assert tuned(cfg) == PROSPECTIVE
    assert cfg.recipe == "learning" and cfg.overrides == ()
    assert cfg.to_dict()["recipe"] == "learning"   # what a checkpoint records


def test_cern2019_gives_the_old_defaults():
    cfg = parse(["3dgan", "--generate", "8", "--recipe", "cern2019"])
    assert tuned(cfg) == CERN2019 and cfg.recipe == "cern2019"
    assert cfg.overrides == ("recipe",)
    assert tuned(parse(["3dgan", "--generate", "8", "--framework", "tensorflow"])) == CERN2019


@pytest.mark.parametrize("recipe,flags,changed", [
    ("learning", ["--lr", "1e-3"], {"lr": 1e-3}),
    ("learning", ["--cell-scale", "1", "--validate-bn", "moving"],
     {"cell_scale": 1.0, "validate_bn": "moving"}),
    ("cern2019", ["--lr-decay", "step", "--batch-size", "4"], {"lr_decay": "step",
                                                                "batch_size": 4}),
    ("cern2019", ["--warmup-epochs", "0.5", "--optimizer", "rmsprop"],
     {"warmup_epochs": 0.5, "optimizer": "rmsprop"}),
])
def test_a_flag_given_overrides_the_recipe(recipe, flags, changed):
    cfg = parse(["3dgan", "--generate", "8", "--recipe", recipe, *flags])
    base = PROSPECTIVE if recipe == "learning" else CERN2019
    assert tuned(cfg) == {**base, **changed}
    assert set(cfg.overrides) == {*changed, "recipe"}
    assert cfg.recipe == recipe


def test_resnets_keep_their_own_defaults():
    cfg = parse(["resnet-tiny"])
    assert cfg.recipe is None and (cfg.batch_size, cfg.lr, cfg.optimizer) == (16, 0.0125, "sgd")
    assert cfg.lr_decay == "none" and cfg.warmup_epochs == 0.0


def _values(*argv: str) -> dict:
    return parse(["3dgan", "--generate", "8", *argv]).to_dict()


def test_a_resume_takes_the_checkpoints_recipe():
    saved = _values("--recipe", "cern2019")
    values, note = recipes.for_resume(_values(), saved)
    assert {k: values[k] for k in CERN2019} == CERN2019 and values["recipe"] == "cern2019"
    assert "recipe cern2019, as the checkpoint's" in note
    # the flags given still override it
    values, _ = recipes.for_resume(_values("--lr", "5e-4"), saved)
    assert values["lr"] == 5e-4 and values["cell_scale"] == 1.0
    # a checkpoint from before recipes was trained with the defaults of then: cern2019
    legacy = {k: v for k, v in saved.items() if k not in ("recipe", "overrides")}
    values, note = recipes.for_resume(_values(), legacy)
    assert values["recipe"] == "cern2019" and "written before recipes" in note
    # controls: the same recipe, or --recipe given, leave the settings as parsed
    assert recipes.for_resume(_values(), _values()) == (_values(), None)
    given = _values("--recipe", "learning")
    assert recipes.for_resume(given, saved) == (given, None)
    assert recipes.for_resume(parse(["resnet-tiny"]).to_dict(), saved)[1] is None


def test_a_checkpoints_unknown_recipe_is_a_user_error():
    with pytest.raises(UserError, match="recipe 'cern2031', which this hpcai does not know"):
        recipes.for_resume(_values(), {**_values(), "recipe": "cern2031"})


def test_the_help_names_every_recipe_and_its_values():
    result = run(["train", "--help"], base_env())
    assert result.returncode == 0
    text = " ".join(result.stdout.split())
    for name in recipes.RECIPES:
        assert name in text
    assert "--lr 2e-4 --lr-decay step --cell-scale 100 --validate-bn standing" in text


@pytest.mark.mpi
def test_a_resumed_run_goes_on_with_its_recipe(tmp_path: Path):
    """Started with --recipe cern2019, resumed without --recipe: the second epoch's rate is
    cern2019's 1e-3 (the control, a fresh run's default, is 2e-4, and its first epoch says so),
    and the checkpoint records the recipe."""
    import torch

    out = tmp_path / "run"
    args = ["3dgan", "--generate", "16", "--batch-size", "2", "--max-steps", "1",
            "--validate-events", "0", "--eval-samples", "0", "--peak-gflops", "50",
            "--out", str(out)]
    first = train(1, *args, "--epochs", "1", "--recipe", "cern2019")
    assert first.returncode == 0, first.stderr[-2000:]
    assert "recipe cern2019 (--batch-size given)," in first.stdout
    state = torch.load(out / "checkpoints" / "ckpt-E0001-S000000.pt", weights_only=True)
    assert state["config"]["recipe"] == "cern2019"
    resumed = train(1, *args, "--epochs", "2", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "--resume: recipe cern2019, as the checkpoint's" in resumed.stdout
    lrs = [json.loads(line)["lr"] for line in (out / "epochs.jsonl").read_text().splitlines()]
    assert lrs == [1e-3, 1e-3]
    fresh = tmp_path / "fresh"
    control = train(1, *args[:-1], str(fresh), "--epochs", "1")
    assert control.returncode == 0, control.stderr[-2000:]
    assert "recipe learning (--batch-size given)," in control.stdout
    assert json.loads((fresh / "epochs.jsonl").read_text())["lr"] == pytest.approx(2e-4)


def test_the_launchers_dry_run_names_the_recipe_and_its_values(tmp_path: Path):
    """``hpcai-launch --dry-run -- train 3dgan`` ends with the recipe and every value it
    tunes (a flag given named), says that a resumed run takes its checkpoint's recipe, and
    writes nothing. Control: a ResNet's dry run has no such line."""
    def train_line(*argv: str) -> list[str]:
        got = run(["hpcai-launch", "-N", "2", "--dry-run", "--", "train", *argv,
                   "--out", str(tmp_path / "out")], base_env())
        assert got.returncode == 0, got.stderr
        return [line for line in got.stdout.splitlines() if line.startswith("train:")]

    assert train_line("3dgan", "--generate", "24", "--lr", "5e-4") == [
        "train:     3dgan, recipe learning (--lr given): batch-size 16, lr 0.0005, optimizer "
        "adam, warmup-epochs 0, lr-decay step, cell-scale 100, validate-bn standing"]
    (resumed,) = train_line("3dgan", "--generate", "24", "--resume")
    assert "recipe learning (a resumed run takes its checkpoint's recipe): " in resumed
    (chosen,) = train_line("3dgan", "--generate", "24", "--resume", "--recipe", "cern2019")
    assert chosen.startswith("train:     3dgan, recipe cern2019: batch-size 16, lr 0.001,")
    assert train_line("resnet-tiny") == []
    assert not (tmp_path / "out").exists()
