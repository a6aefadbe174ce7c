"""The LRZ path, for real: sbatch -> srun --mpi=pmi2 -> hpcai-launch -> Charliecloud with the
host's Intel MPI bound in, talking to Slurm through Slurm's own libpmi2.

SuperMUC-NG ran 3DGAN this way (``tests/golden/sbatch-lrz-768nodes.sh``). Here the job
script is rendered by ``hpcai-launch sbatch`` with the LRZ site profile
(``tests/data/site-lrz.toml``) reduced to what exists on this machine (no /lrz/sys, no
Omni-Path: Intel MPI's default libfabric provider instead of psm2; 2 cores per node) and
run on the private Slurm, 2 fake nodes with addresses of their own (testbed/netns.py) x 2
ranks. hpcai-launch finds Slurm's libpmi2 on the host, stages a read-only copy with the
host Intel MPI (impi-rt) and points ``I_MPI_PMI_LIBRARY`` at it inside the container. The
job trains a few 3DGAN steps, every rank prints which libmpi and libpmi it mapped
(``testbed/rank_report``), then ``hpcai-launch validate`` runs with the same options (every
check but the speed floor: ``--only``).
"""

from __future__ import annotations

import filecmp
import json
import os
import shlex
from pathlib import Path

import pytest

import netns
from clusterjobs import copy_rank_report, job_env, ok, rank_reports, submit
from conftest import FLAVOURS
from hpcai.launcher.container.containerplan import ContainerFacts, container_env
from hpcai.launcher.container.containers import WORK_MOUNT
from hpcai.launcher.container.hostlibs import LibFile
from hpcai.launcher.job.site import SiteProfile
from hpcai.launcher.mpi import pmi
from localcluster import missing_programs
from test_netns import cluster  # noqa: F401 - the 2-node netns cluster fixture
from test_image import image  # noqa: F401 - the image fixture
from test_image import pytestmark as IMAGE_MARKS

DATA = Path(__file__).parent / "data"
GOLDEN = Path(__file__).parent / "golden"
HOST_LIB = "/opt/hpcai/host/lib"
TRAIN = ["train", "3dgan", "--generate", "16", "--epochs", "1", "--batch-size", "1",
         "--max-steps", "2", "--peak-gflops", "50", "--eval-samples", "0",
         "--validate-events", "0", "--out", "run1"]   # no physics validation: not checked here

_missing = missing_programs()
needs_slurm = pytest.mark.skipif(bool(_missing), reason="Slurm/munge not installed (missing: "
                                 f"{', '.join(_missing)}; apt-get install slurm-wlm munge)")
needs_netns = pytest.mark.skipif(netns.missing() is not None,
                                 reason=f"no network namespaces here: {netns.missing()}")


def test_lrz_profile_leaves_libpmi2_to_hpcai():
    """The profile names no host path for the container: the staged copy is pointed at, and
    without one nothing points at an unbound /usr/lib64 path any more."""
    site = SiteProfile.load(DATA / "site-lrz.toml")
    assert site.pmi == "pmi2" and "I_MPI_PMI_LIBRARY" not in site.env
    staged = LibFile("/usr/lib64/libpmi2.so.0.0.0", "libpmi2.so.0", "pmi", pmi.PMI_SUBDIR)
    facts = ContainerFacts("charliecloud", "/usr/bin/ch-run", "/img", None, None,
                           "/cache/hostlibs/x", (staged,), site)
    assert container_env(facts, {})["I_MPI_PMI_LIBRARY"] == f"{HOST_LIB}/pmi/libpmi2.so.0"
    bare = ContainerFacts("charliecloud", "/usr/bin/ch-run", "/img", None, None, None, (),
                          site)
    assert "I_MPI_PMI_LIBRARY" not in container_env(bare, {})
    script = (GOLDEN / "sbatch-lrz-768nodes.sh").read_text()
    assert "I_MPI_PMI_LIBRARY" not in script and "srun --mpi=pmi2 " in script


def _local_site(path: Path) -> Path:
    """site-lrz.toml with this machine's values where LRZ's cannot exist here."""
    lrz = SiteProfile.load(DATA / "site-lrz.toml")
    env = {k: v for k, v in lrz.env.items() if not k.startswith(("FI_", "PSM2_"))}
    path.write_text(f'name = "{lrz.name}-here"\nmpi_launcher = "{lrz.mpi_launcher}"\n'
                    f'pmi = "{lrz.pmi}"\ncores_per_node = 2\nthreads_per_core = 1\n\n[env]\n'
                    + "".join(f'{k} = "{v}"\n' for k, v in env.items()))
    return path


def _why_intel_cannot_run() -> str | None:
    """One line: why Intel MPI cannot run under srun here (None: it can)."""
    if "intel" not in FLAVOURS:
        return "Intel MPI (impi-rt) is not installed: scripts/install.sh puts it in " \
               ".venv/opt/impi-rt"
    lib = pmi.library_for("intel", "pmi2")
    if pmi.find_library(lib, dict(os.environ), None) is None:
        return f"nothing to bind: {pmi.not_found(lib, dict(os.environ), None)}"
    return None


def _srun_words(script: str) -> str:
    """The srun command of a job script: the words of its ``step=(...)`` array (the script
    plans the step first), else its last line."""
    for line in script.splitlines():
        if line.startswith("step=(") and line.endswith(")"):
            return line[len("step=("):-1]
    return script.strip().splitlines()[-1]


def _shape(line: str) -> list[str]:
    """The options of an srun ... hpcai-launch ... -- line, without their values."""
    tokens = shlex.split(line)
    head = tokens[:tokens.index("--")]
    return [t.split("=")[0] for t in head if t.startswith("-")]


def _marked(*marks):
    def apply(test):
        for mark in marks:
            test = mark(test)
        return test
    return apply


@_marked(pytest.mark.slurm, needs_slurm, needs_netns, *IMAGE_MARKS)
def test_lrz_job_trains_with_host_intel_mpi_in_the_container(cluster, image,  # noqa: F811
                                                            tmp_path):
    reason = _why_intel_cannot_run()
    if reason:
        pytest.skip(f"Intel MPI cannot run under srun here: {reason}")
    tmp_path.chmod(0o755)
    site = _local_site(tmp_path / "site.toml")
    shim = copy_rank_report(tmp_path)
    cache = tmp_path / "cache"
    env = job_env(cache, PYTHONPATH=f"{shim}:{WORK_MOUNT}/{shim.name}",
                  **FLAVOURS["intel"].env)
    options = ["--ranks-per-node", "2", "--mpi", "intel", "--container", str(image),
               "--site", str(site)]
    ok(cluster, ["hpcai-launch", "sbatch", "--nodes", "2", "--threads-per-rank", "1",
                 "--time", "00:15:00", "--script", "job.sh", *options, "--", *TRAIN],
       env, tmp_path)
    job = tmp_path / "job.sh"
    srun = _srun_words(job.read_text())
    golden = _srun_words((GOLDEN / "sbatch-lrz-768nodes.sh").read_text())
    assert _shape(srun) == _shape(golden), (srun, golden)   # the LRZ line, this size
    assert srun.startswith("srun --mpi=pmi2 --nodes=2 --ntasks-per-node=2 --cpus-per-task=1 ")
    with job.open("a") as f:      # validate, for the same options, in the same allocation:
        # every check but the speed floor (tests/test_validate.py's), one launch per side
        f.write(shlex.join(["hpcai-launch", "validate", "--only", "mpi,fabric,binding,gpu",
                            "--json", "validate.json", *options]) + "\n")
    state, log = submit(cluster, job, env, tmp_path, timeout=900)
    assert state == "COMPLETED 0:0", f"{state}\n{log}"
    assert "Could not open" not in log, log     # Intel MPI's word for a bad I_MPI_PMI_LIBRARY

    reports = rank_reports(log)
    assert sorted(reports) == [0, 1, 2, 3], log
    for rank, report in reports.items():
        assert report["host"] == f"n{rank // 2 + 1}", (rank, report)
        assert report["libmpi"] == f"{HOST_LIB}/libmpi.so.12", (rank, report)
        assert report["libpmi"] == f"{HOST_LIB}/pmi/libpmi2.so.0", (rank, report)
    # What was bound is the host's: Intel MPI's libmpi and Slurm's libpmi2, read-only copies.
    staged = [p.parents[2] for p in cache.glob("hostlibs/*/lib/pmi/libpmi2.so.0")]
    assert len(staged) == 1, staged
    host_pmi = pmi.find_library(pmi.library_for("intel", "pmi2"), dict(os.environ), None)
    copy = staged[0] / "lib" / "pmi" / "libpmi2.so.0"
    assert filecmp.cmp(copy, host_pmi, shallow=False) and copy.stat().st_mode & 0o222 == 0
    impi_lib = Path(FLAVOURS["intel"].env["I_MPI_ROOT"]) / "lib" / "libmpi.so.12"
    assert filecmp.cmp(staged[0] / "lib" / "libmpi.so.12", impi_lib, shallow=False)

    record = json.loads((tmp_path / "run1" / "epochs.jsonl").read_text().splitlines()[0])
    prov = record["provenance"]
    assert prov["world_size"] == 4 and prov["hosts"] == ["n1", "n2"], prov
    assert prov["mpi_library_version"].startswith("Intel(R) MPI Library"), prov
    assert prov["libmpi"] == f"{HOST_LIB}/libmpi.so.12", prov

    assert "OK: 4 ranks, one world" in log, log
    report = json.loads((tmp_path / "validate.json").read_text())
    assert report["valid"], report["problems"]
    assert report["not_checked"] == ["speed"] and len(report["bare"]) == 1, report["checks"]
    for launch in report["container"]:          # every trial in the container
        assert all(r["libmpi"] == [f"{HOST_LIB}/libmpi.so.12"]
                   for r in launch["records"]), launch["records"]
