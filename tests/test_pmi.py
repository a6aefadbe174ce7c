"""The PMI plugin under srun, chosen by hpcai for every MPI flavour (launcher/mpi/pmi.py).

- pure: the choice (explicit, site profile, the flavour's), a rank started with the wrong
  plugin refused before the program runs, Slurm's libpmi2 found and pointed at;
- for real, on two fake nodes of the private Slurm: inside a batch job hpcai-launch builds
  the srun line itself for Open MPI (pmix), MPICH (pmi2) and Intel MPI (pmi2 with
  ``I_MPI_PMI_LIBRARY``), and every rank must be one of 4 and have mapped its MPI's library
  (and, for Intel MPI, Slurm's libpmi2); a rank srun started with --mpi=pmix and
  ``--mpi mpich`` is refused with the srun line that works, and that line runs.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
from pathlib import Path

import pytest

from clusterjobs import copy_rank_report, job_env, ok, rank_reports, run, submit
from conftest import FLAVOURS
from hpcai.core.errors import UserError
from hpcai.launcher.mpi import flavours
from hpcai.launcher.planning.facts import Facts
from hpcai.launcher.planning.options import Options
from hpcai.launcher.planning.plan import build_plan
from hpcai.launcher.job.rankenv import from_environ
from hpcai.launcher.job.site import SiteProfile
from hpcai.launcher.node.topology import synthetic
from hpcai.launcher.mpi import abi, pmi
from localcluster import LocalCluster, missing_programs

INTEL_LIB = abi.PMI_LIBRARIES[0]
PROBE = ("python3", "-m", "hpcai.launcher.probe")
TWO_BY_TWO = ("--nodes", "2", "--ntasks-per-node", "2")


# --- the choice, pure ----------------------------------------------------------------------

def test_pmi_choice_order():
    site = SiteProfile.from_dict({"pmi": "pmix_v4"})
    assert pmi.choose("pmi2", site, "pmix") == "pmi2"          # explicit first
    assert pmi.choose(None, site, "pmi2") == "pmix_v4"         # then the site's
    assert pmi.choose(None, None, "pmi2") == "pmi2"            # then the flavour's
    assert pmi.choose(None, SiteProfile(), None) is None       # srun's MpiDefault
    assert {f.name: f.srun_mpi for f in flavours.FLAVOURS.values()} == \
        {"openmpi": "pmix", "mpich": "pmi2", "intel": "pmi2"}


@pytest.mark.parametrize("needed,used,mismatch", [
    ("pmi2", "pmix", True), ("pmix", "pmi2", True), ("pmix", "pmix_v4", False),
    ("pmix_v4", "pmix", False), ("pmi2", "pmi2", False), ("pmi2", None, False),
    (None, "pmix", False)])
def test_pmi_step_mismatch(needed, used, mismatch):
    assert pmi.step_mismatch(needed, used) is mismatch


def test_pmi_step_plugin_reads_slurm_mpi_type():
    assert pmi.step_plugin({"SLURM_MPI_TYPE": "pmix_v4"}) == "pmix_v4"
    assert pmi.step_plugin({"SLURM_MPI_TYPE": "none"}) is None
    assert pmi.step_plugin({}) is None


def test_pmi_library_only_for_intel_under_pmi2():
    assert pmi.library_for("intel", "pmi2") == INTEL_LIB
    assert INTEL_LIB.env_var == "I_MPI_PMI_LIBRARY"
    for impl, plugin in (("intel", "pmix"), ("mpich", "pmi2"), ("openmpi", "pmix"),
                         ("intel", None), (None, "pmi2")):
        assert pmi.library_for(impl, plugin) is None


def _fake_lib(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"\x7fELF")
    return path


def test_pmi_library_found_named_or_refused(tmp_path):
    site_dir = _fake_lib(tmp_path / "site" / "libpmi2.so.0").parent
    site = SiteProfile.from_dict({"search_dirs": [str(site_dir)]})
    bare = {"PATH": str(tmp_path / "nobin")}
    assert pmi.find_library(INTEL_LIB, bare, site, "") == str(site_dir / "libpmi2.so.0")
    # Named by the env (the user's, or the site's [env]): used as it is, if it exists.
    named = _fake_lib(tmp_path / "opt" / "slurm" / "lib" / "libpmi2.so")
    assert pmi.find_library(INTEL_LIB, dict(bare, I_MPI_PMI_LIBRARY=str(named)), site,
                            "") == str(named)
    lrz = SiteProfile.from_dict({"env": {"I_MPI_PMI_LIBRARY": "/usr/lib64/libpmi2.so"}})
    if not Path("/usr/lib64/libpmi2.so").exists():
        with pytest.raises(UserError, match="I_MPI_PMI_LIBRARY=/usr/lib64/libpmi2.so does "
                                            "not exist on this host") as err:
            pmi.find_library(INTEL_LIB, bare, lrz, "")
        assert "unset it" in err.value.hint
    # Beside srun (a Slurm install prefix), then ldconfig -p.
    srun = tmp_path / "slurm" / "bin" / "srun"
    srun.parent.mkdir(parents=True)
    srun.write_text("#!/bin/sh\n")
    srun.chmod(0o755)
    beside = _fake_lib(tmp_path / "slurm" / "lib64" / "libpmi2.so.0")
    assert pmi.find_library(INTEL_LIB, {"PATH": str(srun.parent)}, None, "") == str(beside)
    cache = f"\tlibpmi2.so.0 (libc6,x86-64) => {named}\n"
    if not any((Path(d) / n).exists() for d in pmi.library_dirs(bare, None)
               for n in INTEL_LIB.sonames):
        assert pmi.find_library(INTEL_LIB, bare, None, cache) == str(named)
        assert pmi.find_library(INTEL_LIB, bare, None, "") is None
        note = pmi.not_found(INTEL_LIB, bare, None)
        assert "this host has none" in note and "its own PMI-2 client" in note
        assert "libpmi2-0" in note


def test_pmi_staged_library_is_pointed_at_inside_the_container():
    names = [("", "libmpi.so.12"), ("libfabric", "libtcp-fi.so"), ("pmi", "libpmi2.so.0")]
    assert pmi.staged_env("/opt/hpcai/host/lib", names) == \
        {"I_MPI_PMI_LIBRARY": "/opt/hpcai/host/lib/pmi/libpmi2.so.0"}
    assert pmi.staged_env("/opt/hpcai/host/lib", names[:2]) == {}


# --- a rank of an srun step, planned (pure) --------------------------------------------------

def _step_env(plugin: str | None) -> dict[str, str]:
    env = {"PATH": "/usr/bin", "SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0",
           "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_NUM_TASKS": "4",
           "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "n[1-2]"}
    if plugin:      # what srun exports with each plugin
        env["SLURM_MPI_TYPE"] = plugin
        env.update({"PMIX_RANK": "0"} if plugin.startswith("pmix") else
                   {"PMI_FD": "11", "PMI_RANK": "0", "PMI_SIZE": "4"})
    return env


def _rank_plan(flavour: str, plugin: str | None, client=pmi.PmiClient()):
    env = _step_env(plugin)
    facts = Facts(env=env, topology=synthetic("pack:1 numa:1 core:2"), hostname="n1",
                  self_argv=("hpcai-launch",), command_path="/usr/bin/python3",
                  mpi=flavours.locate(flavours.get(flavour), "/usr/bin/mpiexec", env),
                  rank=from_environ(env), pmi=client)
    return build_plan(Options(command=PROBE, ranks_per_node=2, mpi=flavour), facts)


def _pmi_warnings(plan) -> tuple[str, ...]:
    """The plan's warnings without the one about the synthetic test topology."""
    return tuple(w for w in plan.warnings if not w.startswith("topology "))


@pytest.mark.parametrize("flavour,plugin", [("mpich", "pmix"), ("intel", "pmix_v4"),
                                            ("openmpi", "pmi2")])
def test_pmi_mismatch_refused_before_the_rank_runs(flavour, plugin):
    needed = flavours.get(flavour).srun_mpi
    with pytest.raises(UserError, match=f"srun started the ranks with --mpi={plugin}, but "
                                        f".* needs --mpi={needed}") as err:
        _rank_plan(flavour, plugin)
    hint = err.value.hint
    assert hint.startswith(f"run: srun --mpi={needed} --nodes=2 --ntasks-per-node=2"), hint
    assert f"--mpi {flavour}" in hint


@pytest.mark.parametrize("flavour,plugin", [("mpich", "pmi2"), ("openmpi", "pmix_v4"),
                                            ("intel", "pmi2"), ("mpich", None)])
def test_pmi_matching_plugin_is_planned(flavour, plugin):
    plan = _rank_plan(flavour, plugin)
    assert plan.mode == "rank"
    assert bool(_pmi_warnings(plan)) is (plugin is None)   # --mpi=none: the old warning


def test_pmi_intel_rank_is_pointed_at_slurms_library_or_warned():
    found = pmi.PmiClient(env=(("I_MPI_PMI_LIBRARY", "/usr/lib/x86_64-linux-gnu/libpmi2.so.0"),))
    assert dict(_rank_plan("intel", "pmi2", found).env)["I_MPI_PMI_LIBRARY"] == \
        found.env[0][1]
    missing = pmi.PmiClient(note="Intel MPI under srun --mpi=pmi2 ... this host has none")
    plan = _rank_plan("intel", "pmi2", missing)
    assert "I_MPI_PMI_LIBRARY" not in dict(plan.env) and _pmi_warnings(plan) == (missing.note,)
    assert pmi.client("intel", "pmix", {}, None) == pmi.PmiClient()
    assert pmi.client("mpich", "pmi2", {}, None) == pmi.PmiClient()


# --- for real: each flavour's choice, and a refusal ----------------------------------------

_missing = missing_programs()
needs_slurm = pytest.mark.skipif(bool(_missing), reason="Slurm/munge not installed (missing: "
                                 f"{', '.join(_missing)}; apt-get install slurm-wlm munge)")


@pytest.fixture(scope="module")
def fake_nodes():
    """Two fake nodes n1, n2 with 2 CPUs each (no MASTER_ADDR: the probe needs none)."""
    with LocalCluster(fake_nodes=2, cpus_per_node=2) as cluster:
        yield cluster


def _why_not(flavour: str) -> str | None:
    """One line: why this flavour cannot run under srun here (None: it can)."""
    if flavour not in FLAVOURS:
        return f"{flavour} is not installed (scripts/install.sh)"
    lib = pmi.library_for(flavour, flavours.get(flavour).srun_mpi)
    if lib and pmi.find_library(lib, dict(os.environ), None) is None:
        return pmi.not_found(lib, dict(os.environ), None)
    return None


EXPECTED = {  # flavour -> (plugin hpcai picks, libmpi name marker, PMI client library)
    "openmpi": ("pmix", "libmpi.so.40", "libpmix.so"),
    "mpich": ("pmi2", "libmpich.so.12", None),   # MPICH speaks PMI-2 itself
    "intel": ("pmi2", "impi-rt/lib/libmpi.so.12", "libpmi2.so"),
}


@needs_slurm
@pytest.mark.parametrize("flavour", sorted(EXPECTED))
def test_pmi_chosen_by_hpcai_runs_for_real(flavour, fake_nodes, tmp_path):
    reason = _why_not(flavour)
    if reason:
        pytest.skip(reason)
    tmp_path.chmod(0o755)
    plugin, lib_marker, pmi_marker = EXPECTED[flavour]
    env = job_env(tmp_path / "cache", PYTHONPATH=str(copy_rank_report(tmp_path)),
                  **FLAVOURS[flavour].env)
    launch = ["hpcai-launch", "--mpi", flavour, "--ranks-per-node", "2", "--"]
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/bash\nset -e\n"
                      f"{shlex.join([*launch[:-1], '--dry-run', '--json', '--', *PROBE])} "
                      f"> plan.json\n"
                      f"{shlex.join([*launch, *PROBE, '--quiet', '--out', 'out'])}\n")
    state, log = submit(fake_nodes, script, env, tmp_path, TWO_BY_TWO)
    assert state == "COMPLETED 0:0", f"{state}\n{log}"
    argv = json.loads((tmp_path / "plan.json").read_text())["argv"]
    assert argv[:2] == ["srun", f"--mpi={plugin}"], argv          # hpcai chose the plugin
    records = [json.loads(p.read_text()) for p in sorted((tmp_path / "out").glob("rank-*"))]
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3], log
    assert {r["size"] for r in records} == {4}, "singletons: the wrong PMI plugin"
    assert all(lib_marker in ",".join(r["libmpi"]) for r in records), records
    reports = rank_reports(log)
    assert sorted(reports) == [0, 1, 2, 3], log
    for rank, report in reports.items():
        if pmi_marker:
            assert pmi_marker in report["libpmi"], (rank, report)
        else:
            assert report["libpmi"] == "none", (rank, report)
    assert "Could not open" not in log      # Intel MPI's word for a bad I_MPI_PMI_LIBRARY


@needs_slurm
def test_pmi_mismatch_refused_for_real_and_the_hint_runs(fake_nodes, tmp_path):
    if "mpich" not in FLAVOURS:
        pytest.skip("mpich is not installed (scripts/install.sh)")
    env = job_env(tmp_path / "cache")
    out = tmp_path / "out"
    bad = run(fake_nodes, ["srun", "--mpi=pmix", "-N", "2", "--ntasks-per-node", "2",
                           "hpcai-launch", "--mpi", "mpich", "--ranks-per-node", "2", "--",
                           *PROBE, "--out", str(out)], env, tmp_path)
    assert bad.returncode == 2, (bad.returncode, bad.stdout, bad.stderr)
    err = bad.stderr
    assert "error: srun started the ranks with --mpi=pmix, but MPICH needs --mpi=pmi2" in err
    assert err.count("error: srun started") == 2, err     # local rank 0 of each node speaks
    assert not out.exists(), "the program ran despite the error"
    hint = next(line for line in err.splitlines() if line.startswith("hint: run: "))
    suggested = shlex.split(hint.split("run:", 1)[1])
    assert suggested[:2] == ["srun", "--mpi=pmi2"], suggested
    ok(fake_nodes, suggested, env, tmp_path)
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*"))]
    assert sorted(r["rank"] for r in records) == [0, 1, 2, 3]
    assert {r["size"] for r in records} == {4}
    shutil.rmtree(out)
