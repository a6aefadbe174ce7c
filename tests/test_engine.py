"""The data-parallel engine for real: 2 ranks x b equals 1 rank x 2b, replicas agree."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import base_env, run

pytestmark = pytest.mark.mpi
PROGRAMS = Path(__file__).parent / "programs"


def _params(ranks: int, model: str, out: Path, *extra: str) -> dict:
    result = run(["hpcai-launch", "-N", str(ranks), "--oversubscribe", "--", "python",
                  str(PROGRAMS / "dp_equivalence.py"), model, str(out), *extra],
                 base_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return dict(np.load(out))


@pytest.mark.parametrize("model,extra", [("mlp", ()), ("mlp", ("--blocking",)),
                                         ("gan-d", ()), ("gan-g", ())])
def test_two_ranks_equal_one_rank_with_twice_the_batch(model, extra, tmp_path):
    single = _params(1, model, tmp_path / "one.npz", *extra)
    double = _params(2, model, tmp_path / "two.npz", *extra)
    assert single.keys() == double.keys()
    moved = 0
    for name in single:
        a, b = single[name], double[name]
        rel = np.linalg.norm(a - b) / max(np.linalg.norm(a), 1e-12)
        assert rel <= 1e-5, f"{model} {name}: relative difference {rel:.3g}"
        moved += 1
    assert moved > 0


def test_divergence_check_fails_loudly_when_gradients_are_not_averaged(tmp_path):
    """A backend that silently skips averaging (as Horovod's Keras 3 path did) is caught."""
    script = tmp_path / "silent.py"
    script.write_text(
        "import torch\n"
        "from mpi4py import MPI\n"
        "from hpcai.training.replicas import verify, ReplicaDivergence\n"
        "from hpcai.training.torch_trainer import broadcast_state, module_arrays\n"
        "comm = MPI.COMM_WORLD\n"
        "m = torch.nn.Linear(8, 2)\n"
        "broadcast_state([m], comm)\n"
        "verify(module_arrays([m]), comm, exact=True)\n"
        "opt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "torch.manual_seed(comm.rank)\n"
        "m(torch.randn(4, 8)).sum().backward()  # no allreduce: the silent failure\n"
        "opt.step()\n"
        "try:\n"
        "    verify(module_arrays([m], buffers=False), comm, exact=False)\n"
        "except ReplicaDivergence as exc:\n"
        "    print('caught:', exc, flush=True)\n")
    result = run(["hpcai-launch", "-N", "2", "--", "python", str(script)], base_env())
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("caught:") == 2 and "diverged" in result.stdout
