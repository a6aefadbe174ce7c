"""Gradient arenas on transparent huge pages (training/hostmem.py)."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from hpcai.training.allreduce import _arenas
from hpcai.training.hostmem import HUGE_PAGE, huge_zeros

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib(address: int) -> int:
    """AnonHugePages of the mapping that holds ``address`` in this process (kB)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        span = re.match(r"([0-9a-f]+)-([0-9a-f]+) ", line)
        if span:
            inside = int(span[1], 16) <= address < int(span[2], 16)
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError(f"{address:#x} is in no mapping")


def test_huge_zeros_are_aligned_writable_zeros_of_the_dtype():
    for n, dtype in ((946_210, np.float32), (3, np.float64), (0, np.int16)):
        a = huge_zeros(n, dtype)
        assert a.dtype == dtype and a.shape == (n,) and not a.any()
        assert a.ctypes.data % HUGE_PAGE == 0 and a.flags.writeable
    a[:] = 0   # the empty one too


def test_a_small_arena_is_on_huge_pages_where_the_kernel_has_them():
    """The 3DGAN-sized arena (under numpy's own 4 MiB threshold) gets huge pages once
    written, in the kernel's 'always' and 'madvise' modes; in 'never' it still works."""
    a = huge_zeros(946_210, np.float32)   # 3.8 MB
    a[:] = 1.0
    mode = re.search(r"\[(\w+)\]", THP.read_text()).group(1) if THP.exists() else "never"
    if mode == "never":
        assert _huge_kib(a.ctypes.data) == 0 and a.sum() == a.size
    else:
        assert _huge_kib(a.ctypes.data) >= 2048, mode


def test_the_engines_cpu_arenas_are_huge_zeros_also_without_a_numpy_dtype():
    params = [torch.nn.Parameter(torch.ones(3, dtype=torch.bfloat16)),
              torch.nn.Parameter(torch.ones(5)), torch.nn.Parameter(torch.ones(2, 2))]
    flats, arenas = _arenas([[params[0]], [params[1], params[2]]])
    assert {d: a.numel() for d, a in arenas.items()} == {torch.bfloat16: 3, torch.float32: 9}
    assert all(a.data_ptr() % HUGE_PAGE == 0 and not a.any() for a in arenas.values())
    assert [f.numel() for f in flats] == [3, 9] and flats[1].dtype == torch.float32
