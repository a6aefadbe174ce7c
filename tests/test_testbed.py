"""The test bed (testbed/) stands apart: bench/ and testbed/ import nothing from tests/ and do
not put tests/ on sys.path, testbed/ stays out of the wheel, and its scripts start from any
working directory; and the fast tier's list (tests/fast_tier.py) names tests that exist and
no test marked as slow work. Each check has its control."""

from __future__ import annotations

import ast
import configparser
import re
import sys
from pathlib import Path

import pytest

from conftest import REPO, base_env, run

TESTS = REPO / "tests"
TEST_MODULES = frozenset(p.stem for p in TESTS.glob("*.py"))
PATH_CALLS = {"insert", "append", "extend", "addsitedir"}


def _names_tests(node: ast.AST) -> bool:
    """Whether an expression names tests/ or a folder below it: a string constant with a
    path segment ``tests`` (``REPO / "tests"``, ``".../tests/programs"``)."""
    return any(isinstance(n, ast.Constant) and isinstance(n.value, str)
               and "tests" in n.value.split("/") for n in ast.walk(node))


def leaks_into_tests(source: str, name: str) -> list[str]:
    """Each place in ``source`` that imports a module of tests/ or puts tests/ (or a folder
    below it) on the module search path (``sys.path.insert/append``, ``site.addsitedir``)."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            mods = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            mods = [node.module]
        else:
            mods = []
        for mod in mods:
            top = mod.split(".")[0]
            if top == "tests" or top in TEST_MODULES:
                found.append((node.lineno, f"{name}:{node.lineno}: imports {mod} from tests/"))
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in PATH_CALLS and any(_names_tests(a) for a in node.args)):
            found.append((node.lineno,
                          f"{name}:{node.lineno}: puts tests/ on the module search path"))
    return [text for _, text in sorted(found)]


def _scan(folder: Path) -> list[str]:
    return [hit for path in sorted(folder.rglob("*.py"))
            for hit in leaks_into_tests(path.read_text(), str(path.relative_to(REPO)))]


def test_bench_and_testbed_import_nothing_from_tests():
    assert _scan(REPO / "bench") == []
    assert _scan(REPO / "testbed") == []


def test_the_scan_finds_imports_from_tests(tmp_path):
    """The control: a bench file as four of them once were is caught, on each line that
    reaches into tests/; one that only names a program under tests/ is not."""
    (tmp_path / "bad.py").write_text(
        "import sys\nfrom pathlib import Path\nREPO = Path(__file__).parent.parent\n"
        "sys.path.insert(0, str(REPO / 'tests'))\n"
        "sys.path.append('/somewhere/tests/')\n"
        "from test_startup import _image\n"
        "import conftest\n"
        "from tests.jobs import train\n"
        "from localcluster import LocalCluster\n")
    (tmp_path / "good.py").write_text(
        "import sys\nfrom pathlib import Path\nREPO = Path(__file__).parent.parent\n"
        "sys.path.insert(0, str(REPO / 'testbed'))\n"
        "PROGRAM = REPO / 'tests' / 'programs' / 'dp_equivalence.py'\n"
        "from localcluster import LocalCluster\n")
    assert [hit.split(": ", 1)[0] for hit in _scan_tmp(tmp_path)] == [
        "bad.py:4", "bad.py:5", "bad.py:6", "bad.py:7", "bad.py:8"]


def _scan_tmp(folder: Path) -> list[str]:
    return [hit for path in sorted(folder.glob("*.py"))
            for hit in leaks_into_tests(path.read_text(), path.name)]


def test_testbed_stays_out_of_the_wheel():
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    packages = cfg["options"]["packages"].split()
    assert "hpcai" in packages and "hpcai.launcher" in packages   # the control: read right
    assert not [p for p in packages if p.split(".")[1:2] == ["testbed"]], packages
    assert not (REPO / "testbed" / "__init__.py").exists()


@pytest.mark.parametrize("script", ["testbed/localcluster.py", "bench/slurm_16rank.py"])
def test_testbed_scripts_start_from_any_directory(script, tmp_path):
    result = run([sys.executable, str(REPO / script), "--help"], base_env(), timeout=60,
                 cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "usage:" in result.stdout


# -- the fast tier (tests/fast_tier.py) ------------------------------------------------------

def test_every_fast_entry_names_a_test_that_exists():
    import fast_tier

    missing = []
    for entry in sorted(fast_tier.FAST):
        name, _, test = entry.partition("::")
        path = TESTS / name
        if not path.is_file():
            missing.append(entry)
        elif test and not re.search(rf"^def {re.escape(test)}\(", path.read_text(), re.M):
            missing.append(entry)
    assert missing == [], missing
    assert fast_tier.is_fast("tests/test_abi.py::test_lookups")           # the control: read
    assert not fast_tier.is_fast("tests/test_faults.py::test_killed_rank_ends_the_job_promptly"
                                 "_and_is_named")


def _tier_run(tmp_path: Path, entries: set[str]):
    (tmp_path / "conftest.py").write_text(
        "import fast_tier\n"
        f"fast_tier.FAST = frozenset({sorted(entries)!r})\n"
        "from fast_tier import mark_fast_tier as pytest_collection_modifyitems  # noqa\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    fast: f\n    mpi: m\n")
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "@pytest.mark.mpi\ndef test_ranks():\n    pass\n"
        "@pytest.mark.parametrize('n', [1, 2])\ndef test_unit(n):\n    pass\n")
    return run([sys.executable, "-m", "pytest", "-m", "fast", "-q", "-p", "no:cacheprovider",
                str(tmp_path)], base_env(PYTHONPATH=str(TESTS)), timeout=120, cwd=tmp_path)


def test_the_fast_mark_follows_the_list_and_refuses_slow_work(tmp_path):
    """A listed test runs under -m fast with every parametrisation, the others are
    deselected; the control: a listed test marked mpi stops the session and is named."""
    listed = _tier_run(tmp_path, {"test_x.py::test_unit"})
    assert listed.returncode == 0, listed.stdout + listed.stderr
    assert "2 passed, 1 deselected" in listed.stdout, listed.stdout
    whole = _tier_run(tmp_path, {"test_x.py"})
    assert whole.returncode != 0
    assert "test_x.py::test_ranks (mpi)" in whole.stdout + whole.stderr, whole.stdout


CHILD = "import subprocess, sys, time; subprocess.run([sys.executable, '-c', " \
        "'import time; time.sleep(30)', 'train']); time.sleep(30)"


def test_rank_pids_names_the_rank_not_a_child_that_inherited_its_environment():
    """A tagged 'rank' (``train`` in its command line, ``RANK=0``) runs a child with the same
    environment and ``train`` in its command line, as ``train``'s ``git`` runs: the rank's
    PID is the parent's. Control: both processes match the tag alone."""
    import os
    import signal
    import subprocess
    import uuid

    from jobs import rank_pids, wait_for

    tag = uuid.uuid4().hex
    env = base_env(HPCAI_TEST_TAG=tag, RANK="0")
    parent, child = subprocess.Popen([sys.executable, "-c", CHILD, "train"], env=env), None
    try:
        child = wait_for(lambda: [int(p) for p in
                                  Path(f"/proc/{parent.pid}/task/{parent.pid}/children")
                                  .read_text().split()], 30, "the child")[0]
        wait_for(lambda: b"train" in Path(f"/proc/{child}/cmdline").read_bytes(), 30,
                 "the child's exec")
        tagged = [pid for pid in (parent.pid, child) if f"HPCAI_TEST_TAG={tag}".encode()
                  in Path(f"/proc/{pid}/environ").read_bytes()]
        assert tagged == [parent.pid, child]   # the control: the tag alone matches both
        assert rank_pids(tag) == {0: parent.pid}
    finally:
        for pid in (child, parent.pid):   # the two this test started, by PID
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
        parent.wait()
