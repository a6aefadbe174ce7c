"""The data-parallel engine for real: 2 ranks x b equals 1 rank x 2b, replicas agree."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

import dp_updates
from conftest import KEEP_FREED_MEMORY, SHARED_CORES, base_env, run
from dp_updates import TOL

pytestmark = pytest.mark.mpi
PROGRAMS = Path(__file__).parent / "programs"


VARIANTS = [("mlp", ()), ("mlp", ("--blocking",)), ("mlp", ("--progress", "nonblocking")),
            ("mlp", ("--progress", "thread")),
            ("mlp", ("--progress", "hook", "--loss-divided")),
            ("mlp", ("--blocking", "--loss-divided")),
            ("gan-d", ()), ("gan-d", ("--loss-divided",)), ("gan-g", ())]


# The models whose 1-rank references each variant is compared with, and the rank of the
# 2-rank job that computes each (on MPI.COMM_SELF, while the other computes the rest).
REFERENCE_RANK = {"mlp": 1, "gan-d": 1, "gan-g": 0}
# The 2-rank runs of streamed_allreduce.py on Open MPI, by test id.
STREAMED = {"openmpi-0.3MiB": ["--call-mb", "0.3"], "openmpi-measured": [],
            "no-synchronize (control)": ["--call-mb", "0.3", "--no-sync"]}


def one_job(mpi: str, parts: list[list[str]], folder: Path, timeout: float = 600):
    """One 2-rank hpcai-launch job of one_job.py running ``parts`` (``[NAME, PROGRAM,
    ARGS...]``) in turn: one start-up of the ranks for all of them."""
    spec = folder / f"{mpi}-parts.json"
    spec.write_text(json.dumps(parts))
    return run(["hpcai-launch", "--mpi", mpi, "-N", "2", "--oversubscribe", "--", "python",
                str(PROGRAMS / "one_job.py"), str(spec)], base_env(**KEEP_FREED_MEMORY),
               timeout=timeout)


def part(result, name: str) -> tuple[list[str], list[str]]:
    """The stdout lines that part ``name`` of a one_job.py job printed (both ranks), without
    its ``exit N`` lines, and those exit lines."""
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    prefix = f"{name}| "
    mine = [line[len(prefix):] for line in result.stdout.splitlines()
            if line.startswith(prefix)]
    return ([line for line in mine if not line.startswith("exit ")],
            [line for line in mine if line.startswith("exit ")])


@pytest.fixture(scope="module")
def openmpi_job(tmp_path_factory) -> tuple[Path, object]:
    """The Open MPI 2-rank programs of this file in one job: dp_equivalence.py (the 1-rank
    reference of each model, each on one rank alone, then every variant with 2 ranks, and
    the controls: 2 ranks, no averaging, one per model run without flags),
    silent_divergence.py, grad_scale.py with each control, and streamed_allreduce.py
    (:data:`STREAMED`, the control last). dp_equivalence's files: ``one-MODEL.npz``,
    ``two-I.npz`` and ``alone-I.npz`` for variant I."""
    folder = tmp_path_factory.mktemp("engine")
    runs = [[model, str(folder / f"one-{model}.npz"), "--alone", str(rank)]
            for model, rank in REFERENCE_RANK.items()]
    runs += [[model, str(folder / f"two-{i}.npz"), *extra]
             for i, (model, extra) in enumerate(VARIANTS)]
    runs += [[model, str(folder / f"alone-{i}.npz"), "--no-average"]
             for i, (model, extra) in enumerate(VARIANTS) if not extra]
    (folder / "runs.json").write_text(json.dumps(runs))
    parts = [["dp", "dp_equivalence.py", "--each", str(folder / "runs.json")],
             ["divergence", "silent_divergence.py"],
             ["grad_scale", "grad_scale.py", "--each-control"],
             *[[name, "streamed_allreduce.py", *args] for name, args in STREAMED.items()]]
    return folder, one_job("openmpi", parts, folder, timeout=900)


def _updates(openmpi_job, name: str) -> dict[str, np.ndarray]:
    """The weight update of every parameter over the 3 steps, from the shared job's files."""
    folder, result = openmpi_job
    assert part(result, "dp")[1] == ["exit 0"] * 2, result.stderr[-3000:]
    return dp_updates.updates(folder / name)


@pytest.mark.parametrize("model,extra", VARIANTS)
def test_two_ranks_equal_one_rank_with_twice_the_batch(model, extra, openmpi_job):
    """3 SGD steps: the update of every parameter with 2 ranks x b equals that with
    1 rank x 2b (one rank alone, on the whole batch); the control, 2 ranks without
    averaging, must fail the same comparison."""
    i = VARIANTS.index((model, extra))
    what = " ".join([model, *extra])
    single = _updates(openmpi_job, f"one-{model}.npz")
    still = [name for name, u in single.items() if not np.any(u)]
    assert not still, f"{what}: parameters that did not move compare nothing: {still}"
    name, rel = dp_updates.worst(single, _updates(openmpi_job, f"two-{i}.npz"))
    assert rel <= TOL[model], f"{what} {name}: update differs by {rel:.3g} (relative)"
    if not extra:
        alone = _updates(openmpi_job, f"alone-{i}.npz")
        name, rel = dp_updates.worst(single, alone)
        assert rel > TOL[model], f"{what}: the control should fail the comparison, got {rel:.3g}"
        assert dp_updates.total(single, alone) > 0.1, \
            f"{what}: the control should be far off, not marginally"


@pytest.mark.parametrize("control", [None, "twice", "never"])
def test_gradients_are_scaled_exactly_once(control, openmpi_job):
    """2 ranks with gradients known in closed form: after synchronize() every gradient is the
    mean, in every mode (overlap with each progress strategy: hook, thread, nonblocking;
    blocking; the loss divided by the engine, or by train's own callback, or the gradients;
    zeroed or set to None). The controls, gradients scaled twice and not at all, must fail
    every case."""
    result = openmpi_job[1]
    printed, exits = part(result, "grad_scale")
    assert exits == ["exit 0"] * 2, result.stdout[-3000:] + result.stderr[-3000:]
    prefix = f"{control or 'none'}: "
    mine = [line[len(prefix):] for line in printed if line.startswith(prefix)]
    lines = [line for line in mine if line.startswith(("ok", "FAIL"))]
    exits = [line for line in mine if line.startswith("exit ")]
    assert lines and len(exits) == 1, "\n".join(printed) + result.stderr[-3000:]
    if control is None:
        assert exits == ["exit 0"] and len(lines) == 24, printed
        assert all(line.startswith("ok") for line in lines), printed
    else:
        factor = {"twice": "factor 0.5", "never": "factor 2"}[control]
        assert exits == ["exit 1"], printed
        assert all(line.startswith("FAIL") and line.endswith(factor) for line in lines), \
            f"{control}: {printed}"


def test_divergence_check_fails_loudly_when_gradients_are_not_averaged(openmpi_job):
    """A backend that silently skips averaging (as Horovod's Keras 3 path did) is caught,
    on both ranks (tests/programs/silent_divergence.py)."""
    result = openmpi_job[1]
    printed, exits = part(result, "divergence")
    assert exits == ["exit 0"] * 2, result.stderr[-3000:]
    caught = [line for line in printed if line.startswith("caught:")]
    assert len(caught) == 2 and all("diverged" in line for line in caught), printed


class _NoTransport:
    """Two ranks' worth of bookkeeping without communication (layout tests only)."""

    name, size = "none", 2


def test_buckets_are_slices_of_one_allocation_and_backward_writes_them():
    """Every bucket of a dtype is a slice of one buffer, and each gradient (channels-last
    convolutions at non-zero offsets included) is a view that backward fills in place:
    the grads equal those of the same model without the engine, scaled by the backward
    hooks to this rank's share (1 / world size) of the mean, but for the last bucket's, which
    have no hooks (synchronize scales them) and are as backward wrote them. The control is
    the same comparison against a model that computed a different batch."""
    import torch

    from hpcai.training.allreduce import GradAllreducer

    torch.manual_seed(0)
    make = lambda: torch.nn.Sequential(   # noqa: E731
        torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 8, 3),
        torch.nn.Flatten(), torch.nn.Linear(8 * 4 * 4, 5)).to(memory_format=torch.channels_last)
    model, plain, other = make(), make(), make()
    plain.load_state_dict(model.state_dict())
    other.load_state_dict(model.state_dict())
    reducer = GradAllreducer(model, _NoTransport(), bucket_mb=0.001, overlap=False)
    assert len(reducer.buckets) > 2
    storages = {b.flat.untyped_storage().data_ptr() for b in reducer.buckets}
    assert len(storages) == 1
    x = torch.randn(4, 3, 8, 8).to(memory_format=torch.channels_last)
    for m, batch in ((model, x), (plain, x), (other, x + 1)):
        m(batch).square().sum().backward()
    for bucket in reducer.buckets:
        for p, view in zip(bucket.params, bucket.views):
            assert p.grad.data_ptr() == view.data_ptr()
    tail = set(map(id, reducer.buckets[-1].params))
    grads = [p.grad * (1 if id(p) in tail else _NoTransport.size) for p in model.parameters()]
    assert all(torch.equal(g, q.grad) for g, q in zip(grads, plain.parameters()))
    assert not all(torch.equal(g, q.grad) for g, q in zip(grads, other.parameters()))
    reducer.close()


class _Recorder:
    """A 2-rank MPI-like transport that adds nothing: it records each blocking call as
    (offset in the arena, elements) and whether every bucket the call covers was complete."""

    name, size, progress = "recorder", 2, "hook"

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, bool]] = []
        self.agreed: list[int] = []
        self.reducer = None

    def blocking(self, flat, call: int = 0) -> None:
        """Record the calls an MPI transport makes: ``call`` elements each (0: one)."""
        step = call or flat.numel()
        for start in range(0, flat.numel(), step):
            self._one(flat[start:start + step])

    def _one(self, flat) -> None:
        lo, n = flat.storage_offset(), flat.numel()
        covered = [b for b in self.reducer.buckets if b.flat.storage_offset() < lo + n
                   and lo < b.flat.storage_offset() + b.flat.numel()] if self.reducer else []
        self.calls.append((lo, n, all(b.ready == len(b.params) for b in covered)))

    def barrier(self) -> None:
        pass

    def agree(self, value):
        self.agreed.append(value)
        return value


def _linear_stack(width: int = 64, depth: int = 6):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])


def test_calls_follow_the_arena_once_the_buckets_they_cover_are_complete():
    """With MPI's blocking calls the reducer reduces its arena in calls of ``call_mb``
    that ignore bucket boundaries. With a communication thread, a call is handed over during
    backward only when every bucket it covers is complete, and after synchronize() the calls
    tile the arena exactly once, each of the chunk size but the last. The control hooks a
    later bucket first: nothing is handed over until the first bucket completes too."""
    import torch

    from hpcai.training.allreduce import GradAllreducer

    model = _linear_stack()
    rec = _ThreadedRecorder()
    reducer = GradAllreducer(model, rec, bucket_mb=0.02, call_mb=0.01, progress="thread")
    rec.reducer = reducer
    (stream,) = reducer.streams
    assert len(reducer.buckets) >= 3 and stream.chunk == int(0.01 * 2**20) // 4
    reducer.backward(model(torch.randn(3, 64)).square().sum())
    handed = stream.sent
    reducer.synchronize()
    base = stream.flat.storage_offset()
    offsets = [lo - base for lo, _, _ in rec.calls]
    sizes = [n for _, n, _ in rec.calls]
    assert handed > 0 and all(ok for _, _, ok in rec.calls)
    assert offsets == list(range(0, stream.flat.numel(), stream.chunk))
    assert sizes[:-1] == [stream.chunk] * (len(sizes) - 1) and sum(sizes) == stream.flat.numel()
    assert reducer.stats.allreduces == len(sizes)
    later = reducer.buckets[1]
    for p in later.params:   # a later bucket complete first: nothing to send yet
        reducer._on_grad(p)
    assert later.ready == len(later.params) and stream.sent == 0
    for p in reducer.buckets[0].params:
        reducer._on_grad(p)
    assert stream.sent > 0
    reducer.synchronize()
    assert all(ok for _, _, ok in rec.calls)
    reducer.close()


def test_hook_progress_calls_in_one_run_once_backward_has_ended():
    """``hook`` progress (MPICH, Intel MPI): no call while backward runs, every bucket but
    the last complete; synchronize then makes them all, tiling the arena once. The control,
    ``thread`` progress on the same model, hands calls over during backward."""
    import torch

    from hpcai.training.allreduce import GradAllreducer

    sent = {}
    for progress, rec in (("hook", _Recorder()), ("thread", _ThreadedRecorder())):
        model = _linear_stack(width=64, depth=8)
        layer = (64 * 64 + 64) * 4 / 2**20
        reducer = GradAllreducer(model, rec, bucket_mb=layer, call_mb=layer / 3,
                                 progress=progress)
        rec.reducer = reducer
        (stream,) = reducer.streams
        assert len(reducer.buckets) == 8 and reducer.progress == progress
        reducer.backward(model(torch.randn(3, 64)).square().sum())
        assert all(b.ready == b.n for b in reducer.buckets[:-1])
        sent[progress] = stream.sent
        if progress == "hook":
            assert rec.calls == []
        reducer.synchronize()
        assert sum(n for _, n, _ in rec.calls) == stream.flat.numel()
        assert all(ok for _, _, ok in rec.calls)
        reducer.close()
    assert sent["hook"] == 0 and sent["thread"] > 0


class _SlowBarrier(_Recorder):
    """A recorder whose barrier takes 5 ms (the wait for a slower rank) and is counted."""

    def __init__(self) -> None:
        super().__init__()
        self.barriers = 0

    def barrier(self) -> None:
        self.barriers += 1
        time.sleep(5e-3)


@pytest.mark.parametrize("layers", [6, 1], ids=["buckets", "one bucket"])
def test_blocking_mode_samples_the_imbalance_every_few_steps(layers, monkeypatch):
    """Blocking mode times the wait for the slowest rank with a barrier on the first
    synchronize and every IMBALANCE_EVERY-th after it, each wait counted IMBALANCE_EVERY
    times; the calls still reduce the whole arena every step. The control: with
    IMBALANCE_EVERY at 1, every step has its barrier."""
    import torch

    from hpcai.training import allreduce
    from hpcai.training.allreduce import IMBALANCE_EVERY, GradAllreducer

    every = {}
    for n in (IMBALANCE_EVERY, 1):
        monkeypatch.setattr(allreduce, "IMBALANCE_EVERY", n)
        model = _linear_stack(depth=layers)
        rec = _SlowBarrier()
        reducer = GradAllreducer(model, rec, bucket_mb=0.02, overlap=False, call_mb=1)
        rec.reducer = reducer
        steps = IMBALANCE_EVERY + 1
        for _ in range(steps):
            reducer.backward(model(torch.randn(3, 64)).square().sum())
            reducer.synchronize()
        assert sum(k for _, k, _ in rec.calls) == steps * sum(b.flat.numel()
                                                             for b in reducer.buckets)
        every[n] = rec.barriers
        assert reducer.stats.imbalance_s >= n * rec.barriers * 5e-3
        reducer.close()
    assert IMBALANCE_EVERY > 1 and every == {IMBALANCE_EVERY: 2, 1: IMBALANCE_EVERY + 1}


class _ThreadedRecorder(_Recorder):
    """A recorder that allows a communication thread: it also records the thread of each
    call, takes 2 ms per call, and raises in the call after ``fail_at`` calls (when set)."""

    threads = True

    def __init__(self) -> None:
        super().__init__()
        self.threads_of: list[int] = []
        self.fail_at = None

    def _one(self, flat) -> None:
        import threading

        if self.fail_at is not None and len(self.calls) == self.fail_at:
            self.fail_at = None
            raise RuntimeError("the transport failed")
        time.sleep(0.002)
        self.threads_of.append(threading.get_ident())
        super()._one(flat)


def test_thread_progress_calls_off_the_main_thread_and_synchronize_waits_for_them():
    """``thread`` progress: the calls that backward completes before its last bucket are
    handed to the reducer's communication thread; the last bucket's hook takes over those it
    has not started (:func:`test_comm_thread_take_over_returns_the_pieces_not_started`) and
    makes them and the rest on the main thread (nothing is left to overlap them with): the
    thread makes a prefix of the handed calls, the main thread all after it. Together they
    tile the arena exactly once, in order, and every gradient is this rank's share. A call
    that raises fails the step on the main thread, and the next step is whole again. The
    control: a transport that does not allow a second thread (MPI below
    MPI_THREAD_SERIALIZED) gets ``hook`` progress, and every call is made on the main
    thread."""
    import threading

    import torch

    from hpcai.training.allreduce import GradAllreducer

    main = threading.get_ident()
    model = _linear_stack()
    rec = _ThreadedRecorder()
    reducer = GradAllreducer(model, rec, bucket_mb=0.02, call_mb=0.01, progress="thread")
    rec.reducer = reducer
    (stream,) = reducer.streams
    assert reducer.progress == "thread" and len(reducer.buckets) >= 3

    def step() -> list:
        rec.calls.clear()
        rec.threads_of.clear()
        model.zero_grad(set_to_none=False)
        reducer.backward(model(torch.randn(3, 64)).square().sum())
        reducer.synchronize()
        return [lo - stream.flat.storage_offset() for lo, _, _ in rec.calls]

    offsets = step()
    assert offsets == list(range(0, stream.flat.numel(), stream.chunk))
    assert all(ok for _, _, ok in rec.calls)
    # the thread's calls: every complete chunk before the last bucket's end
    handed = len(range(0, reducer.buckets[-2].end // stream.chunk * stream.chunk,
                       stream.chunk))
    assert 0 < handed < len(offsets)
    by_thread = next(i for i, who in enumerate(rec.threads_of) if who == main)
    assert by_thread <= handed, "the thread made a call the last hook makes"
    assert main not in rec.threads_of[:by_thread] and len(set(rec.threads_of[:by_thread])) <= 1
    assert set(rec.threads_of[by_thread:]) == {main}
    rec.fail_at = 1
    with pytest.raises(RuntimeError, match="the transport failed"):
        step()
    assert step() == list(range(0, stream.flat.numel(), stream.chunk))
    reducer.close()
    plain = _ThreadedRecorder()   # the control: no second thread allowed
    plain.threads = False
    other = _linear_stack()
    control = GradAllreducer(other, plain, bucket_mb=0.02, call_mb=0.01, progress="thread")
    control.backward(other(torch.randn(3, 64)).square().sum())
    control.synchronize()
    assert control.progress == "hook" and set(plain.threads_of) == {main}
    control.close()


def test_comm_thread_take_over_returns_the_pieces_not_started():
    """``_CommThread.take_over`` waits for the piece being made and returns the pieces not
    yet started, in order, which the thread then never makes; a piece that raised on the
    thread is raised by the next ``take_over``, and the pieces after it are dropped. The
    thread is made to be inside its first piece while the main thread waits in take_over
    (events, not sleeps)."""
    import threading

    from hpcai.training.allreduce import _CommThread

    made, started, go = [], threading.Event(), threading.Event()

    def first() -> None:
        started.set()
        assert go.wait(10)
        made.append("first")

    comm = _CommThread(lambda piece: piece())   # pieces: here, callables
    comm.submit([first, lambda: made.append("second"), lambda: made.append("third")])
    assert started.wait(10)
    got: list = []
    taker = threading.Thread(target=lambda: got.append(comm.take_over()))
    taker.start()
    deadline = time.monotonic() + 10
    while not comm._cond._waiters and time.monotonic() < deadline:   # take_over waits
        time.sleep(0.001)
    go.set()
    taker.join(10)
    assert made == ["first"], "take_over returned before the piece being made ended"
    (rest,) = got
    for piece in rest:   # the caller makes them, in order
        piece()
    assert made == ["first", "second", "third"]
    assert comm.take_over() == []   # idle: nothing left

    entered = threading.Event()

    def broken() -> None:
        entered.set()
        raise RuntimeError("the transport failed")
    comm.submit([broken, lambda: made.append("after")])
    assert entered.wait(10)
    with pytest.raises(RuntimeError, match="the transport failed"):
        comm.take_over()
    assert comm.take_over() == [] and "after" not in made
    comm.close()


def test_pieces_made_at_the_end_are_joined_only_where_the_calls_stay_the_same():
    """The last hook makes the pieces the thread did not start as one transport call per
    stream, so no Python runs between their MPI calls: consecutive pieces of one stream with
    one call size are joined (the same calls). Pieces of two streams, of another call size
    or with a gap between them are not (the controls)."""
    import torch

    from hpcai.training.allreduce import GradAllreducer

    reducer = GradAllreducer.__new__(GradAllreducer)
    a = type("S", (), {"flat": torch.zeros(4)})()
    b = type("S", (), {"flat": torch.zeros(4)})()
    mib = (1 << 20) // 4   # float32 elements

    def pieces(stream, chunk, n):
        return [(stream, i * chunk, (i + 1) * chunk, chunk) for i in range(n)]
    assert reducer._merged(pieces(a, 2 * mib, 3)) == [(a, 0, 6 * mib, 2 * mib)]
    assert reducer._merged(pieces(a, mib // 2, 2) + pieces(b, mib // 2, 1)) == [
        (a, 0, mib, mib // 2), (b, 0, mib // 2, mib // 2)]
    other_size = [(a, 0, mib, mib), (a, mib, 2 * mib, mib // 2)]
    assert reducer._merged(other_size) == other_size
    gap = [(a, 0, mib, mib), (a, 2 * mib, 3 * mib, mib)]
    assert reducer._merged(gap) == gap


def test_call_size_is_measured_on_the_arena_and_agreed():
    """Without ``call_mb`` the reducer times its arena's reduction at each candidate size
    (1, 4, 16, 64 MiB below the arena's size, and the whole arena) and every rank takes
    rank 0's choice; the arena's
    contents (gradients already there) are kept, and so it is for every MPI family (Intel
    MPI too: which size is fastest differs between hosts). A small arena has one
    candidate, itself, and nothing is timed (the control)."""
    import torch

    from hpcai.training.allreduce import CALIBRATION_ROUNDS, GradAllreducer

    big = torch.nn.Linear(1024, 1536, bias=False)   # a 6 MiB arena: 1 MiB, 4 MiB or all
    big.weight.grad = torch.randn_like(big.weight)
    before = big.weight.grad.clone()
    rec = _Recorder()
    reducer = GradAllreducer(big, rec)
    (stream,) = reducer.streams
    total = stream.flat.numel()
    repeat, chosen = rec.agreed   # timings repeated to about 2 ms each, then the choice
    assert chosen == stream.chunk and stream.chunk in (2**18, 2**20, total)
    per_round = sum(-(-total // n) for n in (2**18, 2**20, total))
    assert 1 <= repeat <= 32 and len(rec.calls) == 1 + CALIBRATION_ROUNDS * repeat * per_round
    assert torch.equal(big.weight.grad, before)
    small = _Recorder()
    GradAllreducer(_linear_stack(), small)
    assert small.agreed == [] and small.calls == []
    intel = _Recorder()
    intel.family = "intel"
    (timed,) = GradAllreducer(big, intel).streams
    assert timed.sizes == stream.sizes and intel.agreed[1] == timed.chunk
    assert len(intel.calls) > 1
    reducer.close()


class _Slow(_Recorder):
    """A recorder whose calls take 3 ms each, but for calls of ``fast`` elements."""

    def __init__(self, fast: int) -> None:
        super().__init__()
        self.fast = fast

    def _one(self, flat) -> None:
        super()._one(flat)
        if flat.numel() != self.fast:
            time.sleep(3e-3)


@pytest.mark.parametrize("later", [3 * 2**19, 2**18],
                         ids=["whole-arena-fastest-later", "unchanged (control)"])
def test_the_first_steps_choose_the_call_size_they_reduced_fastest(later):
    """Training's own steps decide the call size: the reducer is made while 1 MiB calls are
    the fast ones (calibration picks 1 MiB); then, after one warm-up step, each candidate
    (1 MiB, 4 MiB and the whole 6 MiB arena) is used for TUNE_ROUNDS steps in alternating
    order, and rank 0's size with the least median seconds in calls holds, and the reducer
    stops tuning. When only whole-arena calls are fast by then, the reducer ends on the whole
    arena; the control, whose 1 MiB calls stay the fast ones, keeps 1 MiB."""
    import torch

    from hpcai.training.allreduce import TUNE_ROUNDS, TUNE_WARMUP, GradAllreducer

    big = torch.nn.Linear(1024, 1536, bias=False)
    rec = _Slow(2**18)
    reducer = GradAllreducer(big, rec)
    rec.reducer = reducer
    (stream,) = reducer.streams
    assert stream.chunk == stream.calibrated == 2**18
    rec.fast = later
    used = []
    while reducer.tuning:
        used.append(stream.chunk)
        big.weight.grad.fill_(1.0)
        reducer.replay_backward()
        reducer.synchronize()
    sizes = [2**18, 2**20, 3 * 2**19]
    assert used[TUNE_WARMUP:] == (sizes + sizes[::-1]) * (TUNE_ROUNDS // 2) + (
        sizes if TUNE_ROUNDS % 2 else [])
    assert stream.chunk == later and rec.agreed[-1] == later and stream.tuner is None
    rec.calls.clear()
    big.weight.grad.fill_(1.0)
    reducer.replay_backward()
    reducer.synchronize()   # tuned: the chosen size from now on, nothing agreed again
    assert [n for _, n, _ in rec.calls] == [later] * (3 * 2**19 // later)
    assert len(rec.agreed) == 3
    reducer.close()


def test_a_size_replaces_the_calibrated_one_only_by_the_margin():
    """The tuner keeps the calibrated size unless another's median is TUNE_MARGIN faster:
    2 % faster is kept; 10 % faster replaces it (the control)."""
    from hpcai.training.allreduce import _Tuner

    def tuned(other_s: float) -> int:
        tuner = _Tuner([1, 2])
        tuner.seconds = {1: [1.0, 1.0, 1.0], 2: [other_s] * 3}
        return tuner.best(calibrated=1)

    assert tuned(0.98) == 1 and tuned(0.90) == 2


def test_a_watch_calls_a_size_slow_only_past_both_the_factor_and_the_floor():
    """_Watch says nothing before WATCH_STEPS steps, then whether their median exceeds the
    trials' median by RETUNE_FACTOR and by RETUNE_FLOOR_S: 1.4x of 10 ms is not slow, 1.6x
    is; 9x of 0.1 ms (0.8 ms longer) is not, 12x (1.1 ms longer) is."""
    from hpcai.training.allreduce import RETUNE_FACTOR, RETUNE_FLOOR_S, WATCH_STEPS, _Watch

    assert (RETUNE_FACTOR, RETUNE_FLOOR_S) == (1.5, 1e-3)

    def verdict(expected: float, seconds: float) -> bool:
        watch = _Watch(expected)
        said = [watch.record(seconds) for _ in range(WATCH_STEPS)]
        assert said[:-1] == [None] * (WATCH_STEPS - 1) and watch.seconds == []
        return said[-1]

    assert verdict(10e-3, 14e-3) is False and verdict(10e-3, 16e-3) is True
    assert verdict(1e-4, 9e-4) is False and verdict(1e-4, 1.2e-3) is True


def _tuned_on_1mib():
    """A reducer of a 6 MiB linear layer over :class:`_Slow` (1 MiB calls fast), after its
    first trials; with its recorder, stream and a function making one step."""
    import torch

    from hpcai.training.allreduce import GradAllreducer

    big = torch.nn.Linear(1024, 1536, bias=False)
    rec = _Slow(2**18)
    reducer = GradAllreducer(big, rec)
    rec.reducer = reducer
    (stream,) = reducer.streams

    def step() -> None:
        big.weight.grad.fill_(1.0)
        reducer.replay_backward()
        reducer.synchronize()

    while reducer.tuning:
        step()
    return reducer, rec, stream, step


@pytest.mark.parametrize("later", [3 * 2**19, 2**18],
                         ids=["chosen-size-slows", "unchanged (control)"])
def test_the_sizes_are_tried_again_once_the_chosen_one_slows_down(later):
    """After the trials chose 1 MiB calls (the fast ones), the machine changes: only
    whole-arena calls stay fast. WATCH_STEPS steps later every rank agrees to run the trials
    again, with the size in use as the one to beat, and they end on the whole arena. In the
    control 1 MiB calls stay fast: no new trials, and the reducer agrees nothing but the
    watch's verdict."""
    from hpcai.training.allreduce import WATCH_STEPS

    reducer, rec, stream, step = _tuned_on_1mib()
    assert stream.chunk == 2**18 and stream.watch is not None and reducer.retunes == 0
    agreed = len(rec.agreed)
    rec.fast = later
    for _ in range(WATCH_STEPS):
        step()
    # the verdict: rank 0's contenders (4 MiB calls, 6 ms per step, are not one), or None
    assert rec.agreed[agreed:] == [[2**18, later] if later != 2**18 else None]
    if later == 2**18:
        assert not reducer.tuning and reducer.retunes == 0 and stream.chunk == 2**18
    else:
        assert reducer.tuning and reducer.retunes == 1 and stream.baseline == 2**18
        while reducer.tuning:
            step()
        assert stream.chunk == later and rec.agreed[-1] == later and reducer.retunes == 1
    reducer.close()


def test_a_size_found_slow_counts_as_slow_in_later_trials():
    """A size's score is its median in the trials, or the median of the watched steps that
    found it slow, whichever is longer: 1.0 s in the trials but 3.0 s when watched loses to
    another size's 1.5 s; without that record (the control) it wins."""
    from hpcai.training.allreduce import _Tuner

    tuner = _Tuner([1, 2])
    tuner.seconds = {1: [1.0, 1.0, 1.0], 2: [1.5] * 3}
    assert tuner.score(1, {1: 3.0}) == 3.0 and tuner.score(2, {1: 3.0}) == 1.5
    assert tuner.best(calibrated=1, slow={1: 3.0}) == 2
    assert tuner.best(calibrated=1, slow={}) == 1 and tuner.best(calibrated=1) == 1


@pytest.mark.parametrize("remember", [True, False], ids=["remembered", "forgotten (control)"])
def test_a_retune_passes_over_the_size_that_went_slow_even_if_fast_again(remember):
    """1 MiB calls are chosen, then go slow (3 ms per call: 18 ms per step): the watch fires
    and records that median for 1 MiB. During the new trials 1 MiB calls are fast again, but
    the trials choose the whole arena (3 ms per step), the least worst state seen. In the
    control the record is dropped before the trials end, and they choose 1 MiB again."""
    from hpcai.training.allreduce import WATCH_STEPS

    reducer, rec, stream, step = _tuned_on_1mib()
    assert stream.chunk == 2**18 and stream.slow == {}
    rec.fast = 3 * 2**19
    for _ in range(WATCH_STEPS):
        step()
    assert reducer.retunes == 1 and set(stream.slow) == {2**18}
    assert stream.slow[2**18] >= 6 * 3e-3
    rec.fast = 2**18   # fast again, during the new trials
    if not remember:
        stream.slow.clear()
    while reducer.tuning:
        step()
    assert stream.chunk == (3 * 2**19 if remember else 2**18)
    assert stream.watch.expected < 6 * 3e-3   # the chosen size's own score
    first, again = stream.rounds   # what each round of trials saw, and chose
    assert first["chose"] == 2**18 and again["chose"] == stream.chunk
    assert again["median_s"][2**18] < 3e-3 <= again["median_s"][3 * 2**19]
    assert (again["score_s"][2**18] >= 6 * 3e-3) == remember
    reducer.close()


@pytest.mark.parametrize("factor", [None, 3.0], ids=["default", "wider (control)"])
def test_trials_run_again_only_for_the_contenders(factor, monkeypatch):
    """The first trials saw 1 MiB calls at almost nothing, the whole arena at 3 ms and 4 MiB
    calls at 6 ms per step (3 ms per call but 1 MiB's). 1 MiB calls then go slow (18 ms per
    step): the new trials try 1 MiB (the size in use) and the whole arena, whose 3 ms is
    within CONTENDER_FACTOR of the least, and leave 4 MiB calls out, 2x the least. In the
    control the factor is 3, so 4 MiB calls are tried again too."""
    from hpcai.training import allreduce
    from hpcai.training.allreduce import TUNE_WARMUP, WATCH_STEPS

    if factor is not None:
        monkeypatch.setattr(allreduce, "CONTENDER_FACTOR", factor)
    reducer, rec, stream, step = _tuned_on_1mib()
    rec.fast = 3 * 2**19
    for _ in range(WATCH_STEPS):
        step()
    tried = []
    while reducer.tuning:
        tried.append(stream.chunk)
        step()
    want = {2**18, 3 * 2**19} | ({2**20} if factor else set())
    assert set(tried[TUNE_WARMUP:]) == want and set(stream.rounds[-1]["median_s"]) == want
    assert stream.chunk == 3 * 2**19 and reducer.retunes == 1
    reducer.close()


@pytest.mark.parametrize("others_ms", [50.0, None], ids=["only-contender", "measured (control)"])
def test_a_slow_size_that_is_still_the_only_contender_runs_no_trials(others_ms):
    """1 MiB calls go slow (18 ms per step), but the last round saw every other size at
    50 ms: 1 MiB is the only contender, so no trials run, and the watch expects its slow
    median from then on. In the control the round's own medians stand (whole arena 3 ms):
    the trials run."""
    from hpcai.training.allreduce import WATCH_STEPS

    reducer, rec, stream, step = _tuned_on_1mib()
    if others_ms is not None:
        scores = stream.rounds[-1]["score_s"]
        for n in scores:
            if n != 2**18:
                scores[n] = others_ms / 1e3
    rec.fast = 3 * 2**19
    for _ in range(WATCH_STEPS):
        step()
    assert stream.slow[2**18] >= 6 * 3e-3
    if others_ms is not None:
        assert not reducer.tuning and reducer.retunes == 0 and stream.chunk == 2**18
        assert stream.watch.expected == stream.slow[2**18]
    else:
        assert reducer.tuning and reducer.retunes == 1
    reducer.close()


def test_contenders_are_within_the_factor_of_the_least_score():
    """_contenders scores the size in use at least at its slow median, keeps it always, and
    keeps the others within CONTENDER_FACTOR of the least score, in the sizes' order."""
    import torch

    from hpcai.training.allreduce import CONTENDER_FACTOR, _contenders, _Stream

    assert CONTENDER_FACTOR == 1.5
    stream = _Stream(torch.zeros(8), [], chunk=2, sizes=[1, 2, 4, 8])
    stream.rounds = [{"score_s": {1: 10.0, 2: 9.0, 4: 14.0, 8: 40.0}}]
    assert _contenders(stream, now=30.0) == [1, 2, 4]   # least 10: up to 15
    assert _contenders(stream, now=5.0) == [1, 2]       # 2 scored 9 (more than now): to 13.5
    stream.rounds = [{"score_s": {1: 10.0, 2: 3.0, 4: 14.0, 8: 40.0}}]
    assert _contenders(stream, now=6.0) == [2]          # least 6: up to 9, none of the others
    stream.rounds = [{"score_s": {2: 9.0, 8: 11.0}}]    # 1 and 4 left out before
    assert _contenders(stream, now=20.0) == [2, 8]


@pytest.fixture(scope="module")
def mpich_streamed(tmp_path_factory):
    """streamed_allreduce.py --call-mb 0.3 as a 2-rank MPICH job (one_job.py, one part)."""
    folder = tmp_path_factory.mktemp("mpich")
    return one_job("mpich", [["mpich-0.3MiB", "streamed_allreduce.py", "--call-mb", "0.3"]],
                   folder, timeout=300)


@pytest.mark.parametrize("name, want", [
    ("openmpi-0.3MiB", "ok"), ("mpich-0.3MiB", "ok"), ("openmpi-measured", "ok"),
    ("no-synchronize (control)", "FAIL")],
    ids=["openmpi-0.3MiB", "mpich-0.3MiB", "openmpi-measured", "no-synchronize (control)"])
def test_calls_that_cross_buckets_give_the_exact_mean(name, want, request):
    """2 ranks on a real MPI: the arena (4 buckets, about 2.6 MiB) reduced in 0.3 MiB calls
    that cross bucket boundaries, or in the measured call size (the same on both ranks at
    every step, while the first steps try 1 MiB and the whole arena, and after),
    leaves every gradient the exact mean, in ceil(arena / call) calls. The control gives one
    parameter of the last bucket no gradient (unused) and leaves out synchronize(): the
    calls from that bucket on are never made, and the mean is wrong. The Open MPI runs are
    parts of the shared job (:data:`STREAMED`), the control last in it."""
    if name.startswith("mpich"):
        result, extra = request.getfixturevalue("mpich_streamed"), ["--call-mb", "0.3"]
    else:
        result, extra = request.getfixturevalue("openmpi_job")[1], STREAMED[name]
    printed, exits = part(result, name)
    assert exits == ["exit 0"] * 2, result.stderr[-3000:]
    lines = [ln.split() for ln in printed if ln.endswith(("ok", "FAIL"))]
    assert len(lines) == 2 and {ln[2] for ln in lines} == {want}, printed
    chunk, calls = int(lines[0][0]), int(lines[0][1])
    total = sum(400 * 400 + 400 for _ in range(4))
    if "--no-sync" in extra:
        assert 0 < calls < -(-total // chunk)
    else:
        assert calls == -(-total // chunk) and lines[0][:2] == lines[1][:2]
    used = [[int(n) for n in ln.split()[1:]] for ln in printed if ln.startswith("sizes:")]
    assert len(used) == 2 and used[0] == used[1]
    if extra[:1] == ["--call-mb"]:
        assert chunk == int(0.3 * 2**20) // 4 and len(used[0]) == 1
    elif not extra:   # the calibrated size, then each candidate TUNE_ROUNDS times, then one
        from hpcai.training.allreduce import TUNE_ROUNDS, TUNE_WARMUP
        trials = used[0][TUNE_WARMUP:-1]
        assert sorted(set(trials)) == [2**18, total] and len(trials) == 2 * TUNE_ROUNDS
        assert used[0][-1] == chunk


def test_a_bucket_closes_once_it_holds_the_limit():
    """Buckets fill in reverse order until they hold ``limit`` bytes or more, one dtype
    each: the small tensors between two large ones share a bucket with the next large one
    instead of a call of their own, and every bucket but the last holds at least the limit.
    The control is a dtype change, which closes a bucket early."""
    from hpcai.training.sync import plan_buckets

    mb = 2**20
    sizes = [9 * mb, 1024, 512, 9 * mb, 2048, 3 * mb, 2 * mb]   # registration order
    groups = plan_buckets(sizes, ["f"] * len(sizes), 4 * mb)
    assert groups == [[6, 5], [4, 3], [2, 1, 0]]
    assert all(sum(sizes[i] for i in g) >= 4 * mb for g in groups[:-1])
    assert sorted(i for g in groups for i in g) == list(range(len(sizes)))
    mixed = plan_buckets(sizes, ["f"] * 6 + ["h"], 4 * mb)
    assert mixed == [[6], [5, 4, 3], [2, 1, 0]]


@pytest.fixture(scope="module")
def intel_job(tmp_path_factory):
    """chunked_allreduce.py under Intel MPI: one call, then 1 MiB calls; then the same as
    Open MPI: one 2-rank Intel MPI job (one_job.py, three parts)."""
    folder = tmp_path_factory.mktemp("intel")
    return one_job("intel", [["whole", "chunked_allreduce.py"],
                             ["split", "chunked_allreduce.py", "--call", str(1 << 18)],
                             ["as-openmpi", "chunked_allreduce.py", "--family", "openmpi"]],
                   folder, timeout=300)


@pytest.mark.parametrize("name, want", [("whole", "intel 1 ok"), ("split", "intel 4 ok"),
                                        ("as-openmpi", "openmpi 1 ok")],
                         ids=["intel", "1 MiB calls (control)", "as open mpi"])
def test_intel_mpi_reduces_a_bucket_in_the_calls_it_is_asked_for(name, want, intel_job):
    """Under Intel MPI a 3 MiB bucket is reduced in one call, as under the other families
    (no family caps its calls: the call size is measured, ``_call_sizes``), and both ranks
    get the exact sum; the control asks for 1 MiB calls and gets four."""
    printed, exits = part(intel_job, name)
    assert exits == ["exit 0"] * 2, intel_job.stderr[-3000:]
    lines = sorted(line for line in printed if line.endswith(("ok", "FAIL")))
    assert lines == [want] * 2, printed


_FAMILY_PROGRESS = """
import os, sys
from hpcai.training.allreduce import THREAD_ENV, MpiTransport, set_thread_env
if sys.argv[1] == "train":
    set_thread_env()
from mpi4py import MPI
t = MpiTransport(MPI.COMM_WORLD)
print(t.family, t.progress, os.environ.get(THREAD_ENV[t.family][0]))
"""


@pytest.mark.parametrize("mpi, how, env, want", [
    ("openmpi", "train", {}, "openmpi thread 1"),        # what train sets before MPI starts
    ("openmpi", "train", {"OMPI_MCA_mpi_yield_when_idle": "0"}, "openmpi hook 0"),   # kept
    ("openmpi", "bare", {}, "openmpi hook None"),        # nobody set it: no spinning thread
    ("intel", "train", {}, "intel hook 2"),
    ("intel", "train", {"I_MPI_THREAD_YIELD": "0"}, "intel hook 0"),    # the user's kept
    ("intel", "bare", {}, "intel hook None"),
])
def test_threads_make_their_calls_only_where_their_waits_yield(mpi, how, env, want):
    """Open MPI and Intel MPI: the variable that makes their waiting calls yield the core is
    set by ``train`` before MPI starts, unless the user set it (``allreduce.THREAD_ENV``).
    Open MPI's communication thread makes the calls only where it is on; Intel MPI's default
    is ``hook`` either way (``PROGRESS``)."""
    import sys

    code = [sys.executable, "-c", _FAMILY_PROGRESS, how]
    argv = code if mpi == "openmpi" else ["hpcai-launch", "--mpi", mpi, "-N", "1", "--", *code]
    unset = dict.fromkeys(SHARED_CORES)   # the test bed's own yield setting
    result = run(argv, base_env(**{**unset, **env}), timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split("\n")[-2] == want


def test_a_bucket_scales_only_the_gradients_whose_loss_was_not_divided():
    """A bucket with hooks whose gradients came partly from a divided loss (already a share
    of the mean) and partly not: after synchronize, on a 2-rank transport that adds nothing,
    the divided ones are as they were and the others halved, each exactly once. The last
    bucket's one hook (on its last parameter) decides for the whole bucket; a second
    gradient there before synchronize is the accumulation error, while one for a parameter
    without a hook (the control) raises nothing."""
    import pytest
    import torch

    import hpcai.training.allreduce as engine
    from hpcai.training.allreduce import GradAllreducer

    model = _linear_stack(width=8, depth=4)
    reducer = GradAllreducer(model, _Recorder(), bucket_mb=(8 * 8 + 8) * 4 / 2**20,
                             call_mb=1.0)
    assert len(reducer.buckets) == 4
    first, tail = reducer.buckets[0], reducer.buckets[-1]
    for divided_tail in (2, 0):
        for p in model.parameters():
            p.grad.fill_(1.0)
        divided = set(map(id, first.params[::2]))
        for p in (q for b in reducer.buckets for q in b.params):
            in_first = any(p is q for q in first.params)
            engine._loss_divided_by = ((2 if id(p) in divided else 0) if in_first
                                       else divided_tail)
            try:
                reducer._on_grad(p)
            finally:
                engine._loss_divided_by = 0
        reducer.synchronize()
        for p in first.params:
            assert torch.equal(p.grad, torch.full_like(p, 1.0 if id(p) in divided else 0.5))
        for p in tail.params:
            assert torch.equal(p.grad, torch.full_like(p, 1.0 if divided_tail else 0.5))
    reducer.replay_backward()
    reducer._on_grad(tail.params[0])   # no hook: not seen
    reducer.synchronize()
    reducer.replay_backward()
    reducer._on_grad(tail.params[-1])
    with pytest.raises(RuntimeError, match="second gradient"):
        reducer.synchronize()
    reducer.close()


@pytest.mark.parametrize("how", ["divided", "plain", "set-to-none", "hook-param-unused",
                                 "blocking"])
def test_the_last_bucket_is_scaled_once_by_synchronize(how):
    """A model in one bucket, whose backward makes one Python call (the hook on its last
    parameter), on a 2-rank transport that adds nothing (synchronize's short path): after a
    real backward and synchronize every gradient is half the plain model's, scaled exactly
    once (not equal to it: the control for no scaling; twice it: for scaling twice), and
    lives in the arena, whether backward's loss was divided (``reducer.backward``) or not
    (``loss.backward()``), the gradients were set to None before backward (replaced, then
    copied back in), the hooked parameter got no gradient (then ``backward()`` says the
    loss was divided), or the reducer runs in blocking mode. Each step makes one call over
    the whole arena, once the bucket is complete; a second gradient for the hooked
    parameter before synchronize is the accumulation error (where backward gives it one)."""
    import pytest
    import torch

    from hpcai.training.allreduce import GradAllreducer

    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.spare = torch.nn.Linear(6, 6)   # registered first: the hooked parameter
            self.body = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh(),
                                            torch.nn.Linear(6, 2))

        def forward(self, x):
            y = self.body(x)
            return y if how == "hook-param-unused" else y + self.spare(x)[:, :2]

    model, plain = Net(), Net()
    plain.load_state_dict(model.state_dict())
    rec = _Recorder()
    reducer = GradAllreducer(model, rec, call_mb=1.0, overlap=how != "blocking")
    rec.reducer = reducer
    (bucket,) = reducer.buckets
    assert len(reducer._hooks) == 1 and reducer._hooks[0][0] is model.spare.weight
    assert reducer._solo is not None
    x = torch.randn(5, 6)
    plain(x).square().sum().backward()
    for step in range(2):
        for p in model.parameters():
            p.grad.zero_()
        if how == "set-to-none":
            for p in model.parameters():
                p.grad = None
        loss = model(x).square().sum()
        if how == "plain":
            loss.backward()
        else:
            reducer.backward(loss)
        reducer.synchronize()
        for p, q, view in zip(model.parameters(), plain.parameters(),
                              reversed(bucket.views)):
            want = torch.zeros_like(q) if q.grad is None else q.grad
            assert p.grad.data_ptr() == view.data_ptr()
            assert torch.allclose(p.grad * 2, want, rtol=0, atol=1e-6)
            if want.abs().max() > 0:
                assert not torch.allclose(p.grad, want)
        assert rec.calls == [(bucket.flat.storage_offset(), bucket.flat.numel(), True)]
        rec.calls.clear()
    if how != "hook-param-unused":   # there backward gives the hooked parameter nothing
        reducer.backward(model(x).square().sum())
        reducer._on_grad(model.spare.weight)
        with pytest.raises(RuntimeError, match="second gradient"):
            reducer.synchronize()
    reducer.close()
