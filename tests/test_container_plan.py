"""Golden command lines for ranks in Charliecloud and Singularity, from injected facts; which
mounts the read-only helper remounts."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from hpcai.core.errors import UserError
from hpcai.launcher.container.containerplan import (
    ContainerFacts, container_env, image_has_module, spec)
from hpcai.launcher.container.containers import wrap
from hpcai.launcher.container.hostlibs import LibFile
from hpcai.launcher.planning.options import Options
from hpcai.launcher.readonly import to_remount
from hpcai.launcher.planning.facts import Facts
from hpcai.launcher.mpi.flavours import OPENMPI, MpiInstall
from hpcai.launcher.planning.plan import build_plan
from hpcai.launcher.job.rankenv import RankInfo
from hpcai.launcher.job.site import SiteProfile
from hpcai.launcher.node.topology import synthetic

GOLDEN = Path(__file__).parent / "golden"
STAGED = "/home/user/.cache/hpcai/hostlibs/0123abcd"
LIBS = (
    LibFile("/opt/intel/mpi/lib/release/libmpi.so.12.0.0", "libmpi.so.12", "mpi"),
    LibFile("/opt/intel/mpi/libfabric/lib/libfabric.so.1.18.0", "libfabric.so.1", "fabric"),
    LibFile("/opt/intel/mpi/libfabric/lib/prov/libpsmx2-fi.so", "libpsmx2-fi.so", "fabric",
            "libfabric"),
    LibFile("/usr/lib64/libpsm2.so.2.2", "libpsm2.so.2", "fabric"),
    LibFile("/usr/lib64/libpmi2.so.0.0.0", "libpmi2.so.0", "pmi", "pmi"),   # Slurm's, for srun
)
OPENMPI_INSTALL = MpiInstall(OPENMPI, "/usr/bin/mpirun", "4.1.4", "/usr/lib", "test")
SITE = SiteProfile.load(Path(__file__).parent / "data" / "site-lrz.toml")


def _facts(runtime: str) -> ContainerFacts:
    binary = {"charliecloud": "/usr/bin/ch-run", "singularity": "/usr/bin/singularity"}[runtime]
    image = {"charliecloud": "/scratch/images/hpcai-bookworm",
             "singularity": "/scratch/images/hpcai.sif"}[runtime]
    return ContainerFacts(runtime=runtime, binary=binary, image=image, image_info=None,
                          host_mpi=None, staged=STAGED, libs=LIBS, site=SITE,
                          checks=("test",))


def _rank_plan(runtime: str):
    info = RankInfo(rank=5, size=3072, local_rank=1, local_size=4, node_rank=1,
                    started_by="slurm", job_key="slurm:4242.0", nodes=("i01r01c01s01",))
    facts = Facts(env={"PATH": "/usr/bin", "LD_LIBRARY_PATH": "/lrz/sys/lib"},
                  topology=synthetic("pack:2 numa:2 core:12 pu:2"), hostname="i01r01c01s02",
                  self_argv=("hpcai-launch",), command_path=None, rank=info,
                  container=_facts(runtime), cwd="/home/user/run")
    options = Options(command=("python3", "-m", "hpcai.training", "3dgan"), ranks_per_node=4,
                      container=facts.container.image, runtime=runtime,
                      binds=("/scratch/ecal:/opt/hpcai/data:ro",))
    return build_plan(options, facts)


@pytest.mark.parametrize("runtime", ["charliecloud", "singularity"])
def test_rank_command_line_matches_golden(runtime):
    plan = _rank_plan(runtime)
    data = {"argv": list(plan.argv), "env": {k: v for k, v in plan.env
                                             if not k.startswith(("OMP_", "KMP_", "MKL_",
                                                                  "TF_", "HPCAI_"))}}
    text = json.dumps(data, indent=1) + "\n"
    path = GOLDEN / f"container-rank-{runtime}.json"
    if os.environ.get("HPCAI_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


def test_charliecloud_joins_ranks_of_a_node_and_binds_host_libs_read_only():
    """ch-run -b is read-write: the read-only helper runs first, with ch-run's join (one
    namespace for the ranks of a node), every read-only target (host libraries, site trees,
    the user's :ro) and the read-write ones to keep."""
    argv = _rank_plan("charliecloud").argv
    assert argv[:3] == ("/usr/bin/ch-run", "--join-ct=4", "--join-tag=hpcai-slurm:4242.0-1")
    assert f"{STAGED}:/opt/hpcai/host" in argv
    image = argv.index("/scratch/images/hpcai-bookworm")
    assert argv[image:] == ("/scratch/images/hpcai-bookworm", "--",
                            "python3", "-m", "hpcai.launcher.readonly",
                            "--join-tag", "hpcai-slurm:4242.0-1", "--join-ct", "4",
                            "--rw", "/opt/hpcai/work", "--rw", "/hppfs/work",
                            "/opt/hpcai/host", "/lrz/sys/", "/opt/hpcai/data",
                            "--", "python3", "-m", "hpcai.training", "3dgan")


def test_charliecloud_without_read_only_binds_runs_no_helper():
    facts = replace(_facts("charliecloud"), staged=None, site=None)
    argv = wrap(spec(facts, ("/scratch/out:/out",), "/w", {}), ("true",))
    assert "hpcai.launcher.readonly" not in argv
    assert argv[-3:] == ["/scratch/images/hpcai-bookworm", "--", "true"]


def test_singularity_read_only_is_the_bind_suffix_and_no_helper():
    argv = _rank_plan("singularity").argv
    assert "hpcai.launcher.readonly" not in argv
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "-B"]
    assert binds == [f"{STAGED}:/opt/hpcai/host:ro", "/home/user/run:/opt/hpcai/work",
                     "/lrz/sys/:/lrz/sys/:ro", "/hppfs/work:/hppfs/work",
                     "/scratch/ecal:/opt/hpcai/data:ro"]


@pytest.mark.parametrize("binds, staged, refused", [
    (("/scratch/ecal:/data:ro",), None, "/data"),
    ((), STAGED, "/opt/hpcai/host"),
    (("/scratch/out:/out", "/scratch/ecal:/data:rw"), None, None),
])
def test_read_only_bind_is_refused_when_the_image_lacks_the_helper(binds, staged, refused):
    """Never drop :ro: without the helper in the image, a read-only bind is an error before
    any rank starts (build_plan in the outer launcher), and a read-write one is not."""
    container = replace(_facts("charliecloud"), staged=staged, site=None, has_helper=False)
    facts = Facts(env={"PATH": "/usr/bin"}, topology=synthetic("core:4"), hostname="n1",
                  self_argv=("hpcai-launch",), command_path=None, container=container,
                  cwd="/home/user/run", mpi=OPENMPI_INSTALL)
    options = Options(command=("python3", "-V"), ranks_per_node=2, container=container.image,
                      binds=binds)
    if refused is None:
        assert build_plan(options, facts).mode == "mpirun"
        return
    with pytest.raises(UserError) as err:
        build_plan(options, facts)
    assert "binds read-write" in err.value.message and refused in err.value.message
    assert "build-image.sh" in err.value.hint and "rw" in err.value.hint


def test_image_has_module_looks_in_the_images_python(tmp_path):
    assert not image_has_module(str(tmp_path), "hpcai.launcher.readonly")
    (tmp_path / "usr" / "bin").mkdir(parents=True)
    (tmp_path / "usr" / "bin" / "python3").write_text("")
    (tmp_path / "usr" / "bin" / "python3").chmod(0o755)
    module = tmp_path / "usr/local/lib/python3.11/dist-packages/hpcai/launcher/readonly.py"
    module.parent.mkdir(parents=True)
    assert not image_has_module(str(tmp_path), "hpcai.launcher.readonly")
    module.write_text("")
    assert image_has_module(str(tmp_path), "hpcai.launcher.readonly")
    assert image_has_module(str(tmp_path / "image.sqfs"), "hpcai.launcher.readonly")


def test_singularity_gets_library_path_explicitly_and_never_containall():
    argv = _rank_plan("singularity").argv
    assert argv[:2] == ("/usr/bin/singularity", "exec")
    assert "--containall" not in argv and "-C" not in argv
    assert f"{STAGED}:/opt/hpcai/host:ro" in argv
    env_args = [argv[i + 1] for i, a in enumerate(argv) if a == "--env"]
    assert "LD_LIBRARY_PATH=/opt/hpcai/host/lib:/lrz/sys/lib" in env_args
    assert "FI_PROVIDER_PATH=/opt/hpcai/host/lib/libfabric" in env_args
    assert "MPI4PY_MPIABI=mpich" in env_args


def test_container_env_points_inside_and_carries_the_site_env():
    env = container_env(_facts("charliecloud"), {"LD_LIBRARY_PATH": "/x"})
    assert env["LD_LIBRARY_PATH"] == "/opt/hpcai/host/lib:/x"
    assert env["FI_PROVIDER_PATH"] == "/opt/hpcai/host/lib/libfabric"
    for key, value in SITE.env.items():
        assert env[key] == value
    s = spec(_facts("charliecloud"), (), "/home/user/run", {})
    assert [b.target for b in s.binds][:2] == ["/opt/hpcai/host", "/opt/hpcai/work"]
    assert s.binds[0].read_only


def test_wrap_without_join_for_a_single_rank():
    s = spec(_facts("charliecloud"), (), "/w", {})
    assert "--join-ct=1" not in wrap(s, ("true",), join_ct=1)


def test_to_remount_takes_submounts_but_leaves_read_write_binds_inside():
    points = ["/", "/opt/hpcai/host", "/data", "/data/sub", "/data/out", "/data/out/x",
              "/database"]
    assert to_remount(["/data"], ["/data/out", "/opt/hpcai/work"], points) == [
        "/data", "/data/sub"]
    assert to_remount(["/opt/hpcai/host", "/data"], [], points) == [
        "/opt/hpcai/host", "/data", "/data/sub", "/data/out", "/data/out/x"]
    # a read-only bind inside a read-write one inside a read-only one
    assert to_remount(["/data", "/data/out/x"], ["/data/out"], points) == [
        "/data", "/data/sub", "/data/out/x"]
