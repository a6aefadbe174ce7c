"""The suite's own rules (tests/suite_rules.py), each with the control that shows it bites."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

import suite_rules
from conftest import base_env

TESTS = Path(__file__).resolve().parent
TESTBED = TESTS.parent / "testbed"


def test_requirements_are_met_here():
    assert suite_rules.unmet_requirements(suite_rules.read_requirements()) == []


def test_unmet_requirements_are_named():
    reqs = [Requirement(r) for r in ("numpy", "numpy==0.0.1", "hpcai-no-such-package==1.0")]
    unmet = suite_rules.unmet_requirements(reqs)
    assert len(unmet) == 2 and unmet[0].startswith("numpy==0.0.1: numpy ")
    assert unmet[1] == "hpcai-no-such-package==1.0: not installed"


def test_no_test_importorskips_a_required_package():
    modules = suite_rules.required_modules(suite_rules.read_requirements())
    assert {"torch", "tensorflow", "keras", "onnxruntime", "mpi4py", "hostlist"} <= modules
    found = [hit for path in sorted([*TESTS.rglob("*.py"), *TESTBED.rglob("*.py")])
             for hit in suite_rules.importorskips(path.read_text(), modules, str(path))]
    assert found == [], "required packages are imported, not skipped on: " + repr(found)


def test_importorskip_scan_finds_what_it_must():
    source = ("import pytest\nfrom pytest import importorskip\n"
              "pytest.importorskip('onnxruntime')\nimportorskip(modname='tensorflow.keras')\n"
              "pytest.importorskip(name)\npytest.importorskip('hpcai_not_required')\n")
    hits = list(suite_rules.importorskips(source, {"onnxruntime", "tensorflow"}))
    assert [(h.line, h.module) for h in hits] == [(3, "onnxruntime"), (4, "tensorflow.keras"),
                                                  (5, None)]


def _pytest(directory: Path, strict: bool,
            pythonpath: str = str(TESTS)) -> subprocess.CompletedProcess:
    """pytest on ``directory`` with only the suite's rules as plugin."""
    run_env = base_env(PYTHONPATH=pythonpath)
    if strict:
        run_env["HPCAI_TESTS_STRICT"] = "1"
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "suite_rules", "-p",
                           "no:cacheprovider", "-q", "-rA", str(directory)], env=run_env,
                          cwd=directory, capture_output=True, text=True, timeout=120, check=False)


def test_strict_mode_fails_every_skip_but_a_machine_limit(tmp_path):
    (tmp_path / "test_skips.py").write_text(
        "import pytest\n"
        "def test_required_part():\n"
        "    pytest.skip('Open MPI not installed')\n"
        "@pytest.mark.skipif(True, reason='Horovod is not built here')\n"
        "def test_marked():\n"
        "    pass\n"
        "def test_machine_limit():\n"
        f"    pytest.skip({suite_rules.MACHINE_LIMITS[0]!r})\n")
    lenient = _pytest(tmp_path, strict=False)
    assert lenient.returncode == 0 and "3 skipped" in lenient.stdout, lenient.stdout
    strict = _pytest(tmp_path, strict=True)
    assert strict.returncode == 1, strict.stdout + strict.stderr
    assert "1 failed, 1 skipped, 1 error" in strict.stdout, strict.stdout
    assert "skipped: Open MPI not installed\nrun-tests.sh accepts a skip only" in strict.stdout
    assert "skipped: Horovod is not built here" in strict.stdout


def test_strict_mode_fails_a_module_level_skip(tmp_path):
    (tmp_path / "test_module.py").write_text(
        "import pytest\npytest.importorskip('hpcai_no_such_module')\n"
        "def test_never():\n    pass\n")
    lenient = _pytest(tmp_path, strict=False)
    assert lenient.returncode == 5 and "1 skipped" in lenient.stdout, lenient.stdout  # none ran
    strict = _pytest(tmp_path, strict=True)
    assert strict.returncode == 2 and "1 error" in strict.stdout, strict.stdout
    assert "skipped: could not import 'hpcai_no_such_module'" in strict.stdout, strict.stdout


def test_a_wrong_version_stops_the_session_and_names_it(tmp_path):
    """A shadowing onnxruntime 0.0.1 (a broken install) ahead of the real one on sys.path."""
    fake = tmp_path / "site" / "onnxruntime-0.0.1.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: onnxruntime\nVersion: 0.0.1\n")
    (tmp_path / "test_any.py").write_text("def test_any():\n    pass\n")
    assert _pytest(tmp_path, strict=False).returncode == 0
    broken = _pytest(tmp_path, strict=False, pythonpath=f"{tmp_path / 'site'}:{TESTS}")
    assert broken.returncode == 2, broken.stdout + broken.stderr
    pin = next(str(r) for r in suite_rules.read_requirements() if r.name == "onnxruntime")
    assert f"{pin}: onnxruntime 0.0.1 is installed" in broken.stdout + broken.stderr
    assert "1 passed" not in broken.stdout
