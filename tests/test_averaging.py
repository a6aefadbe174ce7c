"""``train 3dgan --generator-ema``: the generator's weight average (``training/averaging.py``),
what physics validation judges with it, and that it survives a checkpoint and --resume.

The average is checked against its formula computed here from the weights after each step;
the control is the last weights, which it must not equal. Physics validation must judge the
average and the raw generator on the same events: the two differ after a few steps, and
coincide when the decay is so small that the average is the last weights (the control of
the comparison). A resumed run's average must be the uninterrupted run's, bit for bit, and a
resume that would drop or invent an average is refused.

``--validate-bn standing`` judges the trained generator with standing statistics measured
for its current weights, on a copy: its showers are those of the same formula, differ from
the moving statistics' (the control), and the training itself is the same bit for bit.
"""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch

from hpcai.training.averaging import WeightAverage, standing_statistics
from hpcai.training.config import parse
from conftest import blocked_env
from hpcai.training.tasks import GanTask
from jobs import train


def _weights(module: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def test_the_average_is_the_normalised_exponential_average_of_the_steps():
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3)
    decay = 0.8
    average = WeightAverage(net, decay, lambda: [])
    after = []
    for _ in range(6):
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn_like(p))
        average.update(net)
        after.append(_weights(net))
    n = len(after)
    coeff = [(1 - decay) * decay ** (n - 1 - k) for k in range(n)]
    for i, p in enumerate(average.module().parameters()):
        expected = sum(c * w[i] for c, w in zip(coeff, after)) / sum(coeff)
        torch.testing.assert_close(p, expected, rtol=1e-5, atol=1e-6)
        assert (p - after[-1][i]).abs().max() > 0.1, "the average is just the last weights"


def _bn_net() -> torch.nn.Module:
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.BatchNorm1d(3, momentum=0.01))


def test_standing_statistics_are_the_mean_over_the_batches_for_these_weights():
    """The moving mean becomes the mean of the batch means and the variance the mean of the
    unbiased batch variances, whatever the statistics were before (the control: the live
    network's, set to 7); weights, momentum and mode stay as they were."""
    net = _bn_net().eval()
    with torch.no_grad():
        net[1].running_mean.fill_(7.0)
    batches = [torch.randn(8, 3, generator=torch.Generator().manual_seed(k)) for k in range(4)]
    weights = _weights(net)
    assert standing_statistics(net, batches) == 4
    with torch.no_grad():
        h = [net[0](x) for x in batches]
    torch.testing.assert_close(net[1].running_mean, torch.stack([y.mean(0) for y in h]).mean(0))
    torch.testing.assert_close(net[1].running_var,
                               torch.stack([y.var(0, unbiased=True) for y in h]).mean(0))
    assert net[1].momentum == 0.01 and not net.training
    assert all(torch.equal(a, b) for a, b in zip(_weights(net), weights))
    assert standing_statistics(torch.nn.Linear(3, 3), batches) == 0   # nothing to measure


def test_the_first_average_is_the_first_weights_and_the_state_round_trips():
    net = _bn_net()
    batches = [torch.randn(8, 3, generator=torch.Generator().manual_seed(5))]
    average = WeightAverage(net, 0.99, lambda: batches)
    with torch.no_grad():
        for p in net.parameters():
            p.add_(1.0)
        net[1].running_mean.fill_(7.0)
    average.update(net)
    for a, w in zip(average.module().parameters(), net.parameters()):
        assert torch.equal(a, w)    # no trace of the initial weights
    with torch.no_grad():
        expected = net[0](batches[0]).mean(0)
    torch.testing.assert_close(average.module()[1].running_mean, expected)   # not the 7s
    copy = WeightAverage(net, 0.99, lambda: [])
    copy.load_state_dict(average.state_dict())
    assert copy.updates == 1
    for a, b in zip(copy.module().state_dict().values(),
                    average.module().state_dict().values()):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="decay 0.99, not 0.9"):
        WeightAverage(net, 0.9, lambda: []).load_state_dict(average.state_dict())


@pytest.fixture
def one_thread():
    """The tasks trained in this process use one torch thread (the count restored after):
    tiny batches gain nothing from a second, whose spinning costs CPU on a busy machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _gan(decay: float | None, *extra: str) -> GanTask:
    """A task of batch 1: BatchNorm normalises over a shower's cells, so one is a batch."""
    args = ["3dgan", "--generate", "8", "--recipe", "cern2019", "--cell-scale", "100",
            "--batch-size", "1", *extra]
    if decay is not None:
        args += ["--generator-ema", str(decay)]
    cfg = parse(args)
    return GanTask(cfg, lr=1e-3)


def _train(task: GanTask, steps: int) -> None:
    rng = np.random.default_rng(3)
    for step in range(steps):
        x = rng.gamma(0.2, 0.05, (1, 1, 25, 25, 25)).astype(np.float32)
        e = rng.uniform(0.1, 5.0, 1).astype(np.float32)
        task.train_step(x, e, torch.Generator().manual_seed(step), None)


# four held-out events (no real showers needed) and their latent vectors
Z = np.random.default_rng(1).standard_normal((4, 200)).astype(np.float32)
X = np.zeros((4, 1, 25, 25, 25), np.float32)
E = np.array([0.5, 1.0, 2.0, 4.0], np.float32)


def _measured_by_hand(task: GanTask) -> np.ndarray:
    """The showers (GeV) of a copy of the task's generator, its BatchNorm statistics
    measured here on the task's standing inputs."""
    G = copy.deepcopy(task.G)
    standing_statistics(G, task._generator_inputs())
    with torch.no_grad():
        return G.eval()(torch.from_numpy(E).view(-1, 1) * torch.from_numpy(Z)).numpy() / 100


def test_physics_pass_judges_the_average_beside_the_raw_generator(one_thread):
    """After 2 steps the average's showers differ from those of the raw generator with its
    statistics measured the same way; with a decay so small that the average is the last
    weights they coincide (the control)."""
    x, e, z, raw_measured = X, E, Z, _measured_by_hand
    task = _gan(0.9)
    assert task.generators == ("average", "raw")
    _train(task, 2)
    average = task.physics_pass(x, e, z, generator="average")[0]
    assert np.abs(average - raw_measured(task)).max() > 1e-3 * np.abs(average).max()
    raw, aux_real, aux_gen = task.physics_pass(x, e, z, generator="raw")
    assert np.abs(average - raw).max() > 1e-3 * np.abs(raw).max()
    again, no_real, same_gen = task.physics_pass(x, e, z, generator="raw", real=False)
    assert len(aux_real) == 4 and len(no_real) == 0   # D on the real showers only if asked
    np.testing.assert_array_equal(again, raw)
    np.testing.assert_array_equal(same_gen, aux_gen)
    assert task.G.training, "the generator's mode was not restored"
    short = _gan(1e-9)
    _train(short, 2)
    np.testing.assert_allclose(short.physics_pass(x, e, z, generator="average")[0],
                               raw_measured(short), rtol=1e-4, atol=1e-6)
    plain = _gan(None)
    assert plain.generators == ("raw",) and plain.extra_state() == {}
    with pytest.raises(ValueError, match="no generator 'average'"):
        plain.physics_pass(x, e, z, generator="average")


# one step per epoch: two epochs are two updates of the average, and the second epoch's step
# comes after the first epoch's validation (which must leave the training as it was)
GAN = ["3dgan", "--generate", "24", "--batch-size", "2", "--max-steps", "1",
       "--validate-every", "1", "--validate-events", "8", "--eval-samples", "0",
       "--peak-gflops", "50", "--recipe", "cern2019", "--cell-scale", "100"]


def _last(out) -> dict:
    return json.loads((out / "physics.json").read_text())["validations"][-1]


def _files(out) -> dict[str, bytes]:
    """Every file under a run directory, by its relative path, with its contents."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*"))
            if p.is_file()}


@pytest.fixture(scope="module")
def no_plots(tmp_path_factory) -> dict[str, str]:
    """The ranks' environment with matplotlib blocked (``conftest.blocked_env``): rank 0
    says that it cannot draw the physics plots, which no test here reads, and goes on;
    physics.json, the steps and the checkpoints are written as ever."""
    return blocked_env(tmp_path_factory.mktemp("no-matplotlib"), "matplotlib")


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, no_plots):
    """Two ranks, two epochs, ``--generator-ema 0.5``, moving statistics, uninterrupted: the
    run a resumed one must equal, and the control of the standing test below (its raw
    generator is judged with its moving statistics). Its directory and stdout; only read."""
    out = tmp_path_factory.mktemp("averaging") / "straight"
    done = train(2, *GAN, "--epochs", "2", "--generator-ema", "0.5", "--out", str(out),
                 env=no_plots)
    assert done.returncode == 0, done.stderr[-2000:]
    return out, done.stdout


@pytest.fixture(scope="module")
def standing_run(tmp_path_factory, no_plots):
    """Two ranks, two epochs, ``--validate-bn standing`` and no average: the run judged with
    standing statistics, and the run without an average that a resume must not give one
    (only read, or refused before anything is written)."""
    out = tmp_path_factory.mktemp("averaging") / "standing"
    done = train(2, *GAN, "--epochs", "2", "--validate-bn", "standing", "--out", str(out),
                 env=no_plots)
    assert done.returncode == 0, done.stderr[-2000:]
    return out


@pytest.mark.mpi
def test_physics_json_has_both_generators_and_resume_keeps_the_average(straight_run, tmp_path,
                                                                      no_plots):
    """The average is judged beside the raw generator on the same events. A run interrupted
    after its first epoch and resumed ends with the uninterrupted run's validation, bit for
    bit; resumes that would drop the average or change its decay are refused. The first
    epoch judged the trained generator with standing statistics and the resume leaves
    ``--validate-bn`` out: the resume says so, and each validation in physics.json names
    the statistics it was judged with (the average's are its own, measured either way)."""
    straight, stdout = straight_run
    assert "| avg: worst sum/E" in stdout
    whole = _last(straight)
    assert whole["generator"] == "average"
    (raw,) = whole["others"]
    assert raw["generator"] == "raw" and raw["events"] == whole["events"] == 8
    assert raw["summary"] != whole["summary"], "the average judged like the raw generator"
    assert [b["real"] for b in raw["bins"]] == [b["real"] for b in whole["bins"]]

    out = tmp_path / "resumed"
    first = train(2, *GAN, "--epochs", "1", "--generator-ema", "0.5", "--validate-bn",
                  "standing", "--out", str(out), env=no_plots)
    assert first.returncode == 0, first.stderr[-2000:]
    dropped = train(2, *GAN, "--epochs", "2", "--resume", "--out", str(out), env=no_plots)
    assert dropped.returncode == 2, dropped.stderr[-2000:]
    assert ("--resume: the checkpoint has a generator average and this run does not"
            in dropped.stderr) and "hint: resume with the --generator-ema" in dropped.stderr
    other = train(2, *GAN, "--epochs", "2", "--resume", "--generator-ema", "0.9",
                  "--out", str(out), env=no_plots)
    assert other.returncode == 2 and "decay 0.5, not 0.9" in other.stderr, other.stderr[-2000:]
    resumed = train(2, *GAN, "--epochs", "2", "--resume", "--generator-ema", "0.5",
                    "--out", str(out), env=no_plots)
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-2000:]
    assert _last(out)["summary"] == whole["summary"]
    assert _last(out)["others"][0]["summary"] == raw["summary"]
    assert "validate_bn 'standing' -> 'moving'" in resumed.stdout, resumed.stdout[-2000:]
    history = json.loads((out / "physics.json").read_text())["validations"]
    assert [v["generator"] for v in history] == ["average", "average"]
    assert [v["others"][0]["generator"] for v in history] == ["standing", "raw"]


@pytest.mark.mpi
def test_resume_refuses_to_invent_an_average(standing_run, no_plots):
    """The other direction: a run without an average cannot resume into one that would
    silently start from the resumed weights; the refusal leaves the run as it was."""
    out = standing_run
    assert "others" not in _last(out) and _last(out)["generator"] == "standing"
    before = _files(out)
    invented = train(2, *GAN, "--epochs", "3", "--resume", "--generator-ema", "0.5",
                     "--out", str(out), env=no_plots)
    assert invented.returncode == 2, invented.stderr[-2000:]
    assert "the checkpoint has no generator average and this run keeps one" in invented.stderr
    assert _files(out) == before, "the refused resume wrote to the run"


def test_standing_judges_a_copy_measured_for_the_current_weights(one_thread):
    """With --validate-bn standing the trained generator is judged with statistics measured
    for its weights (the same showers as measuring a copy by hand), not with its moving ones
    (the control, "raw" of a plain task with the same weights, differs); G's own statistics
    and mode are untouched, and after another step the copy is measured again."""
    x, e, z, measured_by_hand = X, E, Z, _measured_by_hand
    task, plain = _gan(None, "--validate-bn", "standing"), _gan(None)
    assert task.generators == ("standing",) and plain.generators == ("raw",)
    assert _gan(0.9, "--validate-bn", "standing").generators == ("average", "standing")
    for t in (task, plain):
        torch.manual_seed(0)        # D's dropout draws from the global generator
        _train(t, 2)
    for a, b in zip(task.G.state_dict().values(), plain.G.state_dict().values()):
        assert torch.equal(a, b)                 # the same training so far
    moving = {k: v.clone() for k, v in task.G.state_dict().items()}
    standing = task.physics_pass(x, e, z, generator="standing")[0]
    np.testing.assert_allclose(standing, measured_by_hand(task), rtol=1e-5, atol=1e-7)
    raw = plain.physics_pass(x, e, z, generator="raw")[0]
    assert np.abs(standing - raw).max() > 1e-3 * np.abs(raw).max(), "moving = standing"
    assert all(torch.equal(v, moving[k]) for k, v in task.G.state_dict().items())
    assert task.G.training, "the generator's mode was not restored"
    with pytest.raises(ValueError, match="no generator 'raw'"):
        task.physics_pass(x, e, z, generator="raw")
    _train(task, 1)
    again = task.physics_pass(x, e, z, generator="standing")[0]
    assert np.abs(again - standing).max() > 0, "not measured again after a step"
    np.testing.assert_allclose(again, measured_by_hand(task), rtol=1e-5, atol=1e-7)


@pytest.mark.mpi
def test_standing_validation_leaves_the_training_as_it_was(straight_run, standing_run):
    """Two ranks, with and without --validate-bn standing: every step's losses are the same
    bit for bit; physics.json names the standing generator and its numbers differ from the
    moving statistics' (the control). The run with moving statistics keeps an average (the
    straight run above), so the same losses also show that the average leaves the training
    as it was; its raw generator is the one judged with the moving statistics."""
    runs = {"moving": straight_run[0], "standing": standing_run}
    steps = {name: [json.loads(line) for line in
                    (out / "steps.jsonl").read_text().splitlines()]
             for name, out in runs.items()}
    assert steps["moving"] == steps["standing"] and len(steps["moving"]) == 2
    standing, (moving,) = _last(runs["standing"]), _last(runs["moving"])["others"]
    assert standing["generator"] == "standing" and moving["generator"] == "raw"
    assert "others" not in standing
    assert [b["real"] for b in standing["bins"]] == [b["real"] for b in moving["bins"]]
    assert standing["summary"] != moving["summary"], "standing judged like moving"
