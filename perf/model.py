"""The performance model of synchronous data-parallel training: pure arithmetic, no I/O.

Every parameter comes from a measurement (``hpcai-launch tune``) or a site profile; the
model adds no constants of its own except the algorithm-selection threshold it states
(:data:`RECURSIVE_DOUBLING_MAX_BYTES`).

- **Compute** (:class:`ComputeFit`): seconds per sample on one rank with ``T`` threads while
  ``r`` ranks share the node, ``(serial + parallel / T) * (1 + contention * (r - 1))``
  (Amdahl in threads, a linear slowdown per neighbour rank for shared memory bandwidth and
  caches), times ``max(1, busy threads / cores)`` when the host is oversubscribed.
- **Communication** (:class:`LinkCost`, :func:`allreduce`): the alpha-beta cost of one
  allreduce of ``n`` bytes over ``p`` ranks with the algorithm the MPI picks at that size:
  recursive doubling ``ceil(log2 p) * (alpha + n beta)`` up to
  :data:`RECURSIVE_DOUBLING_MAX_BYTES`, ring ``2 (p-1) alpha + 2 n (p-1)/p beta`` above it,
  and, with several ranks per node on several nodes, hierarchical: a binomial reduce to one
  leader per node over shared memory, the leaders' allreduce over the network (same rule),
  a binomial broadcast back. ``beta`` includes the local reduction (it is fitted from
  allreduce times, :func:`fit_link`).
- **Step** (:func:`predict_step`): compute of the per-rank batch plus every gradient bucket's
  allreduce, not overlapped (the engine starts buckets during backward, but the MPI makes
  little progress without a progress thread; the model is the upper bound).
- **Weak scaling** (:func:`weak_efficiency`): the per-rank batch is fixed, so the ideal step
  time is constant and efficiency is ``step(n0) / step(n)``.
- **Memory** (:func:`fits_memory`): ranks x bytes per rank against the node's memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

# Open MPI's classic tuned decision (coll_tuned, fixed rules): recursive doubling for
# allreduce blocks below 10 000 bytes, ring above. MPICH's default switches at 2 KiB to
# Rabenseifner, whose alpha-beta cost for large n equals the ring's bandwidth term.
RECURSIVE_DOUBLING_MAX_BYTES = 10_000
ALGORITHMS = ("none", "recursive doubling", "ring", "hierarchical")


@dataclass(frozen=True)
class ComputeSample:
    """One measured layout: seconds per sample per rank with ``threads`` threads while
    ``ranks`` ranks share the node."""

    ranks: int
    threads: int
    s_per_sample: float


@dataclass(frozen=True)
class ComputeFit:
    """Seconds per sample per rank: ``(serial + parallel / T) * (1 + contention * (r-1))``."""

    serial_s: float
    parallel_s: float
    contention: float

    def s_per_sample(self, threads: int, ranks: int, *, cores: int | None = None) -> float:
        """Per rank, ``threads`` threads, ``ranks`` ranks on a node of ``cores`` cores
        (None: not oversubscribed)."""
        base = (self.serial_s + self.parallel_s / threads) * (1 + self.contention * (ranks - 1))
        return base * oversubscription(ranks * threads, cores)

    @classmethod
    def fit(cls, samples: Sequence[ComputeSample]) -> "ComputeFit":
        """Least squares of ``serial + parallel / T`` over the one-rank samples (one thread
        count only: all of it counted as parallel; ``parallel`` < 0 when more threads were
        measured slower, as on a busy node), then the mean contention implied by each
        sample with more ranks. ValueError without a one-rank sample."""
        single = [s for s in samples if s.ranks == 1]
        if not single:
            raise ValueError("no one-rank measurement to fit the compute model to")
        xs = [1.0 / s.threads for s in single]
        ys = [s.s_per_sample for s in single]
        if len(set(xs)) < 2:
            serial, parallel = 0.0, sum(y / x for x, y in zip(xs, ys)) / len(xs)
        else:
            serial, parallel = _least_squares(xs, ys)
            if serial < 0:         # faster than linear: a line through the origin instead
                serial = 0.0
                parallel = sum(x * y for x, y in zip(xs, ys)) / sum(x * x for x in xs)
        shared = [s for s in samples if s.ranks > 1]
        contention = 0.0
        if shared:
            slowdowns = [(s.s_per_sample / (serial + parallel / s.threads) - 1) / (s.ranks - 1)
                         for s in shared]
            contention = sum(slowdowns) / len(slowdowns)
        return cls(serial, parallel, contention)


def oversubscription(busy_threads: int, cores: int | None) -> float:
    """Slowdown when more threads are busy than there are cores: ``busy / cores``, >= 1."""
    if cores is None or busy_threads <= cores:
        return 1.0
    return busy_threads / cores


def _least_squares(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (xs, ys); >= 2 distinct xs."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


@dataclass(frozen=True)
class LinkCost:
    """Alpha-beta parameters of one transport: seconds per message, seconds per byte."""

    alpha_s: float
    beta_s_per_byte: float

    @property
    def bandwidth_bytes_s(self) -> float:
        return math.inf if self.beta_s_per_byte == 0 else 1 / self.beta_s_per_byte

    @classmethod
    def from_spec(cls, latency_s: float, bandwidth_bytes_s: float) -> "LinkCost":
        return cls(latency_s, 1.0 / bandwidth_bytes_s)


@dataclass(frozen=True)
class AllreduceSample:
    """One measured allreduce: ``nbytes`` over ``ranks`` ranks (one node, one transport)."""

    ranks: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class AllreduceCost:
    seconds: float
    algorithm: str


def flat_coefficients(nbytes: float, ranks: int) -> tuple[float, float, str]:
    """(alpha count, beta bytes, algorithm) of one allreduce among ``ranks`` ranks of one
    transport, with the algorithm the MPI picks at this size."""
    if ranks <= 1:
        return 0.0, 0.0, "none"
    if nbytes <= RECURSIVE_DOUBLING_MAX_BYTES:
        steps = math.ceil(math.log2(ranks))
        return float(steps), steps * nbytes, "recursive doubling"
    return 2.0 * (ranks - 1), 2.0 * nbytes * (ranks - 1) / ranks, "ring"


def _tree(nbytes: float, ranks: int, link: LinkCost) -> float:
    """A binomial-tree reduce or broadcast: ``ceil(log2 p) * (alpha + n beta)``."""
    if ranks <= 1:
        return 0.0
    return math.ceil(math.log2(ranks)) * (link.alpha_s + nbytes * link.beta_s_per_byte)


def allreduce(nbytes: float, nodes: int, ranks_per_node: int, shm: LinkCost,
              net: LinkCost) -> AllreduceCost:
    """One allreduce of ``nbytes`` over ``nodes`` x ``ranks_per_node`` ranks."""
    if nodes == 1:
        a, b, name = flat_coefficients(nbytes, ranks_per_node)
        return AllreduceCost(a * shm.alpha_s + b * shm.beta_s_per_byte, name)
    a, b, inner = flat_coefficients(nbytes, nodes)
    between = a * net.alpha_s + b * net.beta_s_per_byte
    if ranks_per_node == 1:
        return AllreduceCost(between, inner)
    local = 2 * _tree(nbytes, ranks_per_node, shm)
    return AllreduceCost(local + between, f"hierarchical (shared-memory trees + {inner})")


def fit_link(samples: Sequence[AllreduceSample]) -> LinkCost:
    """Alpha and beta by least squares through :func:`flat_coefficients`: each measured
    time is ``a * alpha + b * beta`` with the algorithm's (a, b). Residuals are relative
    (each row divided by its time), so the small sizes set alpha and the large ones beta
    instead of the largest time deciding both. Negative results (noise) are clamped to 0 and
    the other parameter refitted alone. ValueError with fewer than two distinct multi-rank
    samples."""
    rows = []
    for s in samples:
        if s.ranks > 1 and s.seconds > 0:
            a, b, _ = flat_coefficients(s.nbytes, s.ranks)
            rows.append((a / s.seconds, b / s.seconds, 1.0))
    if len({(a, b) for a, b, _ in rows}) < 2:
        raise ValueError("need allreduce times at two or more sizes, on two or more ranks")
    saa = sum(a * a for a, _, _ in rows)
    sbb = sum(b * b for _, b, _ in rows)
    sab = sum(a * b for a, b, _ in rows)
    say = sum(a * y for a, _, y in rows)
    sby = sum(b * y for _, b, y in rows)
    det = saa * sbb - sab * sab
    alpha = (say * sbb - sby * sab) / det
    beta = (saa * sby - sab * say) / det
    if alpha < 0:
        alpha, beta = 0.0, sby / sbb
    elif beta < 0:
        alpha, beta = say / saa, 0.0
    return LinkCost(alpha, beta)


@dataclass(frozen=True)
class StepPrediction:
    nodes: int
    ranks_per_node: int
    threads_per_rank: int
    compute_s: float
    comm_s: float
    algorithm: str

    @property
    def step_s(self) -> float:
        return self.compute_s + self.comm_s

    @property
    def bound(self) -> str:
        return "communication-bound" if self.comm_s > self.compute_s else "compute-bound"


def predict_step(s_per_sample: float, batch_per_rank: int, buckets: Sequence[float],
                 nodes: int, ranks_per_node: int, threads_per_rank: int, shm: LinkCost,
                 net: LinkCost) -> StepPrediction:
    """One training step: the batch's compute plus one allreduce per gradient bucket
    (``buckets``: bytes of each allreduce the step makes)."""
    costs = [allreduce(n, nodes, ranks_per_node, shm, net) for n in buckets]
    names = sorted({c.algorithm for c in costs if c.algorithm != "none"})
    return StepPrediction(nodes, ranks_per_node, threads_per_rank,
                          compute_s=s_per_sample * batch_per_rank,
                          comm_s=sum(c.seconds for c in costs),
                          algorithm=", ".join(names) or "none")


def samples_per_s_per_node(step: StepPrediction, batch_per_rank: int) -> float:
    return step.ranks_per_node * batch_per_rank / step.step_s


def weak_efficiency(base: StepPrediction, step: StepPrediction) -> float:
    """Weak scaling (per-rank batch fixed): the ideal step time does not change."""
    return base.step_s / step.step_s


def fits_memory(bytes_per_rank: float, ranks_per_node: int, node_bytes: float) -> bool:
    return bytes_per_rank * ranks_per_node <= node_bytes
