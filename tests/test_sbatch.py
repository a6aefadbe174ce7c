"""Slurm job scripts: golden files per runtime and for the LRZ run, and bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from conftest import base_env, run
from hpcai.core.errors import UserError
from hpcai.launcher.batch.sbatch import JobSpec, render
from hpcai.launcher.job.site import SiteProfile
from hpcai.launcher.batch.sweep import parse_counts, plan_points

GOLDEN = Path(__file__).parent / "golden"
LRZ = Path(__file__).parent / "data" / "site-lrz.toml"
TRAIN = ("train", "3dgan", "--data", "/hppfs/work/ecal", "--epochs", "2", "--batch-size", "16",
         "--out", "/hppfs/work/run1")

SPECS = {
    "bare": JobSpec(command=TRAIN, nodes=4, ranks_per_node=2, threads_per_rank=12,
                    time="02:00:00", partition="general", account="pn68xi", mpi="openmpi"),
    "charliecloud": JobSpec(command=TRAIN, nodes=2, ranks_per_node=4, threads_per_rank=12,
                            mpi="openmpi", container="/scratch/images/hpcai-bookworm",
                            binds=("/hppfs/work",)),
    "singularity": JobSpec(command=TRAIN, nodes=2, ranks_per_node=4, threads_per_rank=12,
                           mpi="mpich", container="/scratch/images/hpcai.sif",
                           runtime="singularity", binds=("/hppfs/work",), partition="test",
                           job_name="3dgan 'quoted' name"),
    "lrz-768nodes": JobSpec(command=TRAIN, nodes=768, ranks_per_node=4, threads_per_rank=12,
                            time="00:30:00", partition="general", account="pn68xi",
                            mpi="intel", container="/hppfs/work/images/hpcai-bookworm",
                            site=SiteProfile.load(LRZ), site_path="/lrz/sys/hpcai/lrz.toml",
                            launcher="srun"),
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_job_script_matches_golden(name):
    text = render(SPECS[name])
    path = GOLDEN / f"sbatch-{name}.sh"
    if os.environ.get("HPCAI_UPDATE_GOLDEN"):
        path.write_text(text)
    assert text == path.read_text()


def test_lrz_script_says_what_the_seed_run_did():
    text = render(SPECS["lrz-768nodes"])
    assert "#SBATCH --nodes=768\n" in text and "#SBATCH --ntasks-per-node=4\n" in text
    # 12 cores per rank x 2 hardware threads (Slurm counts hardware threads as CPUs)
    assert "#SBATCH --cpus-per-task=24\n" in text and "#SBATCH --signal=USR1@120\n" in text
    lines = text.strip().splitlines()
    step, plan, run_step = lines[-3:]    # the step is planned once, then run with that plan
    assert step.startswith("step=(srun --mpi=pmi2 --nodes=768 --ntasks-per-node=4 "
                           "--cpus-per-task=24")
    assert "--container /hppfs/work/images/hpcai-bookworm --runtime charliecloud" in step
    assert "--mpi intel" in step and step.endswith("--resume)")
    assert plan == 'plan=$(hpcai-launch plan-step -- "${step[@]}")'
    # only this step's ranks get the plan: a later command of the script (validate) does not
    assert run_step == 'HPCAI_PLAN=$plan "${step[@]}"' and "export HPCAI_PLAN" not in text
    assert "export FI_PROVIDER=psm2" in text
    directives = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert directives == sorted(directives)


def test_values_are_quoted():
    text = render(SPECS["singularity"])
    assert "#SBATCH --job-name='3dgan '\"'\"'quoted'\"'\"' name'" in text


def test_mpiexec_when_the_site_says_so():
    site = SiteProfile.from_dict({"name": "hydra-site", "mpi_launcher": "mpiexec",
                                  "cores_per_node": 8})
    text = render(JobSpec(command=("train", "3dgan"), nodes=3, ranks_per_node=2, site=site,
                          launcher="mpiexec"))
    assert "mpiexec -n 6 -ppn 2 hpcai-launch --ranks-per-node 2 -- train 3dgan --resume" in text
    assert "#SBATCH --cpus-per-task=4" in text   # 8 cores / 2 ranks
    # Open MPI's mpiexec has no -ppn (it failed with: unknown option "-ppn")
    ompi = render(JobSpec(command=("train", "3dgan"), nodes=3, ranks_per_node=2, site=site,
                          launcher="mpiexec", mpi="openmpi"))
    assert ("mpiexec -n 6 --map-by ppr:2:node hpcai-launch --ranks-per-node 2 --mpi openmpi "
            "-- train 3dgan --resume") in ompi
    for mpi in ("mpich", "intel"):
        hydra = render(JobSpec(command=("train",), nodes=3, ranks_per_node=2, site=site,
                               launcher="mpiexec", mpi=mpi))
        assert "mpiexec -n 6 -ppn 2 hpcai-launch" in hydra


@pytest.mark.parametrize("spec,match", [
    (JobSpec(command=TRAIN, nodes=0), "--nodes"),
    (JobSpec(command=TRAIN, ranks_per_node=-1), "--ranks-per-node"),
    (JobSpec(command=TRAIN, ranks_per_node=4, threads_per_rank=13,
             site=SiteProfile.load(LRZ)), "52 cores"),
])
def test_bad_job_specs(spec, match):
    with pytest.raises(UserError, match=match):
        render(spec)


def test_sweep_points_and_bad_lists():
    assert parse_counts("4,1,2,2", "--nodes") == [1, 2, 4]
    for bad in ("1,0", "-2", "one"):
        with pytest.raises(UserError):
            parse_counts(bad, "--nodes")
    points = plan_points([1, 2], [1, 2], "auto", 4, 2, "weak", list(TRAIN))
    assert len(points) == 8 and {(p.ranks_per_node, p.threads_per_rank) for p in points} == \
        {(1, 4), (2, 2)}
    strong = plan_points([1, 2], [2], "1", 4, 1, "strong", list(TRAIN))
    assert [p.batch_size for p in strong] == [16, 8]
    with pytest.raises(UserError, match="cores"):
        plan_points([1], [4], "2", 4, 1, "weak", list(TRAIN))


def test_cli_bad_input_is_error_hint(tmp_path):
    env = base_env()
    cases = [
        (["sweep", "--nodes", "0,1", "--", "train", "3dgan"], "--nodes must be positive"),
        (["sweep", "--nodes", "1", "--ranks-per-node", "4", "--threads-per-rank", "2",
          "--cores-per-node", "4", "--", "train", "3dgan"], "need 8 cores"),
        (["sbatch", "--nodes", "-1", "--", "train", "3dgan"], "--nodes must be at least 1"),
    ]
    for args, fragment in cases:
        result = run(["hpcai-launch", *args], env, cwd=tmp_path)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith("error: ") and "hint: " in result.stderr
        assert fragment in result.stderr, result.stderr
    no_sbatch = dict(env, PATH=str(Path(env["PATH"].split(":")[0])))
    result = run(["hpcai-launch", "sbatch", "--submit", "--", "train", "3dgan"], no_sbatch,
                 cwd=tmp_path)
    assert result.returncode == 2 and "sbatch is not on PATH" in result.stderr
    assert not list(tmp_path.iterdir()), "nothing written when submission cannot work"


def _declared(parser) -> dict[str, tuple]:
    return {a.dest: (tuple(a.option_strings), a.type, a.choices, a.default, a.help)
            for a in parser._actions if a.option_strings}


def test_job_options_are_the_launch_options():
    """sbatch (and sweep) declare the launch options they share with hpcai-launch from its
    one table: same flags, types, choices, defaults (none given: filled in later), help.
    Control: a parser that re-declares ``--ranks-per-node`` with a default differs."""
    import argparse

    from hpcai.launcher.batch.sbatch import add_job_options
    from hpcai.launcher.cli import make_parser
    from hpcai.launcher.planning.options import ARGUMENTS
    job = argparse.ArgumentParser()
    add_job_options(job)
    launch, shared = _declared(make_parser()), {"bind" if n == "binds" else n for n in ARGUMENTS}
    assert {k: v for k, v in _declared(job).items() if k in shared} == \
        {k: v for k, v in launch.items() if k in shared}
    redeclared = argparse.ArgumentParser()
    redeclared.add_argument("--ranks-per-node", "-N", type=int, default=1,
                            help=ARGUMENTS["ranks_per_node"][1]["help"])
    assert _declared(redeclared)["ranks_per_node"] != launch["ranks_per_node"]


def test_sbatch_refuses_an_image_it_would_ignore(tmp_path):
    """``--runtime none`` with ``--container``: the ranks would run bare; control: a runtime
    that uses the image writes the script."""
    base = ["hpcai-launch", "sbatch", "--mpi", "openmpi", "--container", str(tmp_path)]
    refused = run([*base, "--runtime", "none", "--", "true"], base_env(), cwd=tmp_path)
    assert refused.returncode == 2 and refused.stderr.startswith("error: --runtime none")
    assert "hint: " in refused.stderr
    taken = run([*base, "--runtime", "singularity", "--", "true"], base_env(), cwd=tmp_path)
    assert taken.returncode == 0 and "--runtime singularity" in taken.stdout, taken.stderr


def test_sweep_without_a_scheduler(tmp_path):
    """--launcher mpirun: points run one after another on the given hosts, then the report."""
    results = tmp_path / "results"
    result = run(["hpcai-launch", "sweep", "--launcher", "mpirun", "--hosts", "localhost",
                  "--nodes", "1", "--ranks-per-node", "1,2", "--threads-per-rank", "1",
                  "--results", str(results), "--", "train", "resnet-tiny", "--image-size",
                  "32", "--classes", "10", "--samples", "64", "--batch-size", "4",
                  "--epochs", "2", "--peak-gflops", "50"], base_env(), cwd=tmp_path,
                 timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    for name in ("N1-R1-T1-rep0", "N1-R2-T1-rep0"):
        meta = json.loads((results / name / "point.json").read_text())
        assert meta["status"] == "done" and meta["exit_code"] == 0
    rows = json.loads((results / "scaling.json").read_text())
    assert (results / "scaling.png").exists() and (results / "scaling.md").exists()
    assert "| 1 |" in result.stdout or rows
