"""The learning benchmark's verdict (``bench/learning.py``): a run that meets every criterion
passes, each criterion broken alone fails it, and every committed file's verdict is what the
judge says of its runs today."""
from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import learning  # noqa: E402
from jobs import wait_for  # noqa: E402


def _run(seed: int, first: float, last: float, worst_bin: float = 0.1,
         empty: float = 0.0) -> dict:
    point = lambda d: {f"profile_distance_{a}": d for a in "xyz"} | {   # noqa: E731
        "gen_empty_fraction": empty}
    return {"seed": seed, "at": {"start": point(first), "middle": point(first),
                                 "end": point(last)},
            "sampling_fraction_rel_diff_per_bin_end": {"10-100": worst_bin, "100-200": -0.05}}


GOOD = [_run(1, 1.4, 0.50), _run(2, 1.0, 0.45), _run(3, 1.2, 0.55)]


def test_runs_that_meet_every_criterion_pass():
    verdict = learning.judge(GOOD)
    assert verdict["passed"], verdict
    assert len(verdict["checks"]) == 3 * 2 + 3 * (3 + 1)


@pytest.mark.parametrize("seed_index,change,failing", [
    (0, {"worst_bin": 0.16}, "seed 1: sampling fraction within 15 %"),
    (1, {"worst_bin": -0.2}, "seed 2: sampling fraction within 15 %"),
    (2, {"worst_bin": None}, "seed 3: sampling fraction within 15 %"),
    (1, {"last": 0.51}, "seed 2: profile_distance_"),   # x, y and z: not halved
    (0, {"empty": 0.6}, "seed 1: generator alive at the end"),
])
def test_each_criterion_broken_alone_fails(seed_index, change, failing):
    runs = copy.deepcopy(GOOD)
    old = runs[seed_index]
    params = {"first": old["at"]["start"]["profile_distance_x"],
              "last": old["at"]["end"]["profile_distance_x"],
              "worst_bin": old["sampling_fraction_rel_diff_per_bin_end"]["10-100"],
              "empty": 0.0} | change
    runs[seed_index] = _run(old["seed"], **params)
    verdict = learning.judge(runs)
    assert not verdict["passed"]
    failed = [name for name, ok in verdict["checks"].items() if not ok]
    assert failed and all(name.startswith(failing) for name in failed), failed


def test_a_fall_within_the_seed_spread_fails():
    # every seed halves, but the last values spread further than the smallest fall
    runs = [_run(1, 0.2, 0.1), _run(2, 2.0, 0.9), _run(3, 1.0, 0.5)]
    verdict = learning.judge(runs)
    failed = [name for name, ok in verdict["checks"].items() if not ok]
    assert sorted(failed) == sorted(f"profile_distance_{a}: smallest fall 0.1 > seed spread 0.8"
                                    for a in "xyz"), failed


@pytest.mark.parametrize("path", sorted((REPO / "bench" / "results").glob("learning-*.json")),
                         ids=lambda p: p.name)
def test_committed_verdicts_are_the_judges(path):
    doc = json.loads(path.read_text())
    assert doc["verdict"] == learning.judge(doc["runs"])
    if doc.get("budgets") is not None:
        assert doc["budgets"] == learning.budgets(doc["runs"], doc["budget"]["steps_per_epoch"])
    raw = learning.raw_side(doc["runs"])
    assert ("raw_generator" in doc) is (raw is not None)
    if raw is not None:   # --generator-ema: the raw generator judged as the control
        assert doc["raw_generator"]["verdict"] == learning.judge(raw)


def test_a_doctored_verdict_is_caught():
    path = sorted((REPO / "bench" / "results").glob("learning-*.json"))[0]
    doc = json.loads(path.read_text())
    doc["verdict"]["passed"] = not doc["verdict"]["passed"]
    assert doc["verdict"] != learning.judge(doc["runs"])


def test_end_bin_spread_is_std_over_mean_per_side():
    side = lambda mean, std, hits: {"sampling_fraction": mean,   # noqa: E731
                                    "sampling_fraction_std": std, "hits": hits}
    got = learning.end_bin({"e_lo_gev": 10.0, "e_hi_gev": 100.0, "events": 18,
                            "real": side(0.02, 0.0005, 400.0), "gen": side(0.04, 0.0, 900.0)})
    assert got == {"bin_gev": "10-100", "events": 18, "sampling_fraction_rel_se": None,
                   "sampling_fraction_real": 0.02,
                   "sampling_fraction_spread_real": 0.025, "hits_real": 400.0,
                   "sampling_fraction_gen": 0.04, "sampling_fraction_spread_gen": 0.0,
                   "hits_gen": 900.0}
    with_se = learning.end_bin({"e_lo_gev": 10.0, "e_hi_gev": 100.0, "events": 18,
                                "sampling_fraction_rel_se": 0.06,
                                "real": side(0.02, 0.0005, 400.0),
                                "gen": side(0.04, 0.0, 900.0)})
    assert with_se["sampling_fraction_rel_se"] == 0.06
    empty = learning.end_bin({"e_lo_gev": 10.0, "e_hi_gev": 100.0, "events": 18,
                              "real": side(0.02, 0.0005, 400.0), "gen": side(0.0, 0.0, 0.0)})
    assert empty["sampling_fraction_spread_gen"] is None   # no mean to divide by


def _history_run(seed: int, distances: list[float], worst: list[float]) -> dict:
    """A run whose k-th validation has profile distance ``distances[k]`` on every axis and
    its worst energy bin at ``worst[k]`` (the other bin at -0.05)."""
    history = [{"epoch": k, **{f"profile_distance_{a}": d for a in "xyz"},
                "gen_empty_fraction": 0.0,
                "sampling_fraction_rel_diff_per_bin": {"10-100": w, "100-200": -0.05}}
               for k, (d, w) in enumerate(zip(distances, worst))]
    return learning.ended_at({"seed": seed, "history": history, "end_bins": []},
                             len(history) - 1)


def test_budgets_say_where_the_criteria_would_have_held():
    """Stopped after validation 2 every seed passes; after 3 the worst bin is 0.2: the
    budgets are 48 steps (of 16 per epoch), passing in 1 of the 2 validations from there.
    The control moves one seed's bin at validation 2 to 0.16: no budget passes."""
    distances = [1.0, 0.8, 0.4, 0.45]
    runs = [_history_run(s, distances, [0.5, 0.3, 0.1, 0.2]) for s in (1, 2, 3)]
    assert not learning.judge(runs)["passed"]   # the runs as they ended
    assert learning.budgets(runs, 16) == {
        "steps_per_epoch": 16, "validations": 4, "passing_steps": [48],
        "first_passing_steps": 48, "passing_share_from_first": 0.5}
    runs[2] = _history_run(3, distances, [0.5, 0.3, 0.16, 0.2])
    assert learning.budgets(runs, 16)["passing_steps"] == []
    del runs[0]["history"][1]["sampling_fraction_rel_diff_per_bin"]
    assert learning.budgets(runs, 16) is None   # an older file: no per-bin history


def test_ended_at_cuts_the_run_there():
    run = _history_run(1, [1.0, 0.8, 0.4, 0.45], [0.5, 0.3, 0.1, 0.2])
    assert "end_bins" in run and "cut_after_epoch" not in run   # the whole run
    cut = learning.ended_at(run, 2)
    assert [h["epoch"] for h in cut["history"]] == [0, 1, 2]
    assert cut["at"]["end"]["profile_distance_x"] == 0.4
    assert cut["at"]["middle"]["epoch"] == 1 and cut["cut_after_epoch"] == 2
    assert cut["sampling_fraction_rel_diff_per_bin_end"]["10-100"] == 0.1
    assert "end_bins" not in cut   # those were the real last validation's


@pytest.mark.parametrize("train_args,constant", [
    ([], False), (["--lr", "0.0002"], False),   # the default recipe's step decay
    (["--recipe", "cern2019"], True), (["--recipe=cern2019", "--lr", "0.0002"], True),
    (["--lr-decay", "none"], True), (["--lr-decay=none"], True),
    (["--lr-decay", "cosine"], False), (["--recipe", "cern2019", "--lr-decay", "step"], False),
    (["--lr-decay=cosine", "--lr", "1e-3"], False)])
def test_budgets_only_for_a_constant_rate(train_args, constant):
    class Args:
        pass
    args = Args()
    args.train_args = train_args
    assert learning.constant_rate(args) is constant


def test_doctored_budgets_are_caught():
    """Budgets measured from a committed file's runs (the kept run decays its rate, so its
    file holds none: they are computed here), then one doctored: the judge disagrees."""
    path = sorted((REPO / "bench" / "results").glob("learning-*.json"))[0]
    doc = json.loads(path.read_text())
    steps = doc["budget"]["steps_per_epoch"]
    budgets = doc["budgets"] or learning.budgets(doc["runs"], steps)
    assert budgets is not None and budgets["validations"] >= 1
    budgets["passing_steps"] = [steps * 1000]
    assert budgets != learning.budgets(doc["runs"], steps)


@pytest.mark.parametrize("path", sorted((REPO / "bench" / "results").glob("learning-*.json")),
                         ids=lambda p: p.name)
def test_committed_rule_at_last_validations_is_the_history(path):
    """``rule_at_last_validations`` (the 15 % rule at each seed's last four validations) is
    what ``rule_at_last`` reads from the file's own history; the control moves one bin of a
    seed's last validation to 20 %, and that validation no longer meets the rule."""
    doc = json.loads(path.read_text())
    got = doc.get("rule_at_last_validations")
    if got is None:
        assert any("sampling_fraction_rel_diff_per_bin" not in h
                   for r in doc["runs"] for h in r["history"]), "a file with per-bin history"
        return
    assert got == {str(r["seed"]): learning.rule_at_last(r) for r in doc["runs"]}
    assert all(len(rows) == min(4, len(r["history"]))
               for r, rows in zip(doc["runs"], got.values()))
    run = copy.deepcopy(doc["runs"][0])
    bins = run["history"][-1]["sampling_fraction_rel_diff_per_bin"]
    bins[next(iter(bins))] = 0.2
    assert learning.rule_at_last(run)[-1] == {**got[str(run["seed"])][-1],
                                              "worst_bin_rel_diff": 0.2, "within": False}


def _entry(epoch: int, distance: float, worst: float, generator: str) -> dict:
    """A physics.json validation: both bins filled, the 10-100 GeV one at ``worst``."""
    bins = [{"e_lo_gev": lo, "e_hi_gev": hi, "events": 9, "sampling_fraction_rel_diff": d,
             **{side: {"sampling_fraction": 0.02, "sampling_fraction_std": 0.001,
                       "hits": 300.0} for side in ("real", "gen")}}
            for lo, hi, d in ((10.0, 100.0, worst), (100.0, 200.0, -0.05))]
    return {"epoch": epoch, "generator": generator, "bins": bins,
            "summary": {**{f"profile_distance_{a}": distance for a in "xyz"},
                        "sampling_fraction_worst_rel_diff": abs(worst),
                        "gen_empty_fraction": 0.0}}


def test_the_raw_generator_of_an_averaged_run_is_judged_as_the_control():
    """Runs whose average passes and whose raw generator has a bin 30 % off: the verdict
    passes, ``raw_generator`` does not; cut short, both sides are cut."""
    def run(seed: int) -> dict:
        averaged = [_entry(k, d, w, "average") for k, (d, w) in
                    enumerate(zip([1.0, 0.6, 0.3], [0.9, 0.2, 0.1]))]
        for k, v in enumerate(averaged):
            v["others"] = [_entry(k, [1.0, 0.7, 0.35][k], [0.9, 0.4, 0.3][k], "raw")]
        side = learning.judged_side(averaged)
        return {"seed": seed, **side,
                "raw": learning.judged_side([v["others"][0] for v in averaged])}

    runs = [run(s) for s in (1, 2, 3)]
    assert runs[0]["generator"] == "average" and runs[0]["raw"]["generator"] == "raw"
    assert learning.judge(runs)["passed"]
    raw = learning.raw_side(runs)
    assert raw[0]["generator"] == "raw" and "raw" not in raw[0]
    assert not learning.judge(raw)["passed"]

    class Args:   # a constant rate (no decay), so the budgets are judged too
        train_args: list = ["--recipe", "cern2019"]
    got = learning.control(runs, 16, Args())["raw_generator"]
    assert not got["verdict"]["passed"] and got["budgets"]["passing_steps"] == []
    assert learning.budgets(runs, 16)["passing_steps"] == [48]
    cut = learning.ended_at(runs[0], 1)
    assert cut["raw"]["at"]["end"]["sampling_fraction_worst_rel_diff"] == 0.4
    assert cut["at"]["end"]["sampling_fraction_worst_rel_diff"] == 0.2
    assert "end_bins" not in cut and "end_bins" not in cut["raw"]
    assert learning.raw_side([{k: v for k, v in runs[0].items() if k != "raw"}]) is None


@pytest.mark.mpi
def test_rejudge_reproduces_the_in_training_validation_and_adds_draws(tmp_path):
    """``bench/rejudge.py`` on a 1-rank run's last checkpoint, with the validation's own
    events and one draw, gives physics.json's numbers exactly. The control: two draws give
    other generated numbers on the same real events, and ``--split`` judges draw 0 alone as
    the one-draw run did and draw 1 apart. ``--standing`` judges the same events again with
    the generator's BatchNorm statistics measured afresh: the first judgement (the
    checkpoint's statistics) stays physics.json's, the second differs; ``--batch-statistics``
    (BatchNorm on each batch's own statistics, as in training) differs from both. A directory
    without a run, and ``--split`` with an odd number of draws, are refused."""
    from conftest import base_env, run

    out = tmp_path / "run"
    result = run(["hpcai-launch", "-N", "1", "--threads-per-rank", "1", "--", "train", "3dgan",
                  "--generate", "24", "--batch-size", "2", "--max-steps", "1", "--epochs", "1",
                  "--validate-events", "8", "--eval-samples", "0", "--peak-gflops", "50",
                  "--cell-scale", "100", "--validate-bn", "moving", "--out", str(out)],
                 base_env(), timeout=300)   # judged in training with the checkpoint's statistics
    assert result.returncode == 0, result.stderr[-2000:]
    script = str(REPO / "bench" / "rejudge.py")
    got = {}
    for draws in (1, 2):
        path = tmp_path / f"rejudge{draws}.json"
        # one thread, as the run's rank had: the same arithmetic
        done = run([sys.executable, script, str(out), "--events", "8", "--draws", str(draws),
                    "--json", str(path),
                    *(["--split"] if draws == 2 else ["--standing", "--batch-statistics"])],
                   base_env(OMP_NUM_THREADS="1"), timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        got[draws] = json.loads(path.read_text())
    one, two = got[1], got[2]
    assert one["epoch"] == 0 and one["in_training"][0]["events"] == 8
    assert one["judged"][0]["bins"] == one["in_training"][0]["bins"]
    physics = json.loads((out / "physics.json").read_text())["validations"][-1]
    assert one["validations"][0]["bins"] == physics["bins"]
    assert two["judged"][0]["bins"] != two["in_training"][0]["bins"]
    assert two["validations"][0]["draws"] == 2
    # --standing: same events, fresh statistics, other generated numbers
    standing = one["standing"]
    assert two["standing"] is None and standing["batches"] == 16
    assert [b["events"] for b in standing["judged"][0]["bins"]] == \
        [b["events"] for b in one["judged"][0]["bins"]]
    assert standing["judged"][0]["bins"] != one["judged"][0]["bins"]
    batch = one["batch_statistics"]
    assert two["batch_statistics"] is None and batch["batch_size"] == 2
    assert batch["judged"][0]["bins"] not in (one["judged"][0]["bins"],
                                              standing["judged"][0]["bins"])
    assert [b["real"] for b in standing["validations"][0]["bins"]] == \
        [b["real"] for b in physics["bins"]]
    assert [b["real"] for b in two["validations"][0]["bins"]] == \
        [b["real"] for b in physics["bins"]]
    # --split: the first half (draw 0) is the one-draw judgement exactly, the second differs
    assert one["split"] is None and two["split"]["draws_per_half"] == 1
    judged_one = {b["bin_gev"]: b["sampling_fraction_rel_diff"] for b in one["judged"][0]["bins"]}
    rows = two["split"]["bins"]
    assert rows and all(r["halves"][0] == judged_one[r["bin_gev"]] for r in rows)
    assert all(r["halves"][0] != r["halves"][1] and r["difference_se"] > 0 for r in rows)
    assert two["split"]["sum_z2"] == pytest.approx(sum(r["z"] ** 2 for r in rows))
    # the response shape: its means are the judged bins' (the same showers), per bin
    for got_draws in (one, two):
        judged = {b["bin_gev"]: b["sampling_fraction_rel_diff"]
                  for b in got_draws["judged"][0]["bins"]}
        shape = got_draws["response"]["bins"]
        assert [r["bin_gev"] for r in shape] == list(judged)
        for r in shape:
            assert r["mean_rel_diff"] == pytest.approx(judged[r["bin_gev"]], rel=1e-9)
            assert r["showers"] == r["events"] * got_draws["settings"]["draws"]
    refused = run([sys.executable, script, str(tmp_path)], base_env())
    assert refused.returncode == 2 and refused.stderr.startswith("error: ")
    assert "hint: " in refused.stderr
    odd = run([sys.executable, script, str(out), "--draws", "3", "--split"], base_env())
    assert odd.returncode == 2 and "--split needs an even --draws" in odd.stderr
    assert "hint: " in odd.stderr


@pytest.fixture(scope="module")
def resumed_seed(tmp_path_factory):
    """``bench/learning.py`` invoked twice on seed 1 (one rank) with
    ``--train-arg=--resume``: one epoch, then a second. The two invocations' JSON documents,
    the work directory, and a copy of the seed's run directory as the first invocation left
    it: a 3DGAN run of one epoch of one step, validated on 8 held-out events with the
    default recipe's ``--validate-bn standing``."""
    from shutil import copytree

    from conftest import base_env, run

    base = tmp_path_factory.mktemp("resumed-seed")
    script = str(REPO / "bench" / "learning.py")
    work, path = base / "work", base / "learning.json"
    got = []
    for epochs in (1, 2):   # one rank: the record does not depend on their number
        done = run([sys.executable, script, "--seeds", "1", "--epochs", str(epochs),
                    "--max-steps", "1", "--batch-size", "2", "--events", "24",
                    "--validate-events", "8", "--workdir", str(work), "--json", str(path),
                    "--ranks", "1", "--train-arg=--resume", "--train-arg=--cell-scale",
                    "--train-arg=100", "--train-arg=--peak-gflops", "--train-arg=50",
                    "--launch-arg=--threads-per-rank", "--launch-arg=1"],
                   base_env(), timeout=600, cwd=base)
        assert done.returncode in (0, 1), done.stdout[-2000:] + done.stderr[-2000:]
        got.append(json.loads(path.read_text()))
        if epochs == 1:
            copytree(work / "seed1", base / "one-epoch")
    return got, work, base / "one-epoch"


@pytest.mark.mpi
def test_a_seed_resumed_over_two_invocations_keeps_both_in_its_record(resumed_seed):
    """``--train-arg=--resume``: the second invocation continues the first's run directory,
    and the run says how many epochs came before it, the training time of all recorded
    epochs and the commit each ran; the README line says the run was resumed. The control:
    the first invocation, from scratch, records no earlier epochs and renders a plain time."""
    import render

    got, work, _ = resumed_seed
    first, second = (g["runs"][0] for g in got)
    assert first["epochs_before"] == 0 and len(first["history"]) == 1
    assert second["epochs_before"] == 1 and len(second["history"]) == 2
    assert sum(second["epochs_by_revision"].values()) == 2
    records = learning.epoch_records(work / "seed1")
    assert second["epoch_time_s_sum"] == round(sum(r["epoch_time_s"] for r in records), 1)
    assert second["epoch_time_s_sum"] > first["epoch_time_s_sum"] > 0
    assert render._learning_time(got[0]).endswith(" min")
    said = render._learning_time(got[1])
    assert said.startswith("resumed: ") and "in its last invocation" in said
    assert said.endswith(f"epochs per commit {next(iter(second['epochs_by_revision']))[:10]} 2")


def test_a_seed_past_its_timeout_is_stopped_with_a_hint(tmp_path):
    """``--timeout`` (off by default: the 1280-step budget runs for hours) stops a seed that
    takes longer with SIGUSR1 (the preemption signal, which the trainer answers with a
    checkpoint: the --deadline test below, on a real job) and says how to go on. The seed's
    job is a stand-in ``hpcai-launch`` that runs until SIGUSR1 comes, and notes it; the
    control is a real run without --timeout, which ends by itself (the resumed-seed test)."""
    from conftest import base_env, run

    bindir, mark = tmp_path / "bin", tmp_path / "got-usr1"
    bindir.mkdir()
    fake = bindir / "hpcai-launch"
    fake.write_text("#!/bin/bash\n"
                    f"trap 'touch {mark}; exit 75' USR1\n"
                    "for i in $(seq 600); do sleep 0.2; done\nexit 1\n")
    fake.chmod(0o755)
    script = str(REPO / "bench" / "learning.py")
    done = run([sys.executable, script, "--seeds", "1", "--epochs", "50", "--max-steps", "1",
                "--batch-size", "2", "--events", "24", "--validate-events", "8",
                "--workdir", str(tmp_path / "work"), "--json", str(tmp_path / "l.json"),
                "--ranks", "1", "--train-arg=--peak-gflops", "--train-arg=50",
                "--timeout", "3"], base_env(PATH=f"{bindir}:{os.environ['PATH']}"),
               timeout=600, cwd=tmp_path)
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    assert "error: seed 1: no result within 3 s" in done.stderr
    assert "hint: raise --timeout (0: none)" in done.stderr
    assert mark.exists(), "the job was not sent SIGUSR1"
    assert not (tmp_path / "l.json").exists()


@pytest.mark.mpi
def test_deadline_preempts_the_ranks_so_they_checkpoint_mid_epoch(tmp_path):
    """``--deadline`` stops a seed with SIGUSR1, which every MPI's launcher passes on to the
    ranks: they write a checkpoint within the epoch and name the signal. (SIGTERM to
    ``hpcai-launch`` does the same; tests/test_signals.py, with its control.) The run (20
    epochs of 8 steps) outlasts the 10 s deadline many times over. learning.py looks at its
    seed every 5 s, so the signal goes about 10 s after the start. The ranks catch it from
    before MPI starts on (``faults.Preemption``; a few seconds into their start here, under
    load), so one that comes before their first step ends in a checkpoint after that step
    (tests/test_faults.py)."""
    from conftest import base_env, run

    script = str(REPO / "bench" / "learning.py")
    work = tmp_path / "work"
    done = run([sys.executable, script, "--seeds", "1", "--epochs", "20", "--max-steps", "8",
                "--batch-size", "1", "--events", "64", "--validate-events", "8",
                "--workdir", str(work), "--json", str(tmp_path / "l.json"),
                "--deadline", "10"], base_env(), timeout=600, cwd=tmp_path)
    # 0 or 1: the seed's first validation came before the deadline or not; in either case
    # learning.py says so, without a traceback
    assert done.returncode in (0, 1), done.stdout[-2000:] + done.stderr[-2000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert done.returncode == 0 or "reached before its first validation: no result" in \
        done.stderr, done.stderr[-2000:]
    assert "preempted by signal 10" in done.stdout + done.stderr
    assert [p for p in (work / "seed1" / "checkpoints").glob("ckpt-*.pt")
            if not p.name.endswith("-S000000.pt")], "no checkpoint within the epoch"


@pytest.mark.mpi
def test_rejudge_of_a_standing_run_judges_its_moving_statistics_first(resumed_seed, tmp_path):
    """A run validated with --validate-bn standing (the default recipe's; the first
    invocation's run of ``resumed_seed``, one epoch): rejudge's first judgement is the
    checkpoint's moving statistics (generator "raw", the control), which differs from the
    run's own validation, and ``--standing`` gives that validation's numbers exactly."""
    from conftest import base_env, run

    out = resumed_seed[2]
    path = tmp_path / "rejudge.json"
    # one thread, as the run's rank had (--threads-per-rank 1): the same arithmetic
    done = run([sys.executable, str(REPO / "bench" / "rejudge.py"), str(out), "--events", "8",
                "--draws", "1", "--standing", "--json", str(path)],
               base_env(OMP_NUM_THREADS="1"), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(path.read_text())
    (in_training,) = got["in_training"]
    assert in_training["generator"] == "standing"
    assert got["judged"][0]["generator"] == "raw"
    assert got["judged"][0]["bins"] != in_training["bins"]
    assert got["standing"]["judged"][0]["bins"] == in_training["bins"]


def test_data_response_is_flat_for_generated_files_and_sees_a_scaled_bin(tmp_path):
    """``bench/data_response.py`` on files ``--generate`` writes: every bin's Σcells ÷ f(E')
    is 1 within 1 %. The control scales the 100-200 GeV bin's cells by 0.8 and must read
    -20 % there (and over the 200-300 GeV bin), the other bins unchanged."""
    from hpcai.training.showers import generate
    generate(tmp_path / "data", n_files=1, events_per_file=300, seed=5)
    script = str(REPO / "bench" / "data_response.py")
    docs = {}
    for name, extra in (("plain", []), ("scaled", ["--scale-bin", "100:200:0.8"])):
        out = tmp_path / f"{name}.json"
        done = subprocess.run([sys.executable, script, str(tmp_path / "data"), "--json",
                               str(out), *extra], capture_output=True, text=True, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        [docs[name]] = json.loads(out.read_text())["files"]
    for plain, scaled in zip(docs["plain"]["bins"], docs["scaled"]["bins"]):
        assert plain["n"] > 20 and abs(plain["response"]) < 0.01, plain
        if plain["bin_gev"] == [100.0, 200.0]:
            assert scaled["response"] == pytest.approx(0.8 * (1 + plain["response"]) - 1)
            assert scaled["ratio_to_reference"] == pytest.approx(-0.2, abs=0.015)
        else:
            assert scaled == plain


def test_data_response_bins_the_events_as_the_validation_does(tmp_path):
    """``data_response`` takes its bins from ``physics.bin_masks``: an event at exactly
    500 GeV counts in the 400-500 GeV bin, as in the physics validation, and 100 GeV opens
    the 100-200 GeV bin. The control: a --scale-bin that is not a validation bin is refused
    (exit 2), where a home-made [lo, hi) mask would have scaled it silently."""
    import data_response
    import h5py
    import numpy as np
    from hpcai.training import physics

    energy = np.array([10.0, 99.9, 100.0, 250.0, 450.0, 500.0, 500.0])
    with h5py.File(tmp_path / "edges.h5", "w") as f:
        f["ECAL"] = np.ones((energy.size, 25, 25, 25), dtype=np.float32)
        f["target"] = np.stack([np.zeros_like(energy), energy], axis=1)
    rows = data_response.file_response(tmp_path / "edges.h5")["bins"]
    assert [row["n"] for row in rows] == [int(m.sum()) for m in physics.bin_masks(energy)]
    assert [row["n"] for row in rows] == [2, 1, 1, 0, 3]
    done = subprocess.run([sys.executable, str(REPO / "bench" / "data_response.py"),
                           str(tmp_path / "edges.h5"), "--scale-bin", "100:250:0.8"],
                          capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 2 and "not a validation bin" in done.stderr, done.stderr


def test_response_shape_reads_a_scaled_generator_as_scaled():
    """``rejudge.response_shape`` on made-up showers: a generator that is the real showers
    times 0.8, twice over, is 20 % low in mean and median with the real spread; the control,
    the real showers themselves, is 0 % with no shower below half or above 1.5 times."""
    import numpy as np

    import rejudge
    from hpcai.training.physics import EventSummaries

    rng = np.random.default_rng(0)
    n = 400
    energy = rng.uniform(10, 500, n)
    profiles = np.zeros((n, 3, 25))
    profiles[:, 0, 12] = energy * rng.normal(0.02, 0.001, n)   # Σcells = 2 % of E, 5 % spread
    real = EventSummaries(energy, profiles, np.ones(n), np.full(n, np.nan))

    def twice(scale: float) -> EventSummaries:
        return EventSummaries(np.tile(energy, 2), np.tile(profiles * scale, (2, 1, 1)),
                              np.ones(2 * n), np.full(2 * n, np.nan))

    same, low = rejudge.response_shape(real, twice(1.0)), rejudge.response_shape(real, twice(0.8))
    assert [r["bin_gev"] for r in same] == ["10-100", "100-200", "200-300", "300-400", "400-500"]
    for s, lo in zip(same, low):
        assert s["mean_rel_diff"] == pytest.approx(0, abs=1e-12)
        assert s["median_rel_diff"] == pytest.approx(0, abs=1e-12)
        assert s["gen_below_half"] == 0 and s["gen_above_1_5"] == 0
        assert lo["mean_rel_diff"] == pytest.approx(-0.2) and lo["median_rel_diff"] == \
            pytest.approx(-0.2)
        assert lo["gen_cv"] == pytest.approx(lo["real_cv"]) == pytest.approx(s["gen_cv"])
        assert 0.03 < s["real_cv"] < 0.07 and lo["showers"] == 2 * lo["events"]


def _judge_trivially(monkeypatch) -> None:
    """``learning.main`` past its seeds without judging them (the seeds here are fakes)."""
    monkeypatch.setattr(learning, "judge", lambda runs: {"checks": {}, "passed": True})
    monkeypatch.setattr(learning, "table", lambda runs: "")
    monkeypatch.setattr(learning, "budgets", lambda runs, steps: None)
    monkeypatch.setattr(learning, "control", lambda runs, steps, args: {})
    monkeypatch.setattr(learning, "steps_per_epoch", lambda args, runs: 16)


def test_a_failed_seed_ends_the_benchmark_without_starting_the_others(tmp_path, monkeypatch,
                                                                       capsys):
    """One seed's training failing (here the stall watchdog's exit 124) ends the benchmark
    with that error, and the seeds queued behind it are never started. The control is the
    same call with no failure: every seed runs."""
    started = []

    def fake_seed(seed, args, workdir, stop):
        started.append(seed)
        if fail and seed == 2:
            raise SystemExit("error: seed 2: training exited 124")
        return {"seed": seed, "stopped_at_deadline": False}

    monkeypatch.setattr(learning, "run_seed", fake_seed)
    monkeypatch.setattr(learning, "write", lambda *a, **k: None)
    argv = ["learning.py", "--seeds", "2,1,3", "--workdir", str(tmp_path),
            "--json", str(tmp_path / "l.json")]
    monkeypatch.setattr(sys, "argv", argv)
    fail = True
    with pytest.raises(SystemExit, match="seed 2: training exited 124"):
        learning.main()
    assert started == [2]
    assert "seed 2 failed: seeds [1, 3] not started; rerun" in capsys.readouterr().out

    fail, started[:] = False, []
    _judge_trivially(monkeypatch)
    learning.main()
    assert started == [2, 1, 3]


def test_a_failed_seed_stops_the_seeds_running_beside_it(tmp_path, monkeypatch, capsys):
    """With --jobs 2, seed 2 fails while seed 1 trains beside it: seed 1 is told to stop
    (``run_seed``'s ``stop`` is set), the benchmark ends with seed 2's error and names seed 1
    as stopped at a checkpoint, and seed 3 never starts. The control is the same call
    without the failure: nobody sets ``stop``, seed 1 trains to its end and seed 3 runs."""
    started, stopped = [], []
    one_running = threading.Event()

    def fake_seed(seed, args, workdir, stop):
        started.append(seed)
        if seed == 1:
            one_running.set()
            if stop.wait(timeout=2 if not fail else 60):
                stopped.append(seed)
                raise learning.Stopped("error: seed 1: stopped at a checkpoint")
        if fail and seed == 2:
            assert one_running.wait(timeout=30)
            raise SystemExit("error: seed 2: training exited 124")
        return {"seed": seed, "stopped_at_deadline": False}

    monkeypatch.setattr(learning, "run_seed", fake_seed)
    monkeypatch.setattr(learning, "write", lambda *a, **k: None)
    monkeypatch.setattr(sys, "argv", ["learning.py", "--seeds", "2,1,3", "--jobs", "2",
                                      "--workdir", str(tmp_path)])
    fail = True
    with pytest.raises(SystemExit, match="seed 2: training exited 124"):
        learning.main()
    assert stopped == [1] and sorted(started) == [1, 2]   # seed 1 saw stop (else 60 s, [])
    assert "seeds [3] not started, seeds [1] stopped at a checkpoint" in capsys.readouterr().out

    fail, started[:], stopped[:] = False, [], []
    one_running.clear()
    _judge_trivially(monkeypatch)
    learning.main()
    assert sorted(started) == [1, 2, 3] and stopped == []


def test_a_stopped_seed_preempts_its_job(tmp_path, monkeypatch):
    """``run_seed`` with ``stop`` set sends its job SIGUSR1 (the job checkpoints and exits)
    and fails, naming why; here the job is a stand-in ``hpcai-launch`` that notes the signal.
    The control: ``stop`` never set, the same job ends by itself (exit 1) unsignalled."""
    bindir, mark, ready = tmp_path / "bin", tmp_path / "got-usr1", tmp_path / "trapped"
    bindir.mkdir()
    fake = bindir / "hpcai-launch"
    fake.write_text("#!/bin/bash\n"
                    f"trap 'touch {mark}; exit 75' USR1\ntouch {ready}\n"
                    "for i in $(seq 40); do sleep 0.05; done\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    args = argparse.Namespace(ranks=2, launch_args=[], events=8, epochs=1, max_steps=1,
                              batch_size=2, validate_events=8, validate_draws=1, train_args=[],
                              timeout=0, deadline=0, stop_dead=0)
    stop = threading.Event()
    threading.Thread(target=lambda: (wait_for(ready.exists, 60, "the job's trap"),
                                     stop.set()), daemon=True).start()
    with pytest.raises(learning.Stopped, match="seed 7: stopped at a checkpoint because anoth"):
        learning.run_seed(7, args, tmp_path, stop)
    assert mark.exists()
    mark.unlink()
    ready.unlink()
    with pytest.raises(SystemExit, match="seed 7: training exited 1"):
        learning.run_seed(7, args, tmp_path, threading.Event())
    assert not mark.exists()


def test_settling_after_a_failure_sorts_the_other_seeds_by_how_they_ended():
    """``settle``: a cancelled seed and one whose turn came after the failure (None) were not
    started, a ``Stopped`` one stopped at a checkpoint, another error failed too, and a run
    that finished meanwhile is kept; the failure itself is left out."""
    from concurrent.futures import Future

    def future(result=None, exc=None, cancel=False):
        f = Future()
        if cancel:
            f.cancel()
        elif exc is not None:
            f.set_exception(exc)
        else:
            f.set_result(result)
        return f

    failure = future(exc=SystemExit("error: seed 2: training exited 124"))
    futures = {failure: 2, future(cancel=True): 3, future(): 4,
               future(exc=learning.Stopped("stopped")): 1,
               future(exc=SystemExit("error: seed 5: training exited 1")): 5,
               future({"seed": 6}): 6}
    assert learning.settle(futures, failure) == ([3, 4], [1], [5], [{"seed": 6}])
