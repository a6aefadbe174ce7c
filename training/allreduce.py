"""PyTorch gradient averaging over MPI: fused buckets, overlapped with the backward pass.

Parameters are grouped, in reverse registration order (roughly the order in which backward
produces their gradients), into buckets of at most ``bucket_mb`` (``sync.plan_buckets``).
All buckets of a dtype are consecutive slices of one allocation (the arena), and each
parameter's ``.grad`` is a view into its bucket, so backward writes the bucket directly and
the reduction works in place: nothing is copied in or out (zero gradients in place,
``zero_grad(set_to_none=False)``, to keep it that way; a replaced gradient is copied in once
and re-pointed).

A post-accumulate-grad hook on every parameter counts arrivals. When a bucket is complete,
the hook scales it to this rank's share of the mean: nothing when the loss was divided by
the world size, by :meth:`GradAllreducer.backward` (as ``train`` runs backward), else a
``div_`` while backward has just written it (a pass over the gradients on the main thread:
8-10 ms more per ResNet50 exchange, ``bench/allreduce_bw.py``). The last bucket (the
parameters registered first, whose gradients backward produces last) has one hook only,
on its last parameter, which notes whether its loss was divided and catches a second
gradient: that bucket completes when backward ends, so ``synchronize`` reduces it, and
backward makes no Python call per parameter for it (for a model in one bucket, such as the
3DGAN's networks, one per step in all).
In overlap mode the bucket's reduction is handed to a communication thread that makes
blocking ``MPI_Allreduce`` calls while backward goes on, or started as a non-blocking
``MPI_Iallreduce`` poked by the later hooks; with ``hook`` progress the blocking calls wait
until backward has ended and are made in one run on its thread (``progress``, chosen per
MPI family: :data:`PROGRESS`). The sum of the shares is the mean, so no pass follows the
reduction. :meth:`synchronize` reduces what backward did not complete (unused parameters),
waits for pending reductions and leaves every rank with the mean. Call it once after every
backward: a second gradient before it (accumulation) is an error. Blocking mode
(``overlap=False``) reduces all buckets in ``synchronize``, after a barrier on every
:data:`IMBALANCE_EVERY`-th step that measures how long the fastest rank waited for the
slowest (load imbalance, reported apart from the transfer, as an estimate).

The transport is MPI (mpi4py: whatever libmpi it loaded, the host MPI when the launcher
bound it in), torch.distributed's gloo or Horovod, so all are measured with the same
bucketing. On a GPU (``train --device cuda``) the buckets live in device memory and the MPI
transport reduces a host copy of each (``_Staged``), then copies the sum back.
"""

from __future__ import annotations

import collections
import operator
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    import numpy as np

from .hostmem import huge_zeros
from .sync import DEFAULT_BUCKET_MB, SyncStats, check_horovod_world, plan_buckets


class MpiTransport:
    """Sum-allreduce of flat tensors with mpi4py (in place)."""

    name = "mpi"

    def __init__(self, comm) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self.size = comm.Get_size()
        self.family = mpi_family()
        self.progress = PROGRESS[self.family]
        if self.progress == "thread" and not thread_env_on(self.family):
            self.progress = "hook"   # its waiting thread would spin on backward's core
        # blocking calls from a second thread (``thread`` progress) need this much
        self.threads = MPI.Query_thread() >= MPI.THREAD_SERIALIZED

    def start(self, flat: torch.Tensor):
        """An ``MPI.Request``; for a GPU tensor a :class:`_Staged` one (host copy)."""
        array, copy_back = host_array(flat)
        request = self.comm.Iallreduce(self._mpi.IN_PLACE, array, op=self._mpi.SUM)
        return _Staged(request, array, flat) if copy_back else request

    def blocking(self, flat: torch.Tensor, call: int = 0) -> None:
        """``MPI_Allreduce`` of ``flat`` in place, in consecutive calls of ``call`` elements
        (0: one call). One conversion to NumPy for all the calls: between two calls there is
        only the slicing."""
        array, copy_back = host_array(flat)
        self.blocking_host(array, call)
        if copy_back:
            flat.copy_(torch.from_numpy(array))

    def blocking_host(self, array: np.ndarray, call: int = 0) -> None:
        """:meth:`blocking` of a NumPy array: a view of a host arena made once, so that no
        torch call runs between two MPI calls (a torch slice converted before each call made
        the calls slower in 2-rank runs here)."""
        step = call or array.size
        if array.size > step:
            allreduce, in_place, op = self.comm.Allreduce, self._mpi.IN_PLACE, self._mpi.SUM
            for start in range(0, array.size, step):
                allreduce(in_place, array[start:start + step], op=op)
        else:
            self.comm.Allreduce(self._mpi.IN_PLACE, array, op=self._mpi.SUM)

    def wait_all(self, handles) -> None:
        handles = list(handles)
        self._mpi.Request.Waitall([_request(h) for h in handles])
        for handle in handles:
            if isinstance(handle, _Staged):
                handle.flat.copy_(torch.from_numpy(handle.host))

    def barrier(self) -> None:
        self.comm.Barrier()

    def agree(self, value):
        """Rank 0's ``value``, on every rank."""
        return self.comm.bcast(value, root=0)

    def poke(self, handles) -> None:
        """Let MPI progress outstanding requests (no progress thread in most MPIs)."""
        if handles:
            self._mpi.Request.Testall([_request(h) for h in handles])


def host_array(t: torch.Tensor) -> tuple[np.ndarray, bool]:
    """(a NumPy array MPI can read and fill for ``t``, whether ``t`` needs it copied back):
    a view of a contiguous CPU tensor, else a host copy. MPI is not assumed to read device
    memory (CUDA-aware)."""
    if t.device.type == "cpu" and t.is_contiguous():
        return t.numpy(), False
    return t.contiguous().cpu().numpy(), True


@dataclass
class _Staged:
    """A GPU tensor's allreduce: MPI works on ``host`` (a copy), ``flat`` gets the sum back
    in ``MpiTransport.wait_all``."""

    request: object
    host: np.ndarray
    flat: torch.Tensor


def _request(handle):
    return handle.request if isinstance(handle, _Staged) else handle


class TorchDistTransport:
    """The same, through torch.distributed (gloo: the transport DDP uses on CPU)."""

    progress = "nonblocking"   # gloo's own threads progress the work

    def __init__(self, name: str = "gloo") -> None:
        import torch.distributed as dist

        self.name = name
        self._dist = dist
        self.size = dist.get_world_size()

    def start(self, flat: torch.Tensor):
        return self._dist.all_reduce(flat, async_op=True)

    def blocking(self, flat: torch.Tensor) -> None:
        self._dist.all_reduce(flat)

    def wait_all(self, handles) -> None:
        for work in handles:
            work.wait()

    def barrier(self) -> None:
        self._dist.barrier()

    def poke(self, handles) -> None:
        pass


def _dense(p: torch.Tensor) -> bool:
    """Strides that cover exactly numel() elements (contiguous in some dimension order)."""
    expected = 1
    for size, stride in sorted(zip(p.shape, p.stride()), key=lambda t: t[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _grad_view(flat: torch.Tensor, p: torch.Tensor, offset: int) -> torch.Tensor:
    """A view of ``flat`` shaped like ``p`` with p's strides (channels-last stays so, which
    keeps autograd's gradient layout contract)."""
    if _dense(p):
        # as_strided's offset counts from the storage's start, and flat is a slice of it
        return flat.as_strided(p.shape, p.stride(), flat.storage_offset() + offset)
    return flat[offset:offset + p.numel()].view(p.shape)


def _arenas(groups: list[list[torch.nn.Parameter]]
            ) -> tuple[list[torch.Tensor], dict[torch.dtype, torch.Tensor]]:
    """One zeroed flat buffer per bucket, all buckets of a dtype slices of one allocation
    (the arena), on the parameters' device; and the arenas by dtype.

    On the CPU an arena is :func:`hostmem.huge_zeros`: 2 MiB-aligned and advised for
    transparent huge pages, whatever its size, on which MPI reduces faster than on 4 KiB
    pages (``bench/allreduce_bw.py``'s "for scale" side: torch buffers).
    """
    totals: dict[torch.dtype, int] = {}
    for group in groups:
        dtype = group[0].dtype
        totals[dtype] = totals.get(dtype, 0) + sum(p.numel() for p in group)
    arena = {}
    device = groups[0][0].device if groups else torch.device("cpu")
    for dtype, n in totals.items():
        if device.type != "cpu":
            arena[dtype] = torch.zeros(n, dtype=dtype, device=device)
            continue
        # bytes viewed as the dtype: also for one without a numpy twin (bfloat16)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        arena[dtype] = torch.from_numpy(huge_zeros(n * itemsize, "uint8")).view(dtype)
    used = dict.fromkeys(totals, 0)
    flats = []
    for group in groups:
        dtype, n = group[0].dtype, sum(p.numel() for p in group)
        flats.append(arena[dtype][used[dtype]:used[dtype] + n])
        used[dtype] += n
    return flats, arena


@dataclass
class _Bucket:
    params: list[torch.nn.Parameter]
    flat: torch.Tensor
    offsets: list[int]
    views: list[torch.Tensor] = field(default_factory=list)
    ready: int = 0            # gradients arrived since the last synchronize
    # per parameter, since the last synchronize: 0 (not yet) or SHARE_OF + the world size
    # by which its backward's loss was divided (0: not divided); one list for the bucket's
    # life (the hooks hold it), reset in place
    arrived: list[int] = field(default_factory=list)
    request: object = None    # a pending reduction (non-blocking progress); None when done
    # the last bucket (one hook, on its last parameter): 0 until that hook ran since the last
    # synchronize, then SHARE_OF + the world size its backward's loss was divided by
    seen: int = 0
    n: int = 0                # len(params)
    end: int = 0              # where it ends in its arena (elements)
    stream: "_Stream | None" = None   # its arena's stream, where calls follow the arena

    def reset(self) -> None:
        n = self.n = len(self.params)
        self.ready, self.request, self.seen = 0, None, 0
        self.arrived[:] = [0] * n


@dataclass
class _Stream:
    """One dtype's arena, reduced in calls of ``chunk`` elements regardless of where buckets
    end: a call is made once every bucket it covers is complete (buckets complete in arena
    order, as backward produces them; one that completes early waits for those before it).
    The calls are then those of a raw ``MPI_Allreduce`` of the arena in chunks."""

    flat: torch.Tensor
    buckets: list[_Bucket]
    chunk: int
    done: int = 0             # buckets complete, counted in order from the first
    sent: int = 0             # elements reduced
    call_s: float = 0.0       # seconds in this step's calls
    calibrated: int = 0       # the chunk chosen when the reducer was made
    tuner: "_Tuner | None" = None   # while steps try the candidate sizes
    sizes: list[int] = field(default_factory=list)   # the candidate sizes
    baseline: int = 0         # the size the trials must beat by TUNE_MARGIN
    watch: "_Watch | None" = None   # after the trials: whether the chosen size slows down
    # per size, the worst median of WATCH_STEPS steps in which the watch found it slow
    slow: dict[int, float] = field(default_factory=dict)
    # per round of trials, on this rank: each size's median and score, and the size agreed
    rounds: list[dict] = field(default_factory=list)
    host: "np.ndarray | None" = None   # ``flat`` as NumPy, for a transport's blocking_host

    def reset(self) -> None:
        self.done = self.sent = 0
        self.call_s = 0.0


class _Tuner:
    """Chooses a stream's call size during training: after :data:`TUNE_WARMUP` steps, the
    next ``TUNE_ROUNDS x len(sizes)`` steps use the candidate sizes in alternating order
    (A B C C B A ...), and each step's seconds are recorded (in the stream's calls; with a
    communication thread, the main thread's wait for gradients in that step). Then, on
    every rank (one ``agree``), rank 0's size with the least median, if that median is at
    least :data:`TUNE_MARGIN` below the median of the calibrated size; else the calibrated
    size. A size's median counts as at least its ``slow`` entry (the worst the watch saw of
    it). The schedule is a function of the step count alone, so every rank uses the same
    size at every step."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes
        order = [sizes if r % 2 == 0 else sizes[::-1] for r in range(TUNE_ROUNDS)]
        # per step, the size it uses; None: the warm-up steps keep the size they have
        self.schedule = [None] * TUNE_WARMUP + [n for round_ in order for n in round_]
        self.seconds: dict[int, list[float]] = {n: [] for n in sizes}
        self.step = 0

    def next_size(self, chunk: int, call_s: float) -> int | None:
        """The call size for the next step, given this step's ``chunk`` and its seconds;
        None once the trial steps are over (the caller agrees on :meth:`best`)."""
        if self.schedule[self.step] is not None:
            self.seconds[chunk].append(call_s)
        self.step += 1
        if self.step == len(self.schedule):
            return None
        return self.schedule[self.step] or chunk

    def median(self, n: int) -> float:
        """The median seconds of the steps that used size ``n``."""
        return _median(self.seconds[n])

    def score(self, n: int, slow: dict[int, float]) -> float:
        """Size ``n``'s median seconds, or its worst seen by the watch (``slow``) if longer."""
        return max(self.median(n), slow.get(n, 0.0))

    def best(self, calibrated: int, slow: dict[int, float] | None = None) -> int:
        """The size with the least :meth:`score`, if :data:`TUNE_MARGIN` below the
        calibrated size's; else the calibrated size."""
        slow = slow or {}
        fastest = min(self.sizes, key=lambda n: self.score(n, slow))
        if self.score(fastest, slow) < (1 - TUNE_MARGIN) * self.score(calibrated, slow):
            return fastest
        return calibrated


def _contenders(stream: _Stream, now: float) -> list[int]:
    """The sizes of ``stream``'s last round of trials whose score is within
    :data:`CONTENDER_FACTOR` of the least, the size in use (``stream.chunk``) scored at
    least ``now`` (its median while the watch found it slow) and always included; in the
    order of ``stream.sizes``."""
    scores = dict(stream.rounds[-1]["score_s"])
    scores[stream.chunk] = max(scores.get(stream.chunk, 0.0), now)
    least = min(scores.values())
    return [n for n in stream.sizes if n == stream.chunk
            or (n in scores and scores[n] <= CONTENDER_FACTOR * least)]


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2]


class _Watch:
    """After the trials, whether the chosen size has slowed down: ``expected`` is its score
    (:meth:`_Tuner.score`: its median in the trials, or the slowest the watch saw of it);
    :meth:`record` takes each step's seconds and, every
    :data:`WATCH_STEPS` steps, says whether their median exceeded ``expected`` by both
    :data:`RETUNE_FACTOR` and :data:`RETUNE_FLOOR_S`."""

    def __init__(self, expected: float) -> None:
        self.expected = expected
        self.seconds: list[float] = []
        self.last = 0.0   # the median of the last WATCH_STEPS steps

    def record(self, seconds: float) -> bool | None:
        """None until :data:`WATCH_STEPS` steps are in; then the verdict, and a new count."""
        self.seconds.append(seconds)
        if len(self.seconds) < WATCH_STEPS:
            return None
        now = self.last = _median(self.seconds)
        self.seconds = []
        return now > RETUNE_FACTOR * self.expected and now - self.expected > RETUNE_FLOOR_S


class _CommThread:
    """A thread that makes a reducer's blocking calls in the order they are handed to it
    (``thread`` progress), one piece (``make(piece)``: a call) at a time: backward goes on
    while earlier chunks are reduced. :meth:`take_over` stops it between two pieces and gives
    the main thread the pieces not yet made, so the calls that remain when backward ends are
    made there, without a hand-over per call. The two threads never call MPI at once and the
    order of the calls is the order handed over, so MPI needs ``MPI_THREAD_SERIALIZED`` only.
    A call that raised is raised again by :meth:`take_over`; the pieces after it are
    dropped."""

    def __init__(self, make) -> None:
        self._make = make
        self._pending: collections.deque = collections.deque()
        self._busy = False        # a piece is being made (outside the lock)
        self._held = False        # take_over() is waiting: start no other piece
        self._closing = False
        self._error: BaseException | None = None
        # pieces submitted since the last take_over (both run on the main thread only)
        self._handed = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="hpcai-allreduce", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        cond = self._cond
        while True:
            with cond:
                while (self._held or not self._pending) and not self._closing:
                    cond.wait()
                if self._closing:
                    return
                piece = self._pending.popleft()
                self._busy = True
            try:
                self._make(piece)
            except BaseException as exc:   # kept for take_over(): the main thread reports it
                with cond:
                    if self._error is None:
                        self._error = exc
                    self._pending.clear()
            finally:
                with cond:
                    self._busy = False
                    cond.notify_all()

    def submit(self, pieces) -> None:
        """Hand over ``pieces`` (each one MPI call), to be made in order."""
        self._handed = True
        with self._cond:
            self._pending.extend(pieces)
            self._cond.notify_all()

    def take_over(self) -> list:
        """Wait for the piece being made, if any, and return those not yet started, in order
        (the caller makes them); afterwards the thread is idle until the next submit.
        Nothing handed over since the last take-over: nothing to wait for, no lock taken."""
        if not self._handed:
            return []
        self._handed = False
        with self._cond:
            self._held = True
            while self._busy:
                self._cond.wait()
            rest = list(self._pending)
            self._pending.clear()
            self._held = False
            error, self._error = self._error, None
        if error is not None:
            raise error
        return rest

    def close(self) -> None:
        with self._cond:
            self._pending.clear()
            self._closing = True
            self._cond.notify_all()
        self._thread.join()


# Call sizes a stream tries on its arena when the reducer is made (rank 0's fastest is used
# by all ranks): which one is fastest differs between MPIs and even between launches of one
# MPI on one machine (bench/allreduce_bw.py, 2 ranks: Open MPI's ResNet50 set was fastest as
# 4 MB calls in three launches and as one call in a fourth; MPICH's as 16 MB calls in six of
# eight launches, 4 MB in two). The whole arena is always a candidate.
CALL_BYTES = (1 << 20, 4 << 20, 16 << 20, 64 << 20)
# With "hook" progress a stream's calls wait until backward has produced every gradient:
# blocking calls made from the hooks on backward's thread overlap nothing, and each pause
# between two runs of calls begins with the faster rank waiting for the slower one
# (bench/allreduce_bw.py, Intel MPI, ResNet50, 2 x 3 launches each on one AMD EPYC VM host:
# fused ÷ raw 0.953-0.996 with a run of calls once a quarter of the arena was complete,
# 0.976-1.020 with one run when backward ends).
CALIBRATION_ROUNDS = 3
# Blocking mode separates the wait for the slowest rank (load imbalance) from the transfer
# with a barrier before its calls, on every IMBALANCE_EVERY-th step only, each wait counted
# IMBALANCE_EVERY times: a barrier at every step cost one latency per step
# (bench/allreduce_bw.py, 3DGAN, 24 launches each on one AMD EPYC VM host: blocking ÷
# default time 1.017 on Intel MPI, 1.004-1.005 on MPICH and Open MPI, whose default makes
# the same calls without the barrier).
IMBALANCE_EVERY = 8
# The calibration's choice is a first guess: timed before training, on rank 0 alone, it
# missed the fastest size in launches where the machine's MPI ran slower than while it
# timed (bench/allreduce_bw.py, Open MPI, 2 ranks: 4 MB calls kept at about 30 ms per step
# where 16 MB calls took 13-19 ms). The training's own steps then try every candidate
# (_Tuner): after TUNE_WARMUP steps, TUNE_ROUNDS steps per size. A step's exchange is short
# and noisy (the 3DGAN's: 0.4-2 ms), so another size replaces the calibrated one only when
# its median is TUNE_MARGIN faster.
TUNE_WARMUP = 1
TUNE_ROUNDS = 5
TUNE_MARGIN = 0.05
# The chosen size can go slow later while another stays fast (the same Open MPI runs: in 5
# of 24 launches the size the first steps chose took 28-31 ms per exchange during the
# trials, where 16 MB calls took 13-17 ms). So after the trials every WATCH_STEPS steps
# rank 0 compares the median of those steps with the chosen size's score in the trials
# (_Watch); when it is RETUNE_FACTOR slower and RETUNE_FLOOR_S longer, every rank runs the
# trials again (one agree per WATCH_STEPS steps; the size in use is then the one to beat).
# A size can flip back and forth between a fast and a slow state (the same runs: a re-tune
# chose a size that was fast in the new trials and slow again later), so a size the watch
# found slow keeps that median as its score in every later trial where it is lower
# (_Stream.slow): later trials choose the size whose worst state seen is the least.
WATCH_STEPS = 16
RETUNE_FACTOR = 1.5
RETUNE_FLOOR_S = 1e-3
# Trials that run again try only the sizes that were contenders in the last round: a score
# within CONTENDER_FACTOR of the least, the slow median of the size in use counted. The
# first trials of every size ran inside a benchmark's measured steps when the watch fired
# (bench/allreduce_bw.py at 45c56cd, MPICH: 7 of 24 launches, each at 0.49-0.83 of raw;
# that file is in git history), and 64 MiB and whole-arena calls took 39-53 ms per step in
# every round where 1, 4 and 16 MiB calls took 12-33 ms. A size left out is not tried again in that
# reducer's life; where the size in use is the only contender, no trials run and the watch
# expects its slow median from then on.
CONTENDER_FACTOR = 1.5


# The world size by which the running backward's loss was divided (GradAllreducer.backward):
# the gradients it produces are already this rank's share of the mean.
_loss_divided_by = 0
# _Bucket.arrived holds SHARE_OF + _loss_divided_by for a gradient that arrived (never 0)
SHARE_OF = 1


def mpi_family() -> str:
    """``openmpi``, ``mpich``, ``intel`` or ``other``: the MPI library mpi4py loaded."""
    from mpi4py import MPI

    version = MPI.Get_library_version()
    for marker, family in (("Open MPI", "openmpi"), ("Intel", "intel"), ("MPICH", "mpich")):
        if marker in version:
            return family
    return "other"


# How each MPI family progresses a bucket's reduction: "hook" makes the blocking
# MPI_Allreduce calls on backward's thread once backward has produced every gradient, in one
# run (the last bucket's hook, or synchronize);
# "thread" hands the same calls to one communication thread (_CommThread) as soon as they
# are complete, so backward goes on while they run; the last bucket's hook takes over the
# calls the thread has not started (after the one it is making) and makes them and the
# remaining ones itself (nothing is left to overlap them with), with no hand-over per call;
# "nonblocking" starts an MPI_Iallreduce per bucket, pokes it with MPI_Testall at every later
# hook and waits in synchronize(). Chosen by bench/progress_modes.py (2 ranks x 1 core,
# ResNet50 at 112 px, batch 8, with THREAD_ENV set; 4 jobs per MPI, bench/results/
# progress_modes-vm-20261130T045714.json): "thread" cut the main thread's wait for gradients
# to 0.04-0.06 of "hook"'s on all three, and it is the default where it was also shown to
# cost no step time (step time thread / hook, whole interval <= 1.03):
# - Open MPI 4.1: 0.997 [0.964, 1.025]: "thread", with THREAD_ENV; without it 1.121
#   [0.987, 1.221] (progress_modes-vm-20261129T194510.json), so "hook" where it is off.
#   MPI_Iallreduce of 4 MB chunks took 35 ms for the set against 10 ms blocking
#   (allreduce_bw), so not "nonblocking";
# - MPICH 4.0: 1.047 [1.006, 1.096]; 1.090 [0.976, 1.131] and 0.999 [0.973, 1.018] in
#   earlier runs: "hook";
# - Intel MPI 2021: 1.019 [0.990, 1.043] with THREAD_ENV, 1.073 [1.058, 1.107] without
#   (progress_modes-vm-20261129T225740.json): "hook".
# With the huge-page arenas (progress_modes-vm-20261130T194831.json, ResNet50): MPICH 1.020
# [1.000, 1.078] and Intel MPI 1.012 [0.974, 1.062], both unresolved: still "hook".
# (In those runs "hook" made its calls during backward, each run once a quarter of the arena
# was complete; they now wait for backward's end, which no training run has compared yet.)
# With the last hook's take-over (progress_modes-vm-20261130T220330.json, 8 jobs, both
# models): Open MPI 0.997 [0.975, 1.016] (ResNet50) and 0.995 [0.964, 1.016] (3DGAN), both
# met: still "thread".
# "thread" falls back to "hook" below MPI_THREAD_SERIALIZED. "other" MPIs keep the
# non-blocking calls.
PROGRESS = {"openmpi": "thread", "mpich": "hook", "intel": "hook", "other": "nonblocking"}

# What a family's "thread" progress needs in the environment before MPI starts. The
# blocking calls of Open MPI and Intel MPI poll without pause, so their communication thread
# held the core that backward runs on; with these variables they give the core up between
# polls. Open MPI: mpi_yield_when_idle, on by default only when mpirun oversubscribes a node.
# Intel MPI: I_MPI_THREAD_YIELD, which its documentation does not describe; in
# progress_modes (ResNet50, 2 jobs each, not committed) step time thread / hook was 1.21
# without it, 1.01 with 3 and 1.00 with 2. ``train`` sets them (:func:`set_thread_env`)
# unless the user did; where a family's variable is off, its default is "hook".
THREAD_ENV = {"openmpi": ("OMPI_MCA_mpi_yield_when_idle", "1"),
              "intel": ("I_MPI_THREAD_YIELD", "2")}

_OFF = ("", "0", "false", "no", "off", "disable", "disabled")


def set_thread_env() -> None:
    """Set this process's :data:`THREAD_ENV` variables before MPI starts (the family is
    known only after); a value the user set is kept."""
    for key, value in THREAD_ENV.values():
        os.environ.setdefault(key, value)


def thread_env_on(family: str) -> bool:
    """Whether ``family``'s :data:`THREAD_ENV` variable is on in this process (what MPI read
    when it started): set, and not to 0, false, no, off or disable(d)."""
    if family not in THREAD_ENV:
        return True
    key, _ = THREAD_ENV[family]
    return os.environ.get(key, "").strip().lower() not in _OFF


def _replaced(bucket: _Bucket) -> bool:
    """Whether a gradient of ``bucket`` is not its view into the arena (replaced, or None):
    one read of every parameter's ``.grad``, the engine's largest own work for a model in
    one bucket (``bench/work_after_pass.py``)."""
    return any(map(operator.is_not, [p.grad for p in bucket.params], bucket.views))


class GradAllreducer:
    """Average the gradients of ``module``'s parameters across the transport's ranks.

    ``progress``: ``hook``, ``thread`` or ``nonblocking`` (see :data:`PROGRESS`); None picks
    the transport's (MPI: by family; gloo and Horovod progress on their own threads, so
    ``nonblocking``). ``thread`` needs a transport with ``threads`` true (MPI at
    ``MPI_THREAD_SERIALIZED`` or above), else it is ``hook``. Ignored with ``overlap=False``.

    With MPI on the CPU, blocking calls (``hook`` or ``thread`` progress, or
    ``overlap=False``) follow the
    arena, not the buckets (:class:`_Stream`): calls of ``call_mb``, or, when None, of the
    size that reduced this arena fastest when the reducer was made (:data:`CALL_BYTES`,
    tried :data:`CALIBRATION_ROUNDS` times each on every rank; rank 0's choice holds), and
    then of the size with which the first training steps spent the least time in their calls
    (with ``thread``: waited least on the main thread) (:class:`_Tuner`; :attr:`tuning` says
    whether they are still trying). Those steps run again when the chosen size slows down
    later (:class:`_Watch`; :attr:`retunes` counts how often), for the sizes that were
    contenders (:data:`CONTENDER_FACTOR`), and from then on that size counts as no faster
    than it was then. Making such a reducer, and
    each ``synchronize``, is then collective: every rank makes it.
    """

    def __init__(self, module: torch.nn.Module, transport, *,
                 bucket_mb: float = DEFAULT_BUCKET_MB, overlap: bool = True,
                 progress: str | None = None, call_mb: float | None = None) -> None:
        self.transport = transport
        self.size = transport.size
        self.overlap = overlap and self.size > 1
        self.progress = progress or getattr(transport, "progress", "nonblocking")
        if self.progress not in ("hook", "thread", "nonblocking"):
            raise ValueError("progress must be 'hook', 'thread' or 'nonblocking', "
                             f"not {self.progress!r}")
        if self.progress == "thread" and not getattr(transport, "threads", False):
            self.progress = "hook"   # MPI below MPI_THREAD_SERIALIZED, or no blocking calls
        self.stats = SyncStats()
        self.buckets, arenas = self._make_buckets(
            [p for p in module.parameters() if p.requires_grad], int(bucket_mb * 2**20))
        self.streams = self._streams(arenas, call_mb)
        self._thread = (_CommThread(self._piece) if self.overlap and self.progress == "thread"
                        and self.streams else None)
        # the last bucket completes when backward ends: synchronize reduces it (_close_tail)
        self._tail = self.buckets[-1] if self.size > 1 and self.buckets else None
        # a model in one bucket whose calls follow the arena: synchronize's short path
        self._solo = ((self.buckets[0], self.streams[0])
                      if len(self.buckets) == 1 and len(self.streams) == 1 else None)
        # the backward hooks, in bucket order (replay_backward calls them so): one per
        # parameter, but for the last bucket one on its last parameter
        self._hooks = [(p, self._hook(b, i, v)) for b in self.buckets if b is not self._tail
                       for i, (p, v) in enumerate(zip(b.params, b.views))]
        if self._tail is not None:
            self._hooks.append((self._tail.params[-1], self._tail_hook(self._tail)))
        self._hook_of = {id(p): hook for p, hook in self._hooks}
        self._pending: list = []
        self._accumulated = False
        self._divided = 0   # the world size, after backward() (replay_backward) divided a loss
        self._hook_wait = 0.0   # the main thread's seconds in this step's hooks
        self.retunes = 0   # how often the streams' trials ran again (_Watch)
        self._syncs = 0    # synchronize calls in blocking mode (_imbalance)
        self._handles = []
        if self.size > 1:
            self._handles = [p.register_post_accumulate_grad_hook(hook)
                             for p, hook in self._hooks]

    @staticmethod
    def _make_buckets(params: list[torch.nn.Parameter], limit: int
                      ) -> tuple[list[_Bucket], dict[torch.dtype, torch.Tensor]]:
        groups = plan_buckets([p.numel() * p.element_size() for p in params],
                              [p.dtype for p in params], limit)
        flats, arenas = _arenas([[params[i] for i in group] for group in groups])
        buckets = [GradAllreducer._bucket([params[i] for i in group], flat)
                   for group, flat in zip(groups, flats)]
        for bucket in buckets:
            arena = arenas[bucket.flat.dtype]
            bucket.end = (bucket.flat.storage_offset() - arena.storage_offset()
                          + bucket.flat.numel())
        return buckets, arenas

    def _streams(self, arenas: dict[torch.dtype, torch.Tensor],
                 call_mb: float | None) -> list[_Stream]:
        """The arenas whose calls follow the arena: MPI's blocking calls on the CPU."""
        if (self.size == 1 or not hasattr(self.transport, "agree")
                or (self.overlap and self.progress == "nonblocking")):
            return []
        streams = []
        for dtype, arena in arenas.items():
            if arena.device.type != "cpu" or arena.numel() == 0:
                continue
            mine = [b for b in self.buckets if b.flat.dtype == dtype]
            if call_mb:
                chunk, sizes = max(1, int(call_mb * 2**20) // arena.element_size()), []
            else:
                sizes = self._call_sizes(arena)
                chunk = self._calibrate(arena, sizes)
            chunk = min(chunk, arena.numel())
            stream = _Stream(arena, mine, chunk, calibrated=chunk,
                             tuner=_Tuner(sizes) if len(sizes) > 1 else None,
                             sizes=sizes, baseline=chunk,
                             host=arena.numpy() if hasattr(self.transport, "blocking_host")
                             else None)
            for bucket in mine:
                bucket.stream = stream
            streams.append(stream)
        return streams

    def _call_sizes(self, arena: torch.Tensor) -> list[int]:
        """Candidate elements per call, for every MPI family alike: :data:`CALL_BYTES` below
        the arena's size and the whole arena (which is fastest differs between hosts of one
        family: measured, never assumed)."""
        total, item = arena.numel(), arena.element_size()
        return [b // item for b in CALL_BYTES if b // item < total] + [total]

    def _calibrate(self, arena: torch.Tensor, sizes: list[int]) -> int:
        """Elements per call: of ``sizes``, the one that reduced ``arena`` fastest on rank 0
        (best of :data:`CALIBRATION_ROUNDS`, sizes in alternating order; a small arena is
        reduced several times per timing, to about 2 ms); the arena's contents are kept."""
        total = arena.numel()
        if len(sizes) == 1:
            return sizes[0]
        kept = arena.clone()

        def timed(n: int, repeat: int) -> float:
            self.transport.barrier()
            start = time.perf_counter()
            for _ in range(repeat):
                self.transport.blocking(arena, n)
            return (time.perf_counter() - start) / repeat

        once = timed(total, 1)
        repeat = self.transport.agree(max(1, min(32, round(2e-3 / max(once, 1e-6)))))
        best = dict.fromkeys(sizes, float("inf"))
        for round_ in range(CALIBRATION_ROUNDS):
            for n in (sizes if round_ % 2 == 0 else sizes[::-1]):
                best[n] = min(best[n], timed(n, repeat))
        arena.copy_(kept)
        return self.transport.agree(min(sizes, key=best.__getitem__))

    @staticmethod
    def _bucket(params: list[torch.nn.Parameter], flat: torch.Tensor) -> _Bucket:
        offsets, total = [], 0
        for p in params:
            offsets.append(total)
            total += p.numel()
        views = [_grad_view(flat, p, off) for p, off in zip(params, offsets)]
        for p, view in zip(params, views):
            if p.grad is not None:
                view.copy_(p.grad)
            p.grad = view   # backward accumulates straight into the bucket
        bucket = _Bucket(params=params, flat=flat, offsets=offsets, views=views)
        bucket.reset()
        return bucket

    def backward(self, loss: torch.Tensor, **kwargs) -> None:
        """``loss.backward(**kwargs)`` with the loss divided by the world size: backward then
        produces each rank's share of the mean directly and no pass divides the gradients."""
        global _loss_divided_by
        if self.size == 1:
            loss.backward(**kwargs)
            return
        outer, _loss_divided_by = _loss_divided_by, self.size
        try:
            (loss / self.size).backward(**kwargs)
        finally:
            _loss_divided_by = outer
        self._divided = self.size

    # -- the backward hook ----------------------------------------------------------------
    def _hook(self, bucket: _Bucket, i: int, view: torch.Tensor):
        """The backward hook of ``bucket``'s ``i``-th parameter, whose gradient lives in
        ``view``. It runs once per parameter and step, so it is a closure over what it needs
        (no lookup by parameter) and does a few comparisons and stores."""
        arrived, n = bucket.arrived, bucket.n
        poke = self.overlap and self.progress == "nonblocking"   # requests to poke

        def on_grad(param: torch.nn.Parameter) -> None:
            grad = param.grad
            if grad is not view and grad.data_ptr() != view.data_ptr():
                view.copy_(grad)   # replaced (zero_grad(set_to_none=True)): copied in once
                param.grad = view
            if arrived[i]:
                self._accumulated = True
                return
            arrived[i] = SHARE_OF + _loss_divided_by   # SHARE_OF + size: a share of the mean
            ready = bucket.ready + 1
            bucket.ready = ready
            if ready == n:
                self._complete(bucket)
            if poke and self._pending:
                self.transport.poke(self._pending)
        return on_grad

    def _tail_hook(self, bucket: _Bucket):
        """The last bucket's one hook: notes how its backward's loss was divided, and a second
        gradient before synchronize (accumulation)."""
        def on_grad(param: torch.nn.Parameter) -> None:
            if bucket.seen:
                self._accumulated = True
                return
            bucket.seen = SHARE_OF + _loss_divided_by
        return on_grad

    def _on_grad(self, param: torch.nn.Parameter) -> None:
        """What backward does when ``param``'s gradient is final: its hook, if it has one
        (the last bucket's parameters but its last have none)."""
        hook = self._hook_of.get(id(param))
        if hook is not None:
            hook(param)

    def _complete(self, bucket: _Bucket) -> None:
        """This rank's gradients of ``bucket`` are final: scale them to its share of the mean
        (while backward just wrote them; not those that arrived from a loss divided by the
        world size: already a share) and, overlapping with a communication thread or
        non-blocking calls, start reducing them now."""
        start = time.perf_counter()
        share = SHARE_OF + self.size
        shares = bucket.arrived.count(share)
        if shares == 0:
            bucket.flat.div_(self.size)
        elif shares < bucket.n:   # some came from a divided loss
            for view, how in zip(bucket.views, bucket.arrived):
                if how != share:
                    view.div_(self.size)
        if self.overlap:
            if bucket.stream is None:
                self._reduce(bucket)
            elif self._thread is not None:   # ("hook" makes no call here: synchronize does)
                self._advance(bucket.stream, final=False)
        took = time.perf_counter() - start
        self.stats.wait_s += took   # the main thread's, in backward
        self._hook_wait += took

    def _advance(self, stream: _Stream, final: bool) -> None:
        """Reduce the stream's complete chunks: those its complete leading buckets cover
        (``final``, or once every bucket is complete: also the last, shorter one, so that
        the backward's last hook makes all the remaining calls at once)."""
        buckets = stream.buckets
        while stream.done < len(buckets) and buckets[stream.done].ready == buckets[stream.done].n:
            stream.done += 1
        upto = buckets[stream.done - 1].end if stream.done else 0
        chunk, sent = stream.chunk, stream.sent
        last = final or stream.done == len(buckets)   # no later hook will make a call
        if last:
            end = upto
        else:
            end = sent + (upto - sent) // chunk * chunk
        if end > sent:   # every complete call at once: the transport loops over them
            if self._thread is not None and not last:
                self._thread.submit([(stream, lo, min(lo + chunk, end), chunk)
                                     for lo in range(sent, end, chunk)])
            else:   # synchronize's calls, and the last bucket's (nothing is left to overlap
                # them with): the main thread makes them, after the thread's, without a
                # hand-over; first those handed to the thread that it had not started
                rest = self._take_over() if self._thread is not None else []
                self._make_here([*rest, (stream, sent, end, chunk)])
            self.stats.allreduces += -(-(end - sent) // chunk)
            self.stats.bytes += (end - sent) * stream.flat.element_size()
            stream.sent = end

    def _take_over(self) -> list[tuple]:
        """The comm thread's pieces that it has not started, once the one it is making is
        done (the caller makes them); a call that failed fails this step."""
        try:
            return self._thread.take_over()
        except BaseException:
            self._reset()
            raise

    def _make_here(self, pieces: list[tuple]) -> None:
        """Make ``pieces`` on this thread, in order (:meth:`_merged`); a call that failed
        fails this step, and the next one starts whole."""
        try:
            for piece in self._merged(pieces):
                self._piece(piece)
        except BaseException:
            self._reset()
            raise

    def _merged(self, pieces: list[tuple]) -> list[tuple]:
        """``pieces`` with consecutive ones of a stream joined (same stream and call size,
        contiguous: the calls stay the same): one transport call, with no Python between its
        MPI calls but the loop's, for several."""
        if len(pieces) < 2:
            return pieces
        out: list[tuple] = []
        for stream, lo, hi, chunk in pieces:
            if out and out[-1][0] is stream and out[-1][2] == lo and out[-1][3] == chunk:
                out[-1] = (stream, out[-1][1], hi, chunk)
            else:
                out.append((stream, lo, hi, chunk))
        return out

    def _piece(self, piece: tuple) -> None:
        self._call(*piece)

    def _call(self, stream: _Stream, sent: int, end: int, chunk: int) -> None:
        """The blocking calls for ``stream.flat[sent:end]`` (on the comm thread, if any)."""
        start = time.perf_counter()
        if stream.host is not None:   # the whole arena without a new view
            host = stream.host
            self.transport.blocking_host(host if end - sent == host.size else host[sent:end],
                                         chunk)
        else:
            self.transport.blocking(stream.flat[sent:end], chunk)
        stream.call_s += time.perf_counter() - start

    def _reduce(self, bucket: _Bucket) -> None:
        self.stats.allreduces += 1
        self.stats.bytes += bucket.flat.numel() * bucket.flat.element_size()
        if self.overlap and self.progress == "nonblocking":
            bucket.request = self.transport.start(bucket.flat)
            self._pending.append(bucket.request)
        else:
            self.transport.blocking(bucket.flat)

    def _close_tail(self, bucket: _Bucket) -> None:
        """The last bucket after backward: every gradient in its view (:meth:`_pack`, where
        one was replaced or is None), each counted as a share of the mean if its backward's
        loss was divided (as the bucket's hook saw it; if that parameter got no gradient,
        as :meth:`backward` left it), then :meth:`_complete`."""
        if _replaced(bucket):
            self._pack(bucket)
        divided = bucket.seen - SHARE_OF if bucket.seen else self._divided
        bucket.arrived[:] = [SHARE_OF + divided] * bucket.n
        bucket.ready = bucket.n
        self._complete(bucket)

    def _pack(self, bucket: _Bucket) -> None:
        """A bucket backward did not complete (unused parameters, or no backward at all):
        make every gradient live in its view (None counts as zero)."""
        for p, view in zip(bucket.params, bucket.views):
            grad = p.grad
            if grad is None:
                view.zero_()
            elif grad is not view and grad.data_ptr() != view.data_ptr():
                view.copy_(grad)
            else:
                continue
            p.grad = view

    def replay_backward(self, loss_divided: bool = True) -> None:
        """Call the backward hook of every parameter in bucket order, as a backward would
        (benchmarks: the exchange without the compute); ``loss_divided``: as one whose loss
        :meth:`backward` divided."""
        global _loss_divided_by
        outer, _loss_divided_by = _loss_divided_by, self.size if loss_divided else 0
        try:
            for p, hook in self._hooks:
                hook(p)
        finally:
            _loss_divided_by = outer
        self._divided = self.size if loss_divided else 0

    def synchronize(self) -> None:
        """Finish averaging; afterwards every rank holds the same mean gradients."""
        if self.size == 1:
            return
        start, before, in_hooks = time.perf_counter(), self.stats.wait_s, self._hook_wait
        if self._accumulated:
            self._reset()
            raise RuntimeError(
                "a parameter got a second gradient before synchronize(): call synchronize() "
                "after every backward (gradient accumulation is not supported)")
        if self._solo is not None:
            self._synchronize_solo(start, before)
            return
        if self._tail is not None:
            self._close_tail(self._tail)
        for bucket in self.buckets:
            if bucket.ready < len(bucket.params):   # never completed: pack, scale, reduce
                self._pack(bucket)
                bucket.ready = len(bucket.params)
                self._complete(bucket)
        if self._pending:
            self.transport.wait_all(self._pending)
        elif not self.overlap:
            self._imbalance()
            for bucket in self.buckets:
                if bucket.stream is None:
                    self._reduce(bucket)
        if self._thread is not None:   # its calls come before the last ones, made here
            self._make_here(self._take_over())
        for stream in self.streams:
            if stream.sent < stream.flat.numel():   # else the last hook made every call
                self._advance(stream, final=True)
        # what a stream's tuner compares: with a comm thread, the main thread's wait in this
        # step (a size that overlaps more can take longer in its calls and still wait less);
        # else the seconds in the stream's calls
        exposed = in_hooks + time.perf_counter() - start
        for stream in self.streams:
            seconds = exposed if self._thread is not None else stream.call_s
            if stream.tuner is not None:
                self._tune(stream, seconds)
            elif stream.watch is not None:
                self._watch(stream, seconds)
        self._reset()
        self.stats.wait_s = before + time.perf_counter() - start   # _complete's included

    def _imbalance(self) -> None:
        """Blocking mode, before its calls: on every :data:`IMBALANCE_EVERY`-th
        synchronize (the first included; the count is the same on every rank), a barrier,
        whose wait for the slowest rank counts :data:`IMBALANCE_EVERY` times in
        ``stats.imbalance_s`` (an estimate of the whole wait)."""
        self._syncs += 1
        if (self._syncs - 1) % IMBALANCE_EVERY:
            return
        arrived = time.perf_counter()
        self.transport.barrier()   # separates load imbalance from transfer time
        self.stats.imbalance_s += IMBALANCE_EVERY * (time.perf_counter() - arrived)

    def _synchronize_solo(self, start: float, before: float) -> None:
        """:meth:`synchronize` for a model in one bucket, reduced as a stream: no hook made a
        call, so what the general path does in a dozen calls is done here in a few: the
        gradients into the arena (:meth:`_pack`, where one was replaced or is None), this
        rank's share (divided unless backward's loss was, :meth:`_close_tail`), in blocking
        mode the barrier, the calls, and the call size's bookkeeping."""
        bucket, stream = self._solo
        if _replaced(bucket):
            self._pack(bucket)
        if (bucket.seen - SHARE_OF if bucket.seen else self._divided) != self.size:
            bucket.flat.div_(self.size)
        if not self.overlap:
            self._imbalance()
        chunk, n = stream.chunk, stream.flat.numel()
        bucket.ready = bucket.n
        called = time.perf_counter()
        try:
            if stream.host is not None:
                self.transport.blocking_host(stream.host, chunk)
            else:
                self.transport.blocking(stream.flat, chunk)
        except BaseException:
            self._reset()
            raise
        now = time.perf_counter()
        self.stats.allreduces += -(-n // chunk)
        self.stats.bytes += n * stream.flat.element_size()
        seconds = now - start if self._thread is not None else now - called
        if stream.tuner is not None:
            self._tune(stream, seconds)
        elif stream.watch is not None:
            self._watch(stream, seconds)
        bucket.seen = bucket.ready = 0
        self._divided = 0
        self.stats.wait_s = before + time.perf_counter() - start

    def _tune(self, stream: _Stream, seconds: float) -> None:
        """Record this step's ``seconds``; set the next step's call size (:class:`_Tuner`)."""
        tuner = stream.tuner
        chunk = tuner.next_size(stream.chunk, seconds)
        if chunk is None:   # the trials are over: rank 0's fastest, on every rank
            chunk = self.transport.agree(tuner.best(stream.baseline, stream.slow))
            stream.tuner, stream.watch = None, _Watch(tuner.score(chunk, stream.slow))
            stream.rounds.append({"median_s": {n: tuner.median(n) for n in tuner.sizes},
                                  "score_s": {n: tuner.score(n, stream.slow)
                                              for n in tuner.sizes}, "chose": chunk})
        stream.chunk = chunk

    def _watch(self, stream: _Stream, seconds: float) -> None:
        """Record this step's ``seconds``; every :data:`WATCH_STEPS` steps, rank 0's verdict
        on every rank (:class:`_Watch`): if the size in use slowed down, remember how slow
        (``stream.slow``, rank 0's counts) and try the contenders again
        (:func:`_contenders`), or, where it is the only one, only expect it that slow."""
        watch = stream.watch
        slow = watch.record(seconds)
        if slow is None:
            return
        # one agree per verdict: rank 0's contenders when its watch fired, else None
        sizes = self.transport.agree(_contenders(stream, watch.last) if slow else None)
        if sizes is None:
            return
        stream.slow[stream.chunk] = max(stream.slow.get(stream.chunk, 0.0), watch.last)
        if sizes == [stream.chunk]:   # still the least slow: no trials, a new expectation
            stream.watch = _Watch(stream.slow[stream.chunk])
            return
        stream.tuner, stream.watch, stream.baseline = _Tuner(sizes), None, stream.chunk
        self.retunes += 1

    @property
    def tuning(self) -> bool:
        """Whether a stream's call size is being chosen (the first steps, and again after the
        size in use slowed down: :class:`_Watch`)."""
        return any(stream.tuner is not None for stream in self.streams)

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        for stream in self.streams:
            stream.reset()
        self._pending = []
        self._accumulated = False
        self._divided = 0
        self._hook_wait = 0.0

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._thread is not None:
            self._thread.close()
            self._thread = None


class HorovodTransport:
    """Horovod's allreduce as the transport (only when ``horovod.torch`` imports).

    Horovod 0.28.1 is built from its patched sdist by ``scripts/build-horovod.sh`` (README);
    ``--comm horovod`` without it is a user error. Horovod does its own fusion too; handing it
    hpcai's buckets keeps the comparison about the transport.
    """

    name = "horovod"
    progress = "nonblocking"   # Horovod's background thread progresses the work

    def __init__(self, comm=None) -> None:
        import horovod.torch as hvd

        if not hvd.is_initialized():
            hvd.init()
        if comm is not None:
            check_horovod_world(hvd, comm)
        self._hvd = hvd
        self.size = hvd.size()

    def start(self, flat: torch.Tensor):
        return self._hvd.allreduce_async_(flat, op=self._hvd.Sum)

    def blocking(self, flat: torch.Tensor) -> None:
        self._hvd.synchronize(self.start(flat))

    def wait_all(self, handles) -> None:
        for handle in handles:
            self._hvd.synchronize(handle)

    def barrier(self) -> None:
        self._hvd.allreduce(torch.zeros(1), name="hpcai.barrier")

    def poke(self, handles) -> None:
        pass
