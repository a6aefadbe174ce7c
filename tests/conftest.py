"""Shared fixtures: the MPI flavours on this machine, detected once, and a loopback env;
the suite's own rules (tests/suite_rules.py): unmet requirements stop the session, and
under run-tests.sh a skip fails unless it is a limit of the machine; the fast tier's
mark (tests/fast_tier.py); and the files' order for the xdist workers (tests/suite_order.py)."""

from __future__ import annotations

import ctypes
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

# The test bed (the private Slurm, the Apptainer rig, the netns nodes, the tracing and job
# helpers) lives in the repository's testbed/, shared with bench/; its modules import by name.
_TESTBED = str(Path(__file__).resolve().parent.parent / "testbed")
if _TESTBED not in sys.path:
    sys.path.insert(0, _TESTBED)

from fast_tier import mark_fast_tier  # noqa: E402
from rigenv import (IMPI_ROOT, KEEP_FREED_MEMORY, LOOPBACK, REPO,  # noqa: E402,F401
                    SHARED_CORES, VENV_BIN, base_env, run)
from suite_order import longest_first  # noqa: E402
from suite_rules import (pytest_make_collect_report, pytest_runtest_makereport,  # noqa: E402,F401
                         pytest_sessionstart)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The fast tier's mark (tests/fast_tier.py), then the longest files first
    (tests/suite_order.py)."""
    mark_fast_tier(config, items)
    longest_first(items)


def blocked_env(shim: Path, *modules: str) -> dict[str, str]:
    """``base_env()`` in which ``modules`` cannot be imported, as if not installed: a
    ``sitecustomize`` in ``shim`` sets ``sys.modules[m] = None`` (``import m`` and its
    submodules raise ImportError) and goes first on PYTHONPATH, before the rest of it."""
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "sitecustomize.py").write_text(
        "import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules))
    rest = os.environ.get("PYTHONPATH")
    return base_env(PYTHONPATH=os.pathsep.join([str(shim), *([rest] if rest else [])]))


@dataclass(frozen=True)
class MpiUnderTest:
    name: str            # hpcai flavour name
    launcher: str        # path of mpirun/mpiexec
    env: dict[str, str]  # extra env the launcher needs
    lib_marker: str      # substring of the libmpi path every rank must have mapped
    direct_args: tuple[str, ...] = ()  # extra args for `launcher -n 2 ...` as root


def _detect_flavours() -> dict[str, MpiUnderTest]:
    found: dict[str, MpiUnderTest] = {}
    if shutil.which("mpirun.openmpi"):
        found["openmpi"] = MpiUnderTest("openmpi", shutil.which("mpirun.openmpi"), {},
                                        "libmpi.so.40", ("--allow-run-as-root",))
    if shutil.which("mpiexec.mpich"):
        found["mpich"] = MpiUnderTest("mpich", shutil.which("mpiexec.mpich"), {}, "libmpich")
    if (IMPI_ROOT / "bin" / "mpiexec.hydra").exists():
        found["intel"] = MpiUnderTest("intel", str(IMPI_ROOT / "bin" / "mpiexec.hydra"),
                                      {"I_MPI_ROOT": str(IMPI_ROOT)}, str(IMPI_ROOT / "lib"))
    return found


FLAVOURS = _detect_flavours()
ALL_FLAVOURS = ("openmpi", "mpich", "intel")


def _c_environment_behind_python() -> set[bytes]:
    """Names whose value in the C library's ``environ`` (what a child started without an
    explicit environment inherits) differs from ``os.environb``: set with the C library's
    setenv in this process, behind Python's back."""
    entries = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    c_env: dict[bytes, bytes] = {}
    i = 0
    while entries[i] is not None:
        name, _, value = entries[i].partition(b"=")
        c_env[name] = value
        i += 1
    py_env = dict(os.environb)
    return {k for k in c_env.keys() | py_env.keys() if c_env.get(k) != py_env.get(k)}


@pytest.fixture(autouse=True)
def _no_mpi_init_in_the_suites_process():
    """Fail the test that initialises MPI in pytest's own process: the first import of
    ``mpi4py.MPI`` (``MPI_Init``), or any call that leaves variables in the C library's
    environment which ``os.environ`` does not show (Open MPI's singleton ``MPI_Init`` sets
    two dozen with setenv, and so would Horovod's init or a ctypes call). Every later child
    that inherits them and runs ``mpirun`` exits 1 without a word (tests/test_signals.py
    shows it). Ranks belong in subprocesses."""
    before = "mpi4py.MPI" in sys.modules
    hidden_before = _c_environment_behind_python()
    yield
    faults = []
    if not before and "mpi4py.MPI" in sys.modules:
        faults.append("this test imported mpi4py.MPI (MPI_Init) into pytest's own process")
    hidden = sorted(_c_environment_behind_python() - hidden_before)
    if hidden:
        names = ", ".join(n.decode(errors="replace") for n in hidden[:6])
        more = f" and {len(hidden) - 6} more" if len(hidden) > 6 else ""
        faults.append(f"this test set {names}{more} in the C environment of pytest's own "
                      "process, which os.environ does not show (setenv, as MPI_Init does)")
    if faults:
        pytest.fail("; ".join(faults) + "; import the module that needs it in a subprocess, "
                    "or move the code under test out of a module that initialises MPI")


@pytest.fixture(autouse=True)
def _one_torch_thread_per_worker():
    """Under pytest-xdist torch in a worker's own process computes on its share of the
    cores (one thread with one worker per core), so in-process model tests do not spin
    threads on the cores the other workers use. Subprocesses (ranks, bare ``train``) are
    not affected: their threads come from their own plans and environments."""
    torch = sys.modules.get("torch")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if torch is not None and workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))
    yield


@pytest.fixture(params=ALL_FLAVOURS)
def mpi(request) -> MpiUnderTest:
    """Each MPI flavour installed here (skipped, with the reason, when one is missing)."""
    if request.param not in FLAVOURS:
        pytest.skip(f"{request.param} is not installed (run scripts/install.sh)")
    return FLAVOURS[request.param]
