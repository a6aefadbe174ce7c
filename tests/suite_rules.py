"""Rules that keep the suite honest: a missing required part fails it, it never skips.

* Every requirement of requirements.txt is installed at a version it allows, checked when the
  session starts (:func:`pytest_sessionstart`): a broken install stops the suite and names
  the package, instead of turning its tests into skips.
* No test calls ``importorskip`` on a module that requirements.txt installs
  (:func:`importorskips`, enforced by tests/test_suite_rules.py).
* Under ``run-tests.sh`` (``HPCAI_TESTS_STRICT=1``) a skip fails the test unless its reason is
  one of :data:`MACHINE_LIMITS`: what no install script can give this machine, as opposed to
  the parts that scripts/install.sh and scripts/build-horovod.sh provide.

tests/conftest.py imports the hooks; ``python -m pytest -p suite_rules`` loads them alone.
"""

from __future__ import annotations

import ast
import importlib.metadata
import os
import sys
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REQUIREMENTS = Path(__file__).resolve().parent.parent / "requirements.txt"
STRICT = os.environ.get("HPCAI_TESTS_STRICT") == "1"

# The skip reasons run-tests.sh accepts (a reason must start with one of them; details such as
# the error text may follow), as the tests give them: what this machine
# lacks and no install script provides. Everything else that can skip is a part that
# scripts/install.sh or scripts/build-horovod.sh installs, so its skip is a broken install.
MACHINE_LIMITS = (
    # tests/test_image.py: not root, and no image was built before
    "building the image needs root (debootstrap) and no built image exists",
    # tests/test_hostlibs.py: not x86_64 (gcc itself comes with scripts/install.sh)
    "needs gcc on x86_64",
    # tests/test_mpi_launch.py: the suite itself runs inside a hydra (MPICH/Intel MPI) job
    "unexpected hydra env",
    # testbed/apptainer_rig.py: Apptainer comes from Debian sid's mirror, out of reach
    "the Apptainer rig cannot be built here: the Debian mirror is out of reach",
    # testbed/apptainer_rig.py: not root, and no rig was built before
    "building the Apptainer rig needs root",
    # tests/test_netns.py, test_lrz.py: the kernel or sandbox gives no network namespaces
    "no network namespaces here:",
)


def read_requirements(path: Path = REQUIREMENTS) -> list[Requirement]:
    """The requirements of a requirements file (one per line, ``#`` comments)."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [Requirement(line) for line in lines if line]


def unmet_requirements(requirements: list[Requirement]) -> list[str]:
    """One line per requirement that is not installed or installed at a version it excludes."""
    unmet = []
    for req in requirements:
        try:
            version = importlib.metadata.version(req.name)
        except importlib.metadata.PackageNotFoundError:
            unmet.append(f"{req}: not installed")
            continue
        if not req.specifier.contains(version, prereleases=True):
            unmet.append(f"{req}: {req.name} {version} is installed")
    return unmet


def required_modules(requirements: list[Requirement]) -> frozenset[str]:
    """The top-level modules that the installed distributions of ``requirements`` provide."""
    names = {canonicalize_name(req.name) for req in requirements}
    return frozenset(module for module, dists
                     in importlib.metadata.packages_distributions().items()
                     if any(canonicalize_name(d) in names for d in dists))


@dataclass(frozen=True)
class ImportOrSkip:
    """An ``importorskip`` call: where, and of which module (None: not a literal string)."""

    path: str
    line: int
    module: str | None


def importorskips(source: str, modules: Collection[str],
                  path: str = "<string>") -> Iterator[ImportOrSkip]:
    """The ``importorskip`` calls in ``source`` whose module is one of ``modules`` (or a
    submodule), or is not given as a literal string."""
    for node in ast.walk(ast.parse(source, path)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name != "importorskip":
            continue
        arg = node.args[0] if node.args else next(
            (k.value for k in node.keywords if k.arg == "modname"), None)
        if not (isinstance(arg, ast.Constant) and isinstance(arg.value, str)):
            yield ImportOrSkip(path, node.lineno, None)
        elif arg.value.split(".")[0] in modules:
            yield ImportOrSkip(path, node.lineno, arg.value)


def pytest_sessionstart(session: pytest.Session) -> None:
    """Stop the session, naming the packages, when a requirement is not met."""
    unmet = unmet_requirements(read_requirements())
    if unmet:
        pytest.exit(f"requirements of {REQUIREMENTS} not met in {sys.prefix}:\n  "
                    + "\n  ".join(unmet) + "\nhint: run scripts/install.sh (or ./run-tests.sh)",
                    returncode=pytest.ExitCode.INTERRUPTED)


def _fail_unless_machine_limit(report: pytest.TestReport | pytest.CollectReport) -> None:
    if not (STRICT and report.skipped and not hasattr(report, "wasxfail")):
        return
    where, reason = "", str(report.longrepr)
    if isinstance(report.longrepr, tuple):     # (path, line, "Skipped: reason")
        where, reason = f"{report.longrepr[0]}:{report.longrepr[1]}: ", report.longrepr[2]
    reason = reason.removeprefix("Skipped: ")
    if not reason.startswith(MACHINE_LIMITS):
        report.outcome = "failed"
        report.longrepr = (f"{where}skipped: {reason}\nrun-tests.sh accepts a skip only "
                           f"for what this machine cannot have (MACHINE_LIMITS in {__file__}); "
                           "this is a part that scripts/install.sh or scripts/build-horovod.sh "
                           "provides, so its skip means a broken install")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> pytest.TestReport:
    report = yield
    _fail_unless_machine_limit(report)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> pytest.CollectReport:
    report = yield
    _fail_unless_machine_limit(report)
    return report
