"""Judge a 3DGAN run's checkpoint again on more held-out events and more generated showers per
event than its in-training validation used (issue 17).

The in-training validation of ``bench/learning.py`` runs on 128 held-out events, one
generated shower each: about 25 events per energy bin. With the generated event-to-event
spread of Σcells ÷ E at about 30 % of the mean, a bin's generated/real − 1 then has a
standard error of about 6 %, which is too coarse for a 15 % tolerance. This script loads a
PyTorch checkpoint of the run (default: the last one) and rebuilds the task from the
configuration stored in it. It runs the same physics validation
(``training.validation.PhysicsValidator``) on ``--events`` held-out events with ``--draws``
latent vectors each, in one process. The events and the first draw are the in-training
validation's, so its first ``validate-events`` events of draw 0 are the same showers.

The generator runs with rank 0's BatchNorm statistics for every event. In training each rank
used its own statistics for its share of the events.

The JSON (``--json``, default ``bench/results/rejudge-RUN-HOST-DATE.json``) holds the
provenance, the checkpoint (epoch, step, configuration), each generator's validation as in
``physics.json``, and per bin the difference with its standard error. Beside them it holds the
in-training validation of the same epoch from ``RUN/physics.json``, for comparison.

With ``--split`` (an even ``--draws``) it also judges the first and the second half of the
draws apart, on the same real events: two independent estimates of each bin's generated
sampling fraction. Their difference, over its standard error from the generated spreads
(``z``), checks the standard error the verdict leans on: with a right error, ``|z|`` exceeds 2
in about one bin in twenty, and the sum of ``z²`` over the bins is about their number.

With ``--standing`` it then measures the generator's BatchNorm statistics afresh for the
checkpoint's weights (``training.averaging.standing_statistics`` on the batches the weight
average uses: E' * z drawn as in training from a fixed seed) and judges it again on the same
events and latent vectors (``standing`` in the JSON). The first judgement, with the moving
statistics the checkpoint carries, is the control: the difference between the two is what the
statistics, not the weights, do to each bin. For a run trained with ``--validate-bn standing``
the first judgement is still the moving statistics', and ``--standing`` is its own validation.

With ``--batch-statistics`` it last judges the generator as it runs in the generator steps of
training: BatchNorm normalising each batch of the run's batch size (consecutive held-out
events, whose energies are as mixed as a training batch's) with that batch's own statistics
(``batch_statistics`` in the JSON). The sampling-fraction term of the generator's loss is
optimised in that mode, and the validation judges the other; a bin that is right here and
wrong with the moving or standing statistics is a gap between the two modes, not in the
weights.

The JSON's ``response`` (also printed) gives, per bin and for the first generator, the shape
of the per-event Σcells ÷ E distribution, which the verdict's mean hides: the generated
mean's and median's difference from the real ones, the generated 10th and 90th percentiles
over the real median, the share of generated showers below half and above 1.5 times the real
median, and both sides' coefficients of variation.

    python bench/rejudge.py RUN_DIR [--checkpoint PATH] [--events 512] [--draws 4] [--split]
                                    [--standing] [--batch-statistics]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from common import RESULTS, provenance, result_name
from learning import bin_label


def bins_of(v: dict) -> list[dict]:
    """Per energy bin: real events, generated/real - 1 and its standard error."""
    return [{"bin_gev": bin_label(b), "events": b["events"],
             "sampling_fraction_rel_diff": b["sampling_fraction_rel_diff"],
             "sampling_fraction_rel_se": b.get("sampling_fraction_rel_se")}
            for b in v["bins"] if b["events"]]


def judged_rows(validations) -> list[dict]:
    """Per generator judged: its name and :func:`bins_of` its comparison."""
    return [{"generator": v.generator, "bins": bins_of(v.to_dict())} for v in validations]


def split_halves(a: dict, b: dict) -> dict:
    """Per bin, the first and second half's generated/real - 1, their difference and its
    standard error from the generated side only (the real events are the same in both)."""
    rows = []
    for x, y in zip(a["bins"], b["bins"]):
        if x["events"] * a["draws"] < 2 or None in (x["sampling_fraction_rel_diff"],
                                                    y["sampling_fraction_rel_diff"]):
            continue   # one shower per half: no spread to judge the difference by
        real = x["real"]["sampling_fraction"]
        se = math.sqrt(sum((v["gen"]["sampling_fraction_std"] / real) ** 2
                           / (v["events"] * a["draws"]) for v in (x, y)))
        diff = x["sampling_fraction_rel_diff"] - y["sampling_fraction_rel_diff"]
        rows.append({"bin_gev": bin_label(x), "halves": [x["sampling_fraction_rel_diff"],
                                                         y["sampling_fraction_rel_diff"]],
                     "difference": diff, "difference_se": se, "z": diff / se})
    zs = [r["z"] for r in rows]
    return {"draws_per_half": a["draws"], "bins": rows,
            "max_abs_z": max((abs(z) for z in zs), default=None),
            "sum_z2": sum(z * z for z in zs), "bins_judged": len(zs)}


def response_shape(real, gen) -> list[dict]:
    """Per energy bin (``training.physics.bin_masks``), the distribution of the per-event
    Σcells ÷ E of ``gen`` (``real``'s energies, once or K times over) against ``real``'s."""
    import numpy as np

    from hpcai.training.physics import ENERGY_BINS_GEV as EDGES
    from hpcai.training.physics import bin_masks, sum_over_energy

    draws = len(gen) // len(real)
    r_all, g_all = sum_over_energy(real), sum_over_energy(gen)
    rows = []
    for lo, hi, mask in zip(EDGES[:-1], EDGES[1:], bin_masks(real.energy_gev, EDGES)):
        r, g = r_all[mask], g_all[np.tile(mask, draws)]
        if not len(r):
            continue
        median = float(np.median(r))
        rows.append({
            "bin_gev": bin_label({"e_lo_gev": lo, "e_hi_gev": hi}),
            "events": int(len(r)), "showers": int(len(g)),
            "mean_rel_diff": float(g.mean() / r.mean() - 1),
            "median_rel_diff": float(np.median(g) / median - 1),
            "gen_q10_over_real_median": float(np.quantile(g, 0.1) / median),
            "gen_q90_over_real_median": float(np.quantile(g, 0.9) / median),
            "gen_below_half": float((g < 0.5 * median).mean()),
            "gen_above_1_5": float((g > 1.5 * median).mean()),
            "real_cv": float(r.std() / r.mean()),
            "gen_cv": float(g.std() / g.mean()) if g.mean() else None})
    return rows


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a train 3dgan --out directory")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="default: the run's last checkpoint")
    parser.add_argument("--events", type=int, default=512)
    parser.add_argument("--draws", type=int, default=4)
    parser.add_argument("--split", action="store_true",
                        help="also judge each half of the draws apart (checks the error)")
    parser.add_argument("--standing", action="store_true",
                        help="also judge with the generator's BatchNorm statistics measured "
                             "afresh for its weights")
    parser.add_argument("--batch-statistics", action="store_true",
                        help="also judge with BatchNorm on each batch's own statistics, as in "
                             "the generator steps of training")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    physics_file = args.run / "physics.json"
    checkpoints = sorted((args.run / "checkpoints").glob("ckpt-*.pt"))
    ckpt = args.checkpoint or (checkpoints[-1] if checkpoints else None)
    if ckpt is None or not ckpt.is_file() or not physics_file.is_file():
        print(f"error: {args.run} has no checkpoint or no physics.json\n"
              "hint: give the --out directory of a train 3dgan run with physics validation",
              file=sys.stderr)
        return 2
    if args.events < 1 or args.draws < 1:
        print(f"error: --events and --draws must be at least 1, got {args.events} and "
              f"{args.draws}\nhint: e.g. --events 512 --draws 4", file=sys.stderr)
        return 2
    if args.split and (args.draws < 2 or args.draws % 2):
        print(f"error: --split needs an even --draws of at least 2, got {args.draws}\n"
              "hint: e.g. --draws 4 --split", file=sys.stderr)
        return 2
    info = provenance()

    import torch
    from mpi4py import MPI

    from hpcai.training import physics
    from hpcai.training.config import TrainConfig
    from hpcai.training.shower_data import validate
    from hpcai.training.tasks import make_task
    from hpcai.training.validation import PhysicsValidator, entry

    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    if state.get("framework", "pytorch") != "pytorch" or state.get("model") != "3dgan":
        print(f"error: {ckpt} is not a PyTorch 3dgan checkpoint\n"
              "hint: rejudge reads train 3dgan --framework pytorch runs", file=sys.stderr)
        return 2
    # the first judgement is always the checkpoint's own statistics (the control), also for a
    # run validated with --validate-bn standing, whose own validation --standing repeats
    cfg = TrainConfig(**{**state["config"], "loss_weights": tuple(state["config"]["loss_weights"]),
                         "device": "cpu", "validate_bn": "moving"})
    task = make_task(cfg, cfg.lr, torch.device("cpu"))
    for name, module in task.modules.items():
        module.load_state_dict(state["modules"][name])
    task.load_extra_state(state.get("extra", {}))
    doc = json.loads(physics_file.read_text())
    held_out = validate([Path(p) for p in doc["held_out"]["files"]])
    validator = PhysicsValidator(held_out, args.events, cfg.seed, MPI.COMM_SELF, args.draws)
    # an epoch's end is written as (epoch + 1, step 0); a checkpoint within an epoch as
    # (epoch, step), which no in-training validation matches
    end_of_epoch = state["step"] == 0
    epoch = state["epoch"] - 1 if end_of_epoch else state["epoch"]
    gathered = validator.summaries(task)   # one pass; --split judges its halves apart
    assert gathered is not None
    validations = validator.compare(gathered, task, epoch)
    # the first generator's showers, draw after draw, each in rank order (as compare has them)
    real = physics.concat([m[0] for m in gathered])
    first_gen = physics.concat([m[1][d] for d in range(args.draws) for m in gathered])
    in_training = next((v for v in doc["validations"] if v["epoch"] == epoch), None) \
        if end_of_epoch else None
    result = {
        "benchmark": "rejudge", "provenance": info,
        "run": str(args.run), "checkpoint": ckpt.name, "epoch": epoch,
        "step_in_epoch": state["step"],
        "global_step": state["global_step"], "config": state["config"],
        "settings": {"events": validator.total, "draws": args.draws,
                     "held_out": doc["held_out"], "batchnorm_statistics": "rank 0's"},
        "judged": judged_rows(validations),
        "in_training": (None if in_training is None else
                        [{"generator": v.get("generator", "raw"), "events": v["events"],
                          "bins": bins_of(v)}
                         for v in [in_training, *in_training.get("others", [])]]),
        "validations": [entry(validations)],
        "split": None,
        "standing": None,
        "batch_statistics": None,
        "response": {"generator": task.generators[0], "bins": response_shape(real, first_gen)},
    }
    if args.split:
        h = args.draws // 2
        halves = [validator.compare(gathered, task, epoch, draws)[0].to_dict()
                  for draws in (range(h), range(h, args.draws))]
        result["split"] = split_halves(*halves)
    if args.standing:
        from hpcai.training.averaging import standing_statistics
        from hpcai.training.tasks import STANDING_SEED
        batches = standing_statistics(task.G, task._generator_inputs())
        again = validator.compare(validator.summaries(task), task, epoch)
        result["standing"] = {
            "batches": batches, "batch_size": cfg.batch_size, "seed": STANDING_SEED,
            "judged": judged_rows(again), "validations": [entry(again)]}
    if args.batch_statistics:
        again = validator.compare(validator.summaries(task, batch_chunk=cfg.batch_size), task,
                                  epoch)
        result["batch_statistics"] = {
            "batch_size": cfg.batch_size,
            "judged": judged_rows(again), "validations": [entry(again)]}
    for side, rows in (("rejudged", result["judged"]), ("in training", result["in_training"]),
                       ("standing", (result["standing"] or {}).get("judged")),
                       ("batch stats", (result["batch_statistics"] or {}).get("judged"))):
        for g in rows or []:
            cells = "  ".join(f"{b['bin_gev']}: {b['sampling_fraction_rel_diff']:+.3f}"
                              + (f" ± {b['sampling_fraction_rel_se']:.3f}"
                                 if b["sampling_fraction_rel_se"] is not None else "")
                              for b in g["bins"])
            print(f"{side:11s} {g['generator']:7s} {cells}")
    for row in result["response"]["bins"]:
        print(f"response    {row['bin_gev']}: mean {row['mean_rel_diff']:+.3f} median "
              f"{row['median_rel_diff']:+.3f}, generated 10-90 % "
              f"{row['gen_q10_over_real_median']:.2f}-{row['gen_q90_over_real_median']:.2f} "
              f"of the real median, spread (cv) {_number(row['gen_cv'])} against "
              f"{_number(row['real_cv'])}")
    if result["split"] is not None:
        sp = result["split"]
        print("halves      " + "  ".join(f"{r['bin_gev']}: {r['halves'][0]:+.3f} vs "
                                         f"{r['halves'][1]:+.3f} (z {r['z']:+.1f})"
                                         for r in sp["bins"]))
        print(f"split check: max |z| {sp['max_abs_z']:.2f}, sum z² {sp['sum_z2']:.1f} over "
              f"{sp['bins_judged']} bins (about {sp['bins_judged']} if the error is right)")
    path = args.json or RESULTS / result_name(f"rejudge-{args.run.name}", info)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, allow_nan=False) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
