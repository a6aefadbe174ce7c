"""Bad input that used to be accepted (issue 12, item 9), tried through the console scripts:
each is ``error:`` + ``hint:``, exit 2, nothing started and nothing written. Every refusal
has a control that the same command, made right, is accepted."""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from conftest import base_env, run


class Sandbox:
    """An empty working directory, cache and output place; ``untouched()`` says they
    stayed empty and the marker command never ran."""

    def __init__(self, root: Path) -> None:
        self.cwd, self.cache, self.out = root / "cwd", root / "cache", root / "out"
        self.cwd.mkdir()
        self.cache.mkdir()
        self.marker = root / "ran"
        self.env = base_env(HPCAI_CACHE=str(self.cache))

    def run(self, *argv: str, env: dict[str, str] | None = None, timeout: float = 60):
        return run(list(argv), {**self.env, **(env or {})}, cwd=self.cwd, timeout=timeout)

    def touch(self) -> tuple[str, ...]:
        return ("touch", str(self.marker))

    def untouched(self) -> bool:
        return (not self.marker.exists() and not any(self.cwd.iterdir())
                and not any(self.cache.iterdir()) and not self.out.exists())


@pytest.fixture
def box(tmp_path) -> Sandbox:
    return Sandbox(tmp_path)


def refused(result, box: Sandbox, *fragments: str) -> str:
    """Exit 2, exactly one ``error:`` line then a ``hint:``, no traceback, nothing done."""
    err = result.stderr
    assert result.returncode == 2, (result.returncode, result.stdout, err)
    lines = err.strip().splitlines()
    assert lines[0].startswith("error: ") and lines[1].startswith("hint: "), err
    assert err.count("error:") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
    assert box.untouched(), "something was started or written"
    return err


# --- hpcai-launch: site profile and container options without a container --------------

def test_missing_site_profile_without_a_container(box):
    refused(box.run("hpcai-launch", "--site", str(box.cwd.parent / "nope.toml"), "--",
                    *box.touch()), box, "nope.toml does not exist")
    refused(box.run("hpcai-launch", "--", *box.touch(),
                    env={"HPCAI_SITE": str(box.cwd.parent / "nope.toml")}), box, "nope.toml")


def test_site_profile_that_is_not_toml_without_a_container(box, tmp_path):
    bad = tmp_path / "site.toml"
    bad.write_text("binds = [/lrz/sys]\n")
    refused(box.run("hpcai-launch", "--site", str(bad), "--", *box.touch()), box,
            "is not valid TOML")


def test_a_valid_site_profile_without_a_container_is_used(box, tmp_path):
    """Control, and the site's PMI now reaches a bare srun line too."""
    site = tmp_path / "site.toml"
    site.write_text('pmi = "pmi2"\n')
    result = box.run("hpcai-launch", "--site", str(site), "--dry-run", "--json", "--", "true",
                     env={"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1"})
    assert result.returncode == 0, result.stderr
    assert "--mpi=pmi2" in json.loads(result.stdout)["argv"]


@pytest.mark.parametrize("args,fragment", [
    (["--bind", "/data"], "--bind /data with no --container"),
    (["--bind-host-mpi"], "--bind-host-mpi with no --container"),
    (["--no-bind-host-mpi"], "--no-bind-host-mpi with no --container"),
    (["--runtime", "singularity"], "--runtime singularity with no --container"),
    (["--container", "/images/x", "--runtime", "none"], "the image would be ignored"),
])
def test_container_options_without_a_container(box, args, fragment):
    refused(box.run("hpcai-launch", *args, "--", *box.touch()), box, fragment)


def test_runtime_none_over_the_container_default_is_a_bare_run(box):
    """Control: HPCAI_CONTAINER set, ``--runtime none`` asks for a bare run on purpose."""
    result = box.run("hpcai-launch", "--runtime", "none", "--", *box.touch(),
                     env={"HPCAI_CONTAINER": "/images/x"})
    assert result.returncode == 0, result.stderr
    assert box.marker.exists()


# --- hpcai-launch: HPCAI_* defaults -----------------------------------------------------

@pytest.mark.parametrize("var,value", [
    ("HPCAI_RANKS_PER_NODE", "abc"), ("HPCAI_RANKS_PER_NODE", "0"),
    ("HPCAI_THREADS_PER_RANK", "-2"), ("HPCAI_THREADS_PER_RANK", "1.5"),
    ("HPCAI_LAUNCHER", "slurm"), ("HPCAI_MPI", "lam"), ("HPCAI_RUNTIME", "docker"),
    ("HPCAI_TOPOLOGY", "/no/such/topology.xml"),
])
def test_malformed_env_default_is_an_error_naming_the_variable(box, var, value):
    refused(box.run("hpcai-launch", "--", *box.touch(), env={var: value}), box, var)


def test_well_formed_env_defaults_are_used(box):
    """Control: the same variables, well formed, give the defaults; a flag still wins."""
    result = box.run("hpcai-launch", "--dry-run", "--json", "--", "true",
                     env={"HPCAI_RANKS_PER_NODE": "2", "HPCAI_THREADS_PER_RANK": "1",
                          "HPCAI_RUNTIME": "singularity", "HPCAI_LAUNCHER": "auto"})
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    assert plan["placement"]["ranks_per_node"] == 2
    assert plan["placement"]["threads_per_rank"] == 1
    flag = box.run("hpcai-launch", "-N", "1", "--dry-run", "--json", "--", "true",
                   env={"HPCAI_RANKS_PER_NODE": "2"})
    assert json.loads(flag.stdout)["placement"]["ranks_per_node"] == 1


# --- hpcai-launch: the launcher ---------------------------------------------------------

def test_srun_outside_an_allocation(box):
    err = refused(box.run("hpcai-launch", "--launcher", "srun", "--", *box.touch()), box,
                  "not inside a Slurm allocation")
    assert "salloc" in err and "--launcher mpirun" in err
    refused(box.run("hpcai-launch", "--", *box.touch(), env={"HPCAI_LAUNCHER": "srun"}), box,
            "not inside a Slurm allocation")


def test_srun_inside_an_allocation_is_planned(box):
    """Control: with SLURM_JOB_ID the same option plans srun."""
    result = box.run("hpcai-launch", "--launcher", "srun", "--dry-run", "--json", "--", "true",
                     env={"SLURM_JOB_ID": "7"})
    assert result.returncode == 0 and json.loads(result.stdout)["mode"] == "srun", result.stderr


def test_options_of_the_other_launcher(box):
    refused(box.run("hpcai-launch", "--nodes", "2", "--", *box.touch()), box,
            "--nodes 2 only applies when hpcai-launch starts srun")
    refused(box.run("hpcai-launch", "--hosts", "n1,n2", "--", *box.touch(),
                    env={"SLURM_JOB_ID": "7", "HPCAI_LAUNCHER": "srun"}), box,
            "--hosts n1,n2 only applies when hpcai-launch starts mpirun")
    refused(box.run("hpcai-launch", "--nodes", "0", "--", *box.touch()), box,
            "--nodes must be at least 1")


# --- train: batch size and other numbers ------------------------------------------------

@pytest.mark.parametrize("args,fragment", [
    (["--batch-size", "0"], "--batch-size must be at least 1, got 0"),
    (["--batch-size", "-4"], "--batch-size must be at least 1, got -4"),
    (["--lr", "0"], "--lr must be positive"),
    (["--keep", "-1"], "--keep must not be negative"),
    (["--seed", "-1"], "--seed must not be negative"),
    (["--max-steps", "-1"], "--max-steps must not be negative"),
    (["--samples", "64"], "--samples is for the ResNet models"),
    (["--data", "/d"], "--data and --generate together"),
    (["--test-files", "-1"], "--test-files must not be negative"),
    (["--validate-draws", "0"], "--validate-draws must be at least 1, got 0"),
    (["--framework", "tensorflow", "--bn-axis", "depth"],
     "--bn-axis depth is implemented for PyTorch only"),
    (["--framework", "tensorflow", "--cell-scale", "100"],
     "--cell-scale 100.0 is implemented for PyTorch only"),
    (["--cell-scale", "0"], "--cell-scale must be a positive number, got 0"),
    (["--cell-scale", "nan"], "--cell-scale must be a positive number, got nan"),
    (["--lr-decay", "cosine", "--warmup-epochs", "2"],
     "--lr-decay cosine with --warmup-epochs 2 and --epochs 2: the warm-up fills the run"),
    (["--lr-decay", "linear"], "argument --lr-decay: invalid choice: 'linear'"),
    (["--device", "cuda", "--comm", "gloo"],
     "--device cuda is implemented for --framework pytorch with --comm nccl or mpi only"),
    (["--device", "cuda", "--framework", "tensorflow"],
     "--device cuda is implemented for --framework pytorch with --comm nccl or mpi only"),
    # the pinned torch is a CPU build: no GPU on any machine this suite runs on
    (["--device", "cuda"], "--device cuda, but PyTorch 2.13.0+cpu sees no CUDA GPU on this node"),
    (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
    (["--loss-weights", "8,0.2"], "argument --loss-weights: invalid loss_weights value"),
    (["--loss-weights", "8,0.2,-1"], "argument --loss-weights: invalid loss_weights value"),
    (["--loss-weights", "0,0,0"], "argument --loss-weights: invalid loss_weights value"),
    (["--loss-weights", "8,0.2,nan"], "argument --loss-weights: invalid loss_weights value"),
    (["--framework", "tensorflow", "--loss-weights", "8,0.2,1"],
     "--loss-weights (8.0, 0.2, 1.0) is implemented for PyTorch only"),
    (["--generator-ema", "0"], "--generator-ema must lie between 0 and 1, got 0"),
    (["--generator-ema", "1"], "--generator-ema must lie between 0 and 1, got 1"),
    (["--generator-ema", "-0.5"], "--generator-ema must lie between 0 and 1, got -0.5"),
    (["--generator-ema", "nan"], "--generator-ema must lie between 0 and 1, got nan"),
    (["--framework", "tensorflow", "--generator-ema", "0.99"],
     "--generator-ema 0.99 is implemented for PyTorch only"),
    (["--validate-bn", "fresh"], "argument --validate-bn: invalid choice: 'fresh'"),
    (["--framework", "tensorflow", "--validate-bn", "standing"],
     "--validate-bn standing is implemented for PyTorch only"),
    (["--recipe", "cern2020"], "argument --recipe: invalid choice: 'cern2020'"),
    (["--framework", "tensorflow", "--recipe", "learning"],
     "--recipe learning is implemented for PyTorch only"),
])
def test_train_refuses_numbers_and_options_it_would_ignore(box, args, fragment):
    refused(box.run("train", "3dgan", "--generate", "8", "--out", str(box.out), *args), box,
            fragment)


def test_resnet_refuses_the_3dgan_data_options(box):
    refused(box.run("hpcai-train", "resnet-tiny", "--generate", "8", "--out", str(box.out)),
            box, "--generate is for 3dgan")
    refused(box.run("hpcai-train", "resnet-tiny", "--cell-scale", "100", "--out", str(box.out)),
            box, "--cell-scale is for 3dgan")
    refused(box.run("hpcai-train", "resnet-tiny", "--loss-weights", "8,0.2,1", "--out",
                    str(box.out)), box, "--loss-weights is for 3dgan")
    refused(box.run("hpcai-train", "resnet-tiny", "--generator-ema", "0.99", "--out",
                    str(box.out)), box, "--generator-ema is for 3dgan")
    refused(box.run("hpcai-train", "resnet-tiny", "--validate-draws", "2", "--out",
                    str(box.out)), box, "--validate-draws is for 3dgan")
    refused(box.run("hpcai-train", "resnet-tiny", "--validate-bn", "standing", "--out",
                    str(box.out)), box, "--validate-bn is for 3dgan")
    refused(box.run("hpcai-train", "resnet-tiny", "--recipe", "cern2019", "--out",
                    str(box.out)), box, "--recipe is for 3dgan")


# --- hpcai-launch -- train: checked once, before any rank starts -------------------------

@pytest.mark.parametrize("command,fragment", [
    (["train", "3dgan", "--generate", "8", "--batch-size", "0"],
     "train: --batch-size must be at least 1"),
    (["train", "3dgan", "--bogus"], "train: unrecognized arguments: --bogus"),
    (["hpcai-train", "3dgan", "--epochs", "two"], "hpcai-train: argument --epochs"),
    (["python", "-m", "hpcai.training", "gan"], "python -m hpcai.training: argument model"),
    (["train", "resnet-tiny", "--comm", "gloo", "--allreduce-progress", "thread"],
     "--allreduce-progress is for PyTorch on the CPU with --comm mpi"),
])
def test_launch_checks_the_training_arguments_once(box, command, fragment):
    err = refused(box.run("hpcai-launch", "-N", "2", "--", *command, "--out", str(box.out)),
                  box, fragment)
    assert "mpirun" not in err and "prterun" not in err, "a rank was started"


def test_someone_elses_train_is_not_checked(box, tmp_path):
    """Control: a ``train`` on PATH that is not hpcai's gets its arguments untouched."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    other = bindir / "train"
    other.write_text(f"#!/bin/sh\ntouch {box.marker}\n")
    other.chmod(other.stat().st_mode | stat.S_IXUSR)
    env = {"PATH": f"{bindir}{os.pathsep}{box.env['PATH']}"}
    result = box.run("hpcai-launch", "--", "train", "--batch-size", "0", env=env)
    assert result.returncode == 0, result.stderr
    assert box.marker.exists()


# --- sbatch and sweep ------------------------------------------------------------------

@pytest.mark.parametrize("args,fragment", [
    (["sbatch", "--bind", "/data"], "--bind /data without --container"),
    (["sbatch", "--runtime", "singularity"], "--runtime singularity without --container"),
    (["sbatch", "--time", "1:2:3:4"], "is not a Slurm time limit"),
    (["sbatch", "--signal", "B:USR1@60"], "checkpoint and stop on USR1 or TERM"),
    (["sbatch", "--signal", "INT@60"], "checkpoint and stop on USR1 or TERM"),
    (["sbatch", "--dry-run", "--script", "job.sh"], "--dry-run only prints the script"),
    (["sweep", "--launcher", "mpirun", "--partition", "p"], "--partition is for Slurm"),
    (["sweep", "--launcher", "mpirun", "--no-wait"], "--no-wait is for Slurm"),
    (["sweep", "--hosts", "n1"], "--hosts is for --launcher mpirun"),
    (["sweep", "--scaling", "strong"], "--scaling strong needs --batch-size"),
])
def test_job_options_that_would_be_ignored(box, args, fragment):
    refused(box.run("hpcai-launch", *args, "--", "train", "3dgan", "--generate", "8"), box,
            fragment)


@pytest.mark.parametrize("sub", ["sbatch", "sweep"])
def test_jobs_check_the_training_arguments(box, sub):
    refused(box.run("hpcai-launch", sub, "--", "train", "3dgan", "--batch-size", "0"), box,
            "train: --batch-size must be at least 1")


def test_a_good_job_script_is_still_written(box):
    """Control: sbatch with a container's options and a well-formed time and signal."""
    result = box.run("hpcai-launch", "sbatch", "--container", "/images/x", "--bind", "/data",
                     "--runtime", "singularity", "--time", "1-12", "--signal", "R:TERM@60",
                     "--mpi", "openmpi", "--", "train", "3dgan", "--generate", "8")
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --time=1-12" in result.stdout and "--bind /data" in result.stdout


def test_sweep_point_past_its_time_is_stopped(box):
    """An mpirun point gets --time as a limit: past it the process group is ended and the
    point is recorded as timeout (it used to run forever)."""
    tag = f"hpcai-timeout-{os.getpid()}-{time.monotonic_ns()}"
    results = box.cwd / "results"
    # not stopped, the point would sleep past the run's own timeout, which fails the test
    result = box.run("hpcai-launch", "sweep", "--launcher", "mpirun", "--hosts", "localhost",
                     "--time", "0:03", "--results", str(results), "--", "python", "-c",
                     f"import time; time.sleep(600)  # {tag}", timeout=300)
    point = json.loads(next(results.glob("*/point.json")).read_text())
    assert point["status"] == "timeout", point
    assert "timeout (past --time 0:03)" in result.stdout, result.stdout
    left = [p for p in Path("/proc").iterdir() if p.name.isdigit()
            and tag.encode() in _cmdline(p)]
    assert not left, f"processes of the point survived: {left}"


def _cmdline(proc: Path) -> bytes:
    try:
        return (proc / "cmdline").read_bytes()
    except OSError:
        return b""


def test_a_run_on_a_topology_that_is_not_this_machine_warns_once(box):
    """--topology plans another machine: a real run is not bound, and rank 0 says so (it
    used to be a note that only --dry-run showed)."""
    result = box.run("hpcai-launch", "-N", "2", "--topology", "pack:1 numa:1 core:2", "--",
                     "true")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("is not this machine's: the ranks are not bound") == 1
    plain = box.run("hpcai-launch", "-N", "2", "--", "true")
    assert plain.returncode == 0 and "not bound" not in plain.stderr, plain.stderr
