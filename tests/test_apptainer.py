"""``--runtime singularity`` for real: Apptainer (the rig of scripts/build-apptainer-rig.sh)
runs the probe, a 2-rank 3DGAN training and ``validate`` in the image directory built by
charliecloud/build-image.sh, used as a sandbox, with host Open MPI and host MPICH bound in.

Apptainer does not import ``LD_LIBRARY_PATH``; hpcai hands the library paths over with
``--env``. Every rank reports the libmpi it mapped: it must be the staged host copy under
``/opt/hpcai/host/lib``, never the image's own. Binds are proven by writing: under the host
libraries and a ``:ro`` bind a write fails with EROFS, in the output directory it lands.
Select with ``-k apptainer``.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from apptainer_rig import apptainer_rig  # noqa: F401 - fixture
from conftest import FLAVOURS, run
from jobs import end_left, pid_files
from rankcheck import assert_one_world, load_ranks
from test_image import image, image_env, pytestmark  # noqa: F401 - fixture and marks

from hpcai.launcher.container.containers import find_binary, get_runtime

PROGRAMS = Path(__file__).parent / "programs"
HOST_LIB = "/opt/hpcai/host/lib/"
IMAGE_LIBMPI = "/usr/lib/x86_64-linux-gnu/libmpi.so.40"
PROBE = ["python3", "-m", "hpcai.launcher.probe", "--quiet", "--out", "out"]
VERSION = {"openmpi": "Open MPI", "mpich": "MPICH"}
SONAME = {"openmpi": "libmpi.so.40", "mpich": "libmpi.so.12"}


@pytest.fixture(params=["openmpi", "mpich"])
def host_mpi(request):
    if request.param not in FLAVOURS:
        pytest.skip(f"host {request.param} is not installed (run scripts/install.sh)")
    return FLAVOURS[request.param]


def rig_env(rig: Path, **extra: str) -> dict[str, str]:
    """``image_env()`` with the rig's ``singularity`` first on PATH, then ``extra``."""
    env = image_env()
    env["PATH"] = f"{rig}:{env['PATH']}"
    env.update(extra)
    return env


def launch(rig: Path, mpi, *args: str, cwd: Path, command: tuple[str, ...] = (),
           timeout: float = 300, **extra: str):
    """``hpcai-launch [COMMAND] -N 2 --mpi … --runtime singularity ARGS`` with the rig."""
    env = rig_env(rig, **mpi.env, **extra)
    return run(["hpcai-launch", *command, "-N", "2", "--mpi", mpi.name, "--mpirun",
                mpi.launcher, "--runtime", "singularity", *args], env, cwd=cwd,
               timeout=timeout)


def maps_libmpi(rig: Path, image: Path, *args: str, **extra: str) -> str:
    """The libmpi.so.40 that ``dlopen`` maps in a container started with ``args``."""
    code = ("import ctypes\nctypes.CDLL('libmpi.so.40')\n"
            "print(next(l.split()[-1] for l in open('/proc/self/maps') if 'libmpi.so' in l))")
    result = run(["singularity", "exec", *args, str(image), "python3", "-c", code],
                 rig_env(rig, **extra))
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_apptainer_rig_is_the_singularity_hpcai_finds(apptainer_rig):
    env = rig_env(apptainer_rig)
    assert find_binary(get_runtime("singularity"), env["PATH"]) == str(
        apptainer_rig / "singularity")
    result = run(["singularity", "--version"], env)
    assert result.returncode == 0 and result.stdout.startswith("apptainer version "), result


def test_apptainer_runs_the_image_directory_as_a_sandbox(apptainer_rig, image):
    """The Charliecloud image is a plain root file system: Apptainer takes it as it is,
    without converting it and without writing into it."""
    before = sorted(p.name for p in image.iterdir())
    result = run(["singularity", "exec", str(image), "python3", "-c",
                  "import hpcai.launcher.probe, mpi4py; print(open('/etc/debian_version')"
                  ".read().strip())"], rig_env(apptainer_rig))
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("12."), result.stdout
    assert sorted(p.name for p in image.iterdir()) == before


def test_apptainer_drops_ld_library_path_so_hpcai_gives_it_as_env(apptainer_rig, image,
                                                                  tmp_path):
    """The control behind ``--env``: the same bound host libmpi is loaded only when the path
    is given with ``--env``; exported on the host, Apptainer drops it and the image's own
    libmpi loads. The dry runs say so, and the rank's argv carries it."""
    if "openmpi" not in FLAVOURS:
        pytest.skip("needs host Open MPI")
    staged = tmp_path / "staged"
    (staged / "lib").mkdir(parents=True)
    shutil.copy(Path(IMAGE_LIBMPI).resolve(), staged / "lib" / "libmpi.so.40")
    bind = ["-B", f"{staged}:/opt/hpcai/host:ro"]
    dropped = maps_libmpi(apptainer_rig, image, *bind, LD_LIBRARY_PATH=HOST_LIB)
    assert dropped.startswith(IMAGE_LIBMPI), dropped
    given = maps_libmpi(apptainer_rig, image, *bind, "--env", f"LD_LIBRARY_PATH={HOST_LIB}")
    assert given == HOST_LIB + "libmpi.so.40"

    env = rig_env(apptainer_rig)
    outer = run(["hpcai-launch", "-N", "2", "--runtime", "singularity", "--container",
                 str(image), "--dry-run", "--", *PROBE], env, cwd=tmp_path)
    assert outer.returncode == 0, outer.stderr
    assert ("LD_LIBRARY_PATH, FI_PROVIDER_PATH, UCX_MODULE_DIR, MPI4PY_MPIABI, "
            "OMPI_MCA_mca_base_component_path: given as --env NAME=VALUE") in outer.stdout
    rank_env = dict(env, OMPI_COMM_WORLD_RANK="0", OMPI_COMM_WORLD_SIZE="2",
                    OMPI_COMM_WORLD_LOCAL_RANK="0", OMPI_COMM_WORLD_LOCAL_SIZE="2")
    rank = run(["hpcai-launch", "--ranks-per-node", "2", "--runtime", "singularity",
                "--container", str(image), "--host-libs", str(staged), "--dry-run", "--json",
                "--", *PROBE], rank_env, cwd=tmp_path)
    assert rank.returncode == 0, rank.stderr
    argv = json.loads(rank.stdout)["argv"]
    assert argv[:2] == [str(apptainer_rig / "singularity"), "exec"], argv
    given_env = [argv[i + 1] for i, arg in enumerate(argv) if arg == "--env"]
    assert "LD_LIBRARY_PATH=/opt/hpcai/host/lib" in given_env, argv
    assert f"{staged}:/opt/hpcai/host:ro" in argv and "--containall" not in argv


def test_apptainer_probe_loads_the_host_mpi(apptainer_rig, image, host_mpi, tmp_path):
    result = launch(apptainer_rig, host_mpi, "--container", str(image), "--report-bindings",
                    "--", *PROBE, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = load_ranks(tmp_path / "out")
    assert_one_world(records, 2)
    for r in records:
        assert r["libmpi"] == [HOST_LIB + SONAME[host_mpi.name]], (r["rank"], r["libmpi"])
        assert VERSION[host_mpi.name] in r["mpi_library_version"], r["mpi_library_version"]


WRITES = '''
import errno, json, os, sys
from mpi4py import MPI   # one world: no rank ends before its peers have started

def attempt(action):
    try:
        action()
        return "written"
    except OSError as exc:
        return errno.errorcode.get(exc.errno, str(exc.errno))

def append(path):
    with open(path, "ab") as f:
        f.write(b"x")

rank = MPI.COMM_WORLD.Get_rank()
lib = "/opt/hpcai/host/lib/libmpi.so.40"
result = {
    "host library": attempt(lambda: append(lib)),
    "host library chmod": attempt(lambda: os.chmod(lib, 0o644)),
    "new file under host": attempt(lambda: append(f"/opt/hpcai/host/new-{rank}")),
    "ro bind": attempt(lambda: append(f"/opt/hpcai/data/new-{rank}")),
    "output": attempt(lambda: append(f"/opt/hpcai/out/rank-{rank}.txt")),
    "work": attempt(lambda: append(f"/opt/hpcai/work/work-{rank}.txt")),
}
results = MPI.COMM_WORLD.gather(result)   # rank 0 prints them all: no interleaved output
if rank == 0:
    print("writes", json.dumps(results), flush=True)
'''


def test_apptainer_host_libraries_read_only_output_writable(apptainer_rig, image, tmp_path):
    """issue 12 item 5, Singularity half: every read-only bind refuses a write (EROFS), the
    output directory and the launch directory take one."""
    if "openmpi" not in FLAVOURS:
        pytest.skip("needs host Open MPI")
    (tmp_path / "writes.py").write_text(WRITES)
    out, data = tmp_path / "out", tmp_path / "data"
    out.mkdir()
    data.mkdir()
    cache = tmp_path / "cache"   # a private staging directory: the shared one stays untouched
    result = launch(apptainer_rig, FLAVOURS["openmpi"], "--container", str(image),
                    "--bind", f"{out}:/opt/hpcai/out", "--bind", f"{data}:/opt/hpcai/data:ro",
                    "--", "python3", "writes.py", cwd=tmp_path, HPCAI_CACHE=str(cache))
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("writes ")]
    assert len(lines) == 1, result.stdout
    results = json.loads(lines[0][len("writes "):])
    assert len(results) == 2, results
    for r in results:
        assert r == {"host library": "EROFS", "host library chmod": "EROFS",
                     "new file under host": "EROFS", "ro bind": "EROFS",
                     "output": "written", "work": "written"}, r
    assert sorted(p.name for p in out.iterdir()) == ["rank-0.txt", "rank-1.txt"]
    assert sorted(p.name for p in tmp_path.glob("work-*.txt")) == ["work-0.txt", "work-1.txt"]
    assert not any(data.iterdir())
    staged = next(cache.glob("hostlibs/*/lib/libmpi.so.40"))
    host = Path(IMAGE_LIBMPI).resolve()   # the host's file at the image's path
    assert hashlib.sha256(staged.read_bytes()).digest() == \
        hashlib.sha256(host.read_bytes()).digest()
    assert staged.stat().st_mode & 0o777 == 0o444


def _site(tmp_path: Path, work_mode: str) -> Path:
    """An LRZ-shaped site profile: a system tree read-only, the work file system as given."""
    (tmp_path / "sys").mkdir()
    (tmp_path / "work").mkdir()
    site = tmp_path / "site.toml"
    site.write_text(f'name = "lrz-shaped"\nbinds = ["{tmp_path}/sys:/lrz/sys", '
                    f'"{tmp_path}/work:/hppfs/work{work_mode}"]\n')
    return site


# The GEMM probe, the evaluation and the physics validation are not what these tests check
# (tests/test_training.py, tests/test_physics.py): skipped, as --peak-gflops 50,
# --eval-samples 0 and --validate-events 0 say.
TRAIN = ["train", "3dgan", "--generate", "16", "--epochs", "1", "--batch-size", "1",
         "--max-steps", "2", "--peak-gflops", "50", "--eval-samples", "0",
         "--validate-events", "0", "--out", "/hppfs/work/run1"]


def test_apptainer_trains_3dgan_with_host_mpi(apptainer_rig, image, host_mpi, tmp_path):
    """Two ranks train two 3DGAN steps in Apptainer, writing into the site's work tree
    (bound ``:rw`` as in tests/data/site-lrz.toml); every rank maps the host libmpi."""
    site = _site(tmp_path, ":rw")
    shutil.copy(PROGRAMS / "report_libmpi.py", tmp_path)
    result = launch(apptainer_rig, host_mpi, "--site", str(site), "--container", str(image),
                    "--", "python3", "report_libmpi.py", "/usr/local/bin/train", *TRAIN[1:],
                    cwd=tmp_path, timeout=600)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    mapped = sorted(line for line in result.stdout.splitlines()
                    if line.startswith("libmpi-mapped"))
    lib = HOST_LIB + SONAME[host_mpi.name]
    assert mapped == [f"libmpi-mapped rank={r} path={lib}" for r in (0, 1)], result.stdout
    epochs = [json.loads(line) for line in
              (tmp_path / "work" / "run1" / "epochs.jsonl").read_text().splitlines()]
    assert len(epochs) == 1 and epochs[0]["steps"] == 2, epochs
    provenance = epochs[0]["provenance"]
    assert provenance["world_size"] == 2 and provenance["libmpi"] == lib, provenance
    assert VERSION[host_mpi.name] in provenance["mpi_library_version"]


def test_a_rank_failing_in_apptainer_ends_the_job(apptainer_rig, image, host_mpi, tmp_path):
    """Rank 1's command fails in its container before MPI starts while rank 0 waits in
    ``MPI_Init``: the job ends within seconds with rank 1's status and no rank is left
    (tests/test_rankwatch.py has the bare launchers as controls). Under MPICH's Hydra the
    rank wrapper aborts the job and names the rank; Open MPI's mpirun ends it itself."""
    shutil.copy(PROGRAMS / "fail_before_mpi.py", tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    result = launch(apptainer_rig, host_mpi, "--container", str(image), "--", "python3",
                    "fail_before_mpi.py", "out", "--mpi", cwd=tmp_path, timeout=120)
    text = result.stdout + result.stderr
    pids = pid_files(out)
    left = end_left(pids, wait_s=10)    # the launcher may exit while its kills are under way
    assert result.returncode == 3, text[-3000:]
    assert len(pids) == 2 and not left, (pids, left, text[-3000:])
    named = "error: rank 1 of 2 on " in text and "aborts the job" in text
    assert named == (host_mpi.name == "mpich"), text[-3000:]


@pytest.mark.parametrize("work", ["read-only site bind", "not bound"])
def test_apptainer_output_outside_a_writable_bind_is_refused(apptainer_rig, image, tmp_path,
                                                             work):
    """The controls behind the regenerated Singularity goldens: the output directory in a
    site bind without ``:rw`` (container-rank-singularity.json had that), or in no bind at
    all (sbatch-singularity.sh had that: it lies in the read-only image), is not writable,
    and training stops before the first step."""
    if "openmpi" not in FLAVOURS:
        pytest.skip("needs host Open MPI")
    site = ["--site", str(_site(tmp_path, ""))] if work == "read-only site bind" else []
    mpi = FLAVOURS["openmpi"]
    result = run(["hpcai-launch", "-N", "1", "--mpi", "openmpi", "--mpirun", mpi.launcher,
                  "--runtime", "singularity", *site, "--container", str(image), "--", *TRAIN],
                 rig_env(apptainer_rig), cwd=tmp_path, timeout=300)
    assert result.returncode != 0
    where = "/hppfs/work" if site else "/"
    assert (f"error: output directory /hppfs/work/run1 is not writable (cannot write in "
            f"{where}: Read-only file system)") in result.stderr, result.stderr[-2000:]
    assert not (tmp_path / "work").exists() or not any((tmp_path / "work").iterdir())


def test_apptainer_validate_passes_with_host_mpi(apptainer_rig, image, host_mpi, tmp_path):
    report = tmp_path / "report.json"
    # The bandwidth floor is not what this checks (validate's own tests do): this 2-core VM
    # is shared, and its container/host ratio wandered 0.31-1.57 here between runs. Every
    # other check runs: one launch per side.
    result = launch(apptainer_rig, host_mpi, "--only", "mpi,fabric,binding,gpu", "--json",
                    str(report), "--container", str(image), command=("validate",),
                    cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    lib = HOST_LIB + SONAME[host_mpi.name]
    assert "OK: 2 ranks" in result.stdout, result.stdout
    data = json.loads(report.read_text())
    assert data["valid"] and data["verdict"] == "OK"
    assert data["not_checked"] == ["speed"] and len(data["bare"]) == 1, data["not_checked"]
    for launch_ in data["container"]:        # every trial in the container
        records = launch_["records"]
        assert len(records) == 2 and all(r["libmpi"] == [lib] for r in records), records
