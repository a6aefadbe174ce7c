"""Ranks in Charliecloud with the HOST's MPI bound in, for real: mpirun, srun, validate.

Every rank asks the dynamic linker (``dladdr``) inside the container which file defines
``MPI_Init``: the libmpi it really uses must come from the bound host directory
(``/opt/hpcai/host/lib``), for host Open MPI, Intel MPI (impi-rt) and MPICH, into the image
built by ``charliecloud/build-image.sh``.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import FLAVOURS, run
from fakeimages import fake_image as _fake_image
from fakeimages import startup_image
from rankcheck import assert_one_world, load_ranks
from test_image import image, image_env, pytestmark  # noqa: F401 - fixture and marks
from validate_controls import HEALTHY, shared_scenario

PROBE = ["python3", "-m", "hpcai.launcher.probe", "--quiet", "--out", "out"]
HOST_LIB = "/opt/hpcai/host/lib/"


def test_host_mpi_is_what_every_rank_loads(image, mpi, tmp_path):
    env = image_env(**mpi.env)
    result = run(["hpcai-launch", "-N", "2", "--mpi", mpi.name, "--mpirun", mpi.launcher,
                  "--container", str(image), "--report-bindings", "--", *PROBE], env,
                 cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = load_ranks(tmp_path / "out")
    assert_one_world(records, 2)
    for r in records:
        assert len(r["libmpi"]) == 1 and r["libmpi"][0].startswith(HOST_LIB), r["libmpi"]
    expected = {"openmpi": "Open MPI", "mpich": "MPICH", "intel": "Intel(R) MPI"}[mpi.name]
    assert expected in records[0]["mpi_library_version"]


def test_dry_run_shows_checks_and_bound_libraries(image, tmp_path):
    """--dry-run names the staging directory but copies nothing; a real run stages it."""
    env = image_env(HPCAI_CACHE=str(tmp_path / "cache"))
    result = run(["hpcai-launch", "-N", "2", "--container", str(image), "--dry-run", "--json",
                  "--", *PROBE], env, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "cache").exists(), "a dry run must not write into the cache"
    text = run(["hpcai-launch", "-N", "2", "--container", str(image), "--dry-run", "--",
                *PROBE], env, cwd=tmp_path).stdout
    assert "to be staged in (dry run: not copied)" in text and "read-write" in text, text
    real = run(["hpcai-launch", "-N", "2", "--container", str(image), "--", *PROBE], env,
               cwd=tmp_path)
    assert real.returncode == 0, real.stderr[-3000:]
    plan = json.loads(result.stdout)
    container = plan["container"]
    assert container["runtime"] == "charliecloud"
    assert any(c.startswith("ABI: host openmpi") for c in container["checks"])
    assert any("glibc" in c for c in container["checks"])
    assert any(lib.startswith("libmpi.so.40 <- ") for lib in container["bound_libraries"])
    assert "--host-libs" in plan["argv"]
    staged = Path(plan["argv"][plan["argv"].index("--host-libs") + 1])
    assert (staged / "lib" / "libmpi.so.40").is_file()
    assert (staged / "lib" / "libmpi.so.40").stat().st_mode & 0o222 == 0   # read-only copy


def test_a_job_without_user_gives_ch_run_the_uids_name(image, tmp_path):
    """ch-run refuses to start without $USER (the control: ch-run alone fails, saying so).
    hpcai-launch gives the ranks the uid's login name, and keeps a USER the job has."""
    import os
    import pwd

    env = image_env()
    env.pop("USER")
    bare = run(["ch-run", str(image), "--", "true"], env, cwd=tmp_path)
    assert bare.returncode != 0 and "USER not set" in bare.stderr, bare.stderr
    show = ["hpcai-launch", "-N", "1", "--container", str(image), "--", "sh", "-c",
            'echo "user=$USER"']
    ours = run(show, env, cwd=tmp_path)
    assert ours.returncode == 0, ours.stderr[-2000:]
    assert f"user={pwd.getpwuid(os.getuid()).pw_name}" in ours.stdout, ours.stdout
    kept = run(show, {**env, "USER": "hpcai-test-user"}, cwd=tmp_path)
    assert kept.returncode == 0 and "user=hpcai-test-user" in kept.stdout, kept.stdout


def test_mpi_family_mismatch_is_refused_before_launch(tmp_path):
    if "openmpi" not in FLAVOURS:
        pytest.skip("needs host Open MPI")
    fake = _fake_image(tmp_path / "img", "mpich", "libmpi.so.12")
    result = run(["hpcai-launch", "-N", "2", "--mpi", "openmpi", "--container", str(fake),
                  "--", *PROBE], image_env(), cwd=tmp_path)
    assert result.returncode == 2
    assert "error: ABI mismatch" in result.stderr and "hint:" in result.stderr
    assert "libmpi.so.40" in result.stderr and "libmpi.so.12" in result.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", ["missing-image", "missing-mount-point", "no-runtime"])
def test_container_preflight_errors(case, image, tmp_path):
    env = image_env()
    target = str(image)
    if case == "missing-image":
        target = str(tmp_path / "nope")
    elif case == "missing-mount-point":
        fake = _fake_image(tmp_path / "img", "openmpi", "libmpi.so.40")
        shutil.rmtree(fake / "opt" / "hpcai" / "host")
        target = str(fake)
    else:
        env["PATH"] = str(Path(shutil.which("hpcai-launch")).parent) + ":/usr/local/bin"
    result = run(["hpcai-launch", "-N", "2", "--container", target, "--", *PROBE], env,
                 cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("error: ") and "hint: " in result.stderr
    assert not (tmp_path / "out").exists()


def test_validate_passes_with_host_mpi_and_fails_without(image, tmp_path_factory):
    """The negative controls are in tests/test_validate.py; this is the pair in short: its
    healthy and image-mpi runs (``validate --container IMG -N 2``, the same with
    ``--no-bind-host-mpi``), run once per test run for both files."""
    def scenario(name: str):
        return shared_scenario(name, image, image_env(), tmp_path_factory)

    good = scenario(HEALTHY)
    assert good.code == 0, good.stdout + good.stderr[-3000:]
    assert "OK: 2 ranks" in good.stdout and "/opt/hpcai/host/lib/libmpi.so.40" in good.stdout
    data = good.report
    assert data["valid"] and data["verdict"] == "OK"
    n = data["trials_run"]       # 5, or 15 where a size's first five split around the floor
    assert n in (5, 15) and bool(data["extended"]) == (n == 15), data["extended"]
    assert [len(r["records"]) for r in data["container"]] == [2] * n
    assert [len(r["records"]) for r in data["bare"]] == [2] * n
    assert [s["nbytes"] for s in data["sizes"]] == [8, 64 << 10, 4 << 20]
    bad = scenario("image-mpi")
    assert bad.code == 1
    assert "not from /opt/hpcai/host (the plan binds no host MPI: --no-bind-host-mpi)" \
        in bad.stdout, bad.stdout
    assert not bad.report["valid"]


def test_srun_starts_containerised_ranks_with_host_mpi(image, tmp_path):
    from localcluster import LocalCluster

    if not shutil.which("slurmctld"):
        pytest.skip("Slurm not installed")
    with LocalCluster() as cluster:
        env = image_env(**cluster.env)
        result = subprocess.run(
            ["srun", "--mpi=pmix", "--ntasks-per-node=2", "hpcai-launch", "--ranks-per-node",
             "2", "--container", str(image), "--", *PROBE], env=env, cwd=tmp_path,
            capture_output=True, text=True, timeout=180, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    records = load_ranks(tmp_path / "out")
    assert_one_world(records, 2)
    assert all(r["libmpi"][0].startswith(HOST_LIB) for r in records)


def _horovod_in(image: Path) -> bool:
    manifest = json.loads((image / "opt" / "hpcai" / "manifest.json").read_text())
    return bool(manifest["packages"].get("horovod"))


def _copy_programs(tmp_path: Path) -> list[str]:
    """The unmodified Horovod script and the wrapper that reports the mapped libmpi, copied
    into the working directory (bound into the container at /opt/hpcai/work)."""
    programs = Path(__file__).parent / "programs"
    for name in ("report_libmpi.py", "horovod_synthetic_benchmark.py"):
        shutil.copy(programs / name, tmp_path / name)
    return ["python3", "report_libmpi.py", "horovod_synthetic_benchmark.py", "--num-iters", "2"]


def _check_horovod_on_host_mpi(stdout: str) -> None:
    from test_horovod import check_consistent_world

    check_consistent_world(stdout, 2)
    mapped = dict(re.findall(r"libmpi-mapped rank=(\d+) path=(\S+?)(?=libmpi-mapped|\s|$)",
                             stdout))
    assert sorted(mapped) == ["0", "1"], stdout
    assert all(p == f"{HOST_LIB}libmpi.so.40" for p in mapped.values()), mapped


@pytest.mark.parametrize("launcher", ["mpirun", "srun"])
def test_unmodified_horovod_script_in_container_uses_host_mpi(launcher, image, tmp_path):
    """Horovod installed in the image (its wheel from scripts/build-horovod.sh) runs on the
    host's Open MPI bound in: every worker sees size 2, replicas agree, and the libmpi it
    mapped is /opt/hpcai/host/lib/libmpi.so.40."""
    if not _horovod_in(image):
        pytest.skip("the image has no Horovod: run scripts/build-horovod.sh, then the image "
                    "build picks up its wheel")
    command = _copy_programs(tmp_path)
    if launcher == "mpirun":
        result = run(["hpcai-launch", "-N", "2", "--container", str(image), "--", *command],
                     image_env(), cwd=tmp_path, timeout=300)
    else:
        from localcluster import LocalCluster

        if not shutil.which("slurmctld"):
            pytest.skip("Slurm not installed")
        with LocalCluster() as cluster:
            result = subprocess.run(
                ["srun", "--mpi=pmix", "--ntasks-per-node=2", "hpcai-launch",
                 "--ranks-per-node", "2", "--container", str(image), "--", *command],
                env=image_env(**cluster.env), cwd=tmp_path, capture_output=True, text=True,
                timeout=300, check=False)
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr[-3000:]}"
    _check_horovod_on_host_mpi(result.stdout)


def test_mpirun_sweep_point_runs_in_the_container(image, tmp_path):
    """A sweep point without a scheduler runs what the same options run by hand: in the
    image, with the host's MPI bound in (the sweep used to drop --container, --mpi, --site,
    --bind and --oversubscribe and trained on the host)."""
    if "openmpi" not in FLAVOURS:
        pytest.skip("needs host Open MPI")
    results, cache = tmp_path / "results", tmp_path / "cache"
    result = run(["hpcai-launch", "sweep", "--launcher", "mpirun", "--nodes", "1",
                  "--ranks-per-node", "2", "--threads-per-rank", "1", "--mpi", "openmpi",
                  "--container", str(image), "--bind", str(tmp_path), "--results",
                  str(results), "--", "train", "resnet-tiny", "--image-size", "32",
                  "--classes", "10", "--samples", "32", "--batch-size", "4", "--epochs", "1",
                  "--peak-gflops", "50"], image_env(HPCAI_CACHE=str(cache)), cwd=tmp_path,
                 timeout=600)
    point = results / "N1-R2-T1-rep0"
    log = (point / "run.log").read_text() if (point / "run.log").exists() else ""
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:] + log[-3000:]
    assert json.loads((point / "point.json").read_text())["status"] == "done", log[-3000:]
    record = json.loads((point / "epochs.jsonl").read_text().splitlines()[0])
    libmpi = record["provenance"]["libmpi"]
    assert libmpi and libmpi.startswith(HOST_LIB), libmpi    # in the image, host MPI bound
    assert record["provenance"]["world_size"] == 2
    # the ranks in the image counted the model's FLOPs into the host's cache (bound at
    # /opt/hpcai/cache/flops), so the next start, bare or in the image, reads the count
    counts = [json.loads(f.read_text()) for f in (cache / "flops").glob("*.json")]
    assert len(counts) == 1 and counts[0]["flops_per_sample"] > 0, counts


def test_flop_counts_are_not_bound_into_an_image_without_the_mount_point(image, tmp_path):
    """The control of the bind above: an image without /opt/hpcai/cache/flops gets no bind
    (ch-run cannot bind onto a missing directory), and the plan says counts are not kept."""
    plans = {}
    for name, img in (("built", image),
                      ("bare", startup_image(tmp_path / "img"))):
        out = run(["hpcai-launch", "-N", "2", "--container", str(img), "--dry-run", "--json",
                   "--", *PROBE], image_env(HPCAI_CACHE=str(tmp_path / "cache")), cwd=tmp_path)
        assert out.returncode == 0, out.stderr[-3000:]
        plans[name] = json.loads(out.stdout)["container"]
    assert plans["built"]["flop_cache"] == str(tmp_path / "cache" / "flops")
    assert plans["bare"]["flop_cache"] is None
    assert any(c.startswith("FLOP counts: counted at every start")
               for c in plans["bare"]["checks"]), plans["bare"]["checks"]
    assert not (tmp_path / "cache").exists(), "a dry run must not make the cache"
