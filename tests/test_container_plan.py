"""Golden command lines for ranks in Charliecloud and Singularity, from injected facts."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from hpcai.launcher.containerplan import ContainerFacts, container_env, spec
from hpcai.launcher.containers import wrap
from hpcai.launcher.hostlibs import LibFile
from hpcai.launcher.options import Options
from hpcai.launcher.facts import Facts
from hpcai.launcher.plan import build_plan
from hpcai.launcher.rankenv import RankInfo
from hpcai.launcher.site import SiteProfile
from hpcai.launcher.topology import synthetic

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
    argv = _rank_plan("charliecloud").argv
    assert argv[:3] == ("/usr/bin/ch-run", "--join-ct=4", "--join-tag=hpcai-slurm:4242.0-1")
    assert f"{STAGED}:/opt/hpcai/host" in argv
    assert argv[-6:] == ("/scratch/images/hpcai-bookworm", "--", "python3", "-m",
                         "hpcai.training", "3dgan")


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
