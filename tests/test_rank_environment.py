"""A rank runs in the user's environment (issue 42, item 8).

The user's shell here: a venv (``python -m venv --without-pip``) whose ``python3`` is first
on PATH, then a module-style prefix (its bin/ on PATH, its lib/ first on LD_LIBRARY_PATH, as
``module load`` does), and a PYTHONPATH entry. Under each launcher, every rank's
``python3`` is the venv's, and its PATH, LD_LIBRARY_PATH and PYTHONPATH are the user's plus
what the plan adds and shows (``--dry-run --json``'s env); entries a launcher repeats count
once. The controls: each MPI's own launcher run bare from the same shell keeps the user's
``python3``; apt Open MPI's mpirun started by its path without ``--noprefix`` (what
hpcai-launch did) puts /usr/bin first, and the same assertion fails on it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FLAVOURS, VENV_BIN, base_env, run

OPT = VENV_BIN.parent / "opt"
NAMES = ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH")
PROBE = """\
import json, os, shutil, sys
rank = next(os.environ[k] for k in ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
            if k in os.environ)
line = "probe " + json.dumps({"rank": int(rank), "executable": sys.executable,
      "which": shutil.which("python3"), **{k: os.environ.get(k, "") for k in %r}}) + "\\n"
os.write(1, line.encode())   # one write: two ranks' lines cannot interleave
""" % (NAMES,)


def _launchers() -> dict[str, tuple[str, dict[str, str]]]:
    """--mpi name: (the launcher's path, env it needs), for each install this machine has."""
    found = {}
    for spec, flavour in (("openmpi@4", "openmpi"), ("mpich@4", "mpich"), ("intel", "intel")):
        if flavour in FLAVOURS:
            found[spec] = (FLAVOURS[flavour].launcher, FLAVOURS[flavour].env)
    for spec, path in (("openmpi@5", OPT / "openmpi5" / "bin" / "mpirun"),
                       ("mpich@5", OPT / "mpich5" / "bin" / "mpiexec.hydra")):
        if path.exists():
            found[spec] = (str(path), {})
    return found


LAUNCHERS = _launchers()
ALL = ("openmpi@4", "mpich@4", "intel", "openmpi@5", "mpich@5")


class Shell:
    """The user's environment: a venv and a module-style prefix in front of base_env()."""

    def __init__(self, root: Path) -> None:
        self.venv, self.module = root / "venv", root / "module"
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(self.venv)],
                       check=True)
        (self.module / "bin").mkdir(parents=True)
        (self.module / "lib").mkdir()
        (root / "pylib").mkdir()
        self.probe = root / "probe.py"
        self.probe.write_text(PROBE)
        env = base_env()
        env.pop("VIRTUAL_ENV", None)
        env["PATH"] = os.pathsep.join([str(self.venv / "bin"), str(self.module / "bin"),
                                       env["PATH"]])
        env["LD_LIBRARY_PATH"] = str(self.module / "lib")
        env["PYTHONPATH"] = os.pathsep.join(
            [str(root / "pylib"), *filter(None, [os.environ.get("PYTHONPATH")])])
        env["VIRTUAL_ENV"] = str(self.venv)
        self.env, self.cwd = env, root
        self.python3 = shutil.which("python3", path=env["PATH"])
        assert self.python3 == str(self.venv / "bin" / "python3")

    def ranks(self, argv: list[str], extra: dict[str, str] | None = None) -> list[dict]:
        result = run(argv, {**self.env, **(extra or {})}, timeout=120, cwd=self.cwd)
        assert result.returncode == 0, (argv, result.stdout, result.stderr[-3000:])
        found = [json.loads(line[6:]) for line in result.stdout.splitlines()
                 if line.startswith("probe ")]
        assert sorted(r["rank"] for r in found) == [0, 1], result.stdout
        return found


def _once(value: str) -> list[str]:
    return list(dict.fromkeys(p for p in value.split(os.pathsep) if p))


def assert_users_environment(shell: Shell, ranks: list[dict], plan_env: dict[str, str]):
    for r in ranks:
        assert r["executable"] == r["which"] == shell.python3, r
        for name in NAMES:
            wanted = plan_env.get(name, shell.env.get(name, ""))
            assert _once(r[name]) == _once(wanted), (name, r[name], wanted)


@pytest.fixture
def shell(tmp_path) -> Shell:
    return Shell(tmp_path)


@pytest.mark.mpi
@pytest.mark.parametrize("spec", ALL)
def test_ranks_run_the_users_python_under_each_mpi(shell, spec):
    if spec not in LAUNCHERS:
        pytest.skip(f"{spec} is not installed (run scripts/install.sh)")
    launcher, extra = LAUNCHERS[spec]
    base = ["hpcai-launch", "--mpi", spec, "-N", "2", "--oversubscribe"]
    plan = run([*base, "--dry-run", "--json", "--", "python3", str(shell.probe)],
               {**shell.env, **extra}, cwd=shell.cwd)
    assert plan.returncode == 0, plan.stderr
    plan_env = json.loads(plan.stdout)["env"]
    assert "PATH" not in plan_env and "PYTHONPATH" not in plan_env, plan_env
    ranks = shell.ranks([*base, "--", "python3", str(shell.probe)], extra)
    assert_users_environment(shell, ranks, plan_env)
    # the control: the MPI's own launcher, bare (by name where it is on PATH, as a user
    # types it), keeps the user's python3
    name = os.path.basename(launcher)
    bare = name if shutil.which(name, path=shell.env["PATH"]) == launcher else launcher
    root = ["--allow-run-as-root"] if spec.startswith("openmpi") and os.getuid() == 0 else []
    for r in shell.ranks([bare, "-n", "2", *root, "python3", str(shell.probe)], extra):
        assert r["which"] == shell.python3, r


@pytest.mark.mpi
def test_open_mpi_by_its_path_without_noprefix_is_not_the_users_environment(shell):
    """The negative control: what hpcai-launch used to start fails the same assertion."""
    if "openmpi@4" not in LAUNCHERS:
        pytest.skip("apt Open MPI is not installed (run scripts/install.sh)")
    launcher = LAUNCHERS["openmpi@4"][0]
    root = ["--allow-run-as-root"] if os.getuid() == 0 else []
    ranks = shell.ranks([launcher, "-n", "2", *root, "python3", str(shell.probe)])
    assert all(r["which"] == "/usr/bin/python3" for r in ranks), ranks
    assert all(r["PATH"].startswith("/usr/bin:") for r in ranks), ranks
    with pytest.raises(AssertionError):
        assert_users_environment(shell, ranks, {})


def test_open_mpi_plans_keep_the_users_paths():
    """The plan's part: Open MPI's mpirun gets --noprefix (started by its absolute path it
    acts as if given --prefix); the Hydra launchers keep the environment without a flag."""
    from hpcai.launcher.mpi import abi

    assert abi.OPENMPI.keep_env_flags == ("--noprefix",)
    assert abi.MPICH.keep_env_flags == abi.INTEL.keep_env_flags == ()


@pytest.mark.mpi
def test_ranks_run_the_users_python_under_srun(shell, tmp_path):
    """srun (the private Slurm of testbed/localcluster.py) passes the environment on."""
    from localcluster import LocalCluster, missing_programs

    if missing_programs():
        pytest.skip(f"Slurm is not installed: {', '.join(missing_programs())}")
    with LocalCluster() as cluster:
        extra = dict(cluster.env)
        ranks = shell.ranks(["srun", "--mpi=none", "--ntasks-per-node=2", "hpcai-launch",
                             "-N", "2", "--", "python3", str(shell.probe)], extra)
    for r in ranks:
        assert r["executable"] == r["which"] == shell.python3, r
        assert r["PATH"] == shell.env["PATH"] and r["PYTHONPATH"] == shell.env["PYTHONPATH"]
        assert _once(r["LD_LIBRARY_PATH"])[-1:] == [str(shell.module / "lib")], r
