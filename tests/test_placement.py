"""Placement planner: CPU sets per local rank, threads, oversubscription."""

from __future__ import annotations

import pytest

from hpcai.core.errors import UserError
from hpcai.launcher.node.placement import plan_placement, thread_env
from hpcai.launcher.node.topology import synthetic

SNG = synthetic("pack:2 numa:2 core:12 pu:2")   # SuperMUC-NG: 2 x Xeon 8174, 48 cores
FOUR_NUMA = synthetic("pack:1 numa:4 core:4")


def test_supermuc_ng_four_ranks_one_per_numa_quarter():
    p = plan_placement(SNG, ranks_per_node=4)
    assert p.layout == "per-numa" and p.threads_per_rank == 12
    assert [s.numa for s in p.slots] == [(0,), (1,), (2,), (3,)]
    assert [s.cpulist for s in p.slots] == ["0-11", "12-23", "24-35", "36-47"]
    assert [s.sockets for s in p.slots] == [(0,), (0,), (1,), (1,)]


def test_supermuc_ng_hyperthreads_use_sibling_threads():
    p = plan_placement(SNG, ranks_per_node=4, hyperthreads=True)
    assert p.threads_per_rank == 24
    assert p.slots[0].cpulist == "0-11,48-59"


def test_supermuc_ng_one_rank_spans_the_node_two_ranks_a_socket():
    one = plan_placement(SNG, ranks_per_node=1)
    assert one.slots[0].numa == (0, 1, 2, 3) and one.threads_per_rank == 48
    two = plan_placement(SNG, ranks_per_node=2)
    assert two.layout == "spanning"
    assert [s.cpulist for s in two.slots] == ["0-23", "24-47"]
    assert [s.sockets for s in two.slots] == [(0,), (1,)]


def test_ranks_per_numa_and_explicit_threads():
    p = plan_placement(FOUR_NUMA, ranks_per_numa=2, threads_per_rank=1)
    assert p.ranks_per_node == 8
    assert [s.cpulist for s in p.slots] == ["0", "2", "4", "6", "8", "10", "12", "14"]
    with pytest.raises(UserError, match="contradicts"):
        plan_placement(FOUR_NUMA, ranks_per_numa=2, ranks_per_node=4)


def test_uneven_ranks_fall_back_to_flat_blocks():
    p = plan_placement(FOUR_NUMA, ranks_per_node=3)
    assert p.layout == "flat" and p.cores_per_rank == 5
    assert [s.cpulist for s in p.slots] == ["0-4", "5-9", "10-14"]
    assert p.slots[0].numa == (0, 1)


def test_oversubscription_is_an_error_unless_asked():
    with pytest.raises(UserError) as err:
        plan_placement(SNG, ranks_per_node=4, threads_per_rank=13)
    assert "52 cores" in err.value.message and "--oversubscribe" in err.value.hint
    p = plan_placement(SNG, ranks_per_node=4, threads_per_rank=13, oversubscribe=True)
    assert p.oversubscribed and p.slots[0].threads == 13
    many = plan_placement(synthetic("core:2"), ranks_per_node=4, oversubscribe=True)
    assert [s.cpulist for s in many.slots] == ["0", "1", "0", "1"]


@pytest.mark.parametrize("kwargs,match", [
    ({"ranks_per_node": 1, "threads_per_rank": 0}, "threads-per-rank"),
    ({"ranks_per_node": 0}, "ranks-per-node"),
    ({"ranks_per_numa": -1}, "ranks-per-numa"),
])
def test_nonsense_counts_are_rejected(kwargs, match):
    with pytest.raises(UserError, match=match):
        plan_placement(SNG, **kwargs)


def test_thread_env_names_every_runtime():
    slot = plan_placement(SNG, ranks_per_node=4).slots[2]
    env = thread_env(slot, hyperthreads=False)
    assert env["OMP_NUM_THREADS"] == "12" and env["MKL_NUM_THREADS"] == "12"
    assert env["OMP_PLACES"] == "cores" and env["OMP_PROC_BIND"] == "close"
    assert env["KMP_AFFINITY"].startswith("granularity=fine") and env["KMP_BLOCKTIME"] == "1"
    assert env["HPCAI_INTRA_OP_THREADS"] == "12" and env["HPCAI_CPUS"] == "24-35"
