"""hpcai.perf.model on synthetic inputs whose answer is known in closed form."""

from __future__ import annotations

import math

import pytest

from hpcai.perf.model import (RECURSIVE_DOUBLING_MAX_BYTES, AllreduceSample, ComputeFit,
                              ComputeSample, LinkCost, allreduce, fit_link, fits_memory,
                              oversubscription, predict_step, samples_per_s_per_node,
                              weak_efficiency)

SHM = LinkCost(alpha_s=1e-6, beta_s_per_byte=1e-10)     # 10 GB/s
NET = LinkCost(alpha_s=2e-6, beta_s_per_byte=8e-11)     # 12.5 GB/s


def test_compute_fit_recovers_amdahl_and_contention_exactly():
    serial, parallel, contention = 0.002, 0.030, 0.1
    truth = ComputeFit(serial, parallel, contention)
    samples = [ComputeSample(r, t, truth.s_per_sample(t, r))
               for r, t in ((1, 1), (1, 2), (1, 4), (2, 2), (4, 1))]
    fit = ComputeFit.fit(samples)
    assert fit.serial_s == pytest.approx(serial)
    assert fit.parallel_s == pytest.approx(parallel)
    assert fit.contention == pytest.approx(contention)
    # 4 ranks x 3 threads: (0.002 + 0.010) * (1 + 0.3)
    assert fit.s_per_sample(3, 4) == pytest.approx(0.012 * 1.3)


def test_compute_one_thread_count_is_all_parallel_and_oversubscription_scales():
    fit = ComputeFit.fit([ComputeSample(1, 2, 0.5)])
    assert (fit.serial_s, fit.parallel_s, fit.contention) == (0.0, 1.0, 0.0)
    assert fit.s_per_sample(1, 4, cores=2) == pytest.approx(1.0 * 2)   # 4 busy on 2 cores
    assert oversubscription(3, 4) == 1.0 and oversubscription(6, 4) == 1.5
    with pytest.raises(ValueError, match="one-rank"):
        ComputeFit.fit([ComputeSample(2, 1, 0.5)])


def test_allreduce_algorithms_in_closed_form():
    big, small = 4 * 2**20, 1024
    assert allreduce(big, 1, 1, SHM, NET).seconds == 0.0
    ring = allreduce(big, 1, 4, SHM, NET)
    assert ring.algorithm == "ring"
    assert ring.seconds == pytest.approx(2 * 3 * 1e-6 + 2 * big * 3 / 4 * 1e-10)
    rd = allreduce(small, 1, 5, SHM, NET)          # ceil(log2 5) = 3 rounds
    assert rd.algorithm == "recursive doubling"
    assert rd.seconds == pytest.approx(3 * (1e-6 + small * 1e-10))
    assert allreduce(RECURSIVE_DOUBLING_MAX_BYTES + 1, 1, 2, SHM, NET).algorithm == "ring"
    flat = allreduce(big, 8, 1, SHM, NET)           # one rank per node: network ring
    assert flat.seconds == pytest.approx(2 * 7 * 2e-6 + 2 * big * 7 / 8 * 8e-11)
    hier = allreduce(big, 8, 4, SHM, NET)           # 2 trees of log2(4)=2 levels + ring
    assert hier.algorithm == "hierarchical (shared-memory trees + ring)"
    assert hier.seconds == pytest.approx(2 * 2 * (1e-6 + big * 1e-10) + flat.seconds)


def test_fit_link_inverts_the_algorithm_rule():
    truth = LinkCost(5e-6, 2e-10)
    samples = [AllreduceSample(p, n, allreduce(n, 1, p, truth, truth).seconds)
               for p in (2, 4) for n in (256, 4096, 65536, 2**20, 4 * 2**20)]
    fit = fit_link(samples)
    assert fit.alpha_s == pytest.approx(5e-6)
    assert fit.beta_s_per_byte == pytest.approx(2e-10)
    assert fit.bandwidth_bytes_s == pytest.approx(5e9)
    with pytest.raises(ValueError, match="two or more sizes"):
        fit_link([AllreduceSample(2, 1024, 1e-5), AllreduceSample(1, 4096, 0.0)])


def test_step_efficiency_throughput_and_memory():
    buckets = [4 * 2**20, 300_000]
    one = predict_step(0.01, 16, buckets, 1, 1, 4, SHM, NET)
    assert one.comm_s == 0.0 and one.step_s == pytest.approx(0.16)
    four = predict_step(0.01, 16, buckets, 4, 1, 4, SHM, NET)
    comm = sum(2 * 3 * 2e-6 + 2 * n * 3 / 4 * 8e-11 for n in buckets)
    assert four.comm_s == pytest.approx(comm) and four.algorithm == "ring"
    assert weak_efficiency(one, four) == pytest.approx(0.16 / (0.16 + comm))
    assert samples_per_s_per_node(four, 16) == pytest.approx(16 / (0.16 + comm))
    assert four.bound == "compute-bound"
    slow = predict_step(1e-9, 1, buckets, 4, 1, 1, SHM, NET)
    assert slow.bound == "communication-bound"
    assert fits_memory(1e9, 4, 4e9) and not fits_memory(1e9, 5, 4e9)
    assert math.isclose(LinkCost.from_spec(1e-6, 12.5e9).beta_s_per_byte, 8e-11)
