"""Start-up that scales: one rank per job plans, the others start from its plan file.

- Under srun on the private Slurm (2 fake nodes x 2 ranks, a container job: the planning
  rank finds, collects and stages the host MPI), every rank's wrapper is traced with
  ``strace -f``: rank 0 runs ``ldconfig`` and lists library directories (the control: the
  work is real and the trace sees it); no other rank runs any program or lists any
  directory outside hpcai's own code, and their calls on library directories are the
  dynamic loader's few.
- A foreign plan (another command line), a changed file of the key, a stale plan (old, or
  of an earlier launch with the same job id), no plan at all, and a failed planning rank: ``error:`` + ``hint:``, exit 2; the same rank with
  its own fresh plan runs (the negative control).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, base_env, run
from fakeimages import startup_image as _image
from localcluster import LocalCluster, missing_programs
from startup_trace import Places, parse

TRACE = str(REPO / "testbed" / "startup_trace.py")
LIBDIRS = ("/usr/lib", "/lib", "/usr/lib64", "/lib64")


def _fake_runtime(tmp: Path) -> str:
    bin_dir = tmp / "fakebin"
    bin_dir.mkdir()
    (bin_dir / "ch-run").symlink_to("/bin/true")
    return str(bin_dir)


# --- under srun: only the planning rank does the expensive work ---------------------------

@pytest.mark.slurm
@pytest.mark.skipif(bool(missing_programs()), reason="Slurm/munge not installed")
@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed "
                    "(scripts/install.sh installs it)")
@pytest.mark.skipif(shutil.which("mpirun.openmpi") is None, reason="Open MPI not installed")
def test_startup_only_the_planning_rank_scans_under_srun(tmp_path):
    image = _image(tmp_path / "img")
    out = tmp_path / "traces"
    out.mkdir()
    env = {"PATH": f"{_fake_runtime(tmp_path)}:{Path(sys.executable).parent}:"
                   f"{os.environ.get('PATH', os.defpath)}",
           "HPCAI_CACHE": str(tmp_path / "cache"), "PYTHONDONTWRITEBYTECODE": "1"}
    with LocalCluster(fake_nodes=2, cpus_per_node=2) as cluster:
        result = cluster.run(["srun", "-N", "2", "--ntasks-per-node", "2", "--mpi=pmix",
                              "--kill-on-bad-exit=1", sys.executable, TRACE, "trace", str(out),
                              "--", "hpcai-launch", "--container", str(image), "--",
                              "python3", "-c", "pass"],
                             timeout=180, env=env, cwd=str(tmp_path),
                             unset=("MASTER_ADDR", "MASTER_PORT", "HPCAI_JOB_DIR"))
    assert result.returncode == 0, result.stdout + result.stderr
    places = Places((("library dirs", LIBDIRS),))
    traces = {r: parse((out / f"rank-{r}.trace").read_text(), places, "ch-run")
              for r in range(4)}
    assert all(t.reached_exec for t in traces.values()), {r: t.to_dict() for r, t in traces.items()}
    planner = traces[0]
    assert any(p.endswith("/ldconfig") for p in planner.programs), planner.programs
    assert any(d.startswith(LIBDIRS) for d in planner.listed)
    assert planner.metadata["library dirs"] > 500, planner.metadata
    for rank in (1, 2, 3):
        t = traces[rank]
        assert t.programs == [], (rank, t.programs)           # no ldconfig, no mpirun
        assert not [d for d in t.listed if d.startswith(LIBDIRS)], (rank, t.listed)
        assert t.metadata.get("library dirs", 0) < 60, (rank, t.metadata)
    assert len(list((tmp_path / "cache" / "jobs").glob("plan-*.json"))) == 1


# --- a batch script: its batch host plans the step once, no rank plans -------------------

def _batch_job(cluster: LocalCluster, tmp_path: Path, name: str, image: Path,
               plan_first: bool) -> tuple[int, str, Path]:
    """Submit the script ``hpcai-launch sbatch`` writes for a 2 x 2 container job (the
    control: ``plan_first=False``, the script that only runs srun), with every rank's
    wrapper and the batch host's ``plan-step`` traced. Returns (the job's exit status,
    its output, the traces' directory)."""
    from hpcai.launcher.batch.sbatch import JobSpec, render
    out = tmp_path / f"traces-{name}"
    out.mkdir()
    text = render(JobSpec(command=("python3", "-c", "pass"), nodes=2, ranks_per_node=2,
                          mpi="openmpi", container=str(image), plan_first=plan_first,
                          output=str(tmp_path / f"{name}.out")))
    trace = shlex.join([sys.executable, TRACE, "trace", str(out), "--", "hpcai-launch"])
    step = "--kill-on-bad-exit=1 hpcai-launch --ranks-per-node"
    assert text.count(step) == 1 and text.count("hpcai-launch plan-step") == plan_first
    text = text.replace(step, step.replace("hpcai-launch", trace))
    (out / "batch").mkdir()     # the batch shell has SLURM_PROCID=0 too: its own folder
    batch = shlex.join([sys.executable, TRACE, "trace", str(out / "batch"), "--",
                        "hpcai-launch"])
    text = text.replace("$(hpcai-launch plan-step", f"$({batch} plan-step")
    script = tmp_path / f"{name}.sh"
    script.write_text(text)
    fake = tmp_path / "fakebin"
    runtime = str(fake) if fake.exists() else _fake_runtime(tmp_path)
    env = {"PATH": f"{runtime}:{Path(sys.executable).parent}:"
                   f"{os.environ.get('PATH', os.defpath)}",
           "HPCAI_CACHE": str(tmp_path / "cache"), "PYTHONDONTWRITEBYTECODE": "1"}
    result = cluster.run(["sbatch", "--wait", str(script)], timeout=240, env=env,
                         cwd=str(tmp_path), unset=("MASTER_ADDR", "MASTER_PORT",
                                                   "HPCAI_JOB_DIR", "HPCAI_PLAN"))
    log = (tmp_path / f"{name}.out").read_text() if (tmp_path / f"{name}.out").exists() else ""
    return result.returncode, log + result.stderr, out


def _traces(out: Path) -> dict[str, object]:
    """The ranks' traces by rank, and the batch host's plan-step as "batch"."""
    places = Places((("library dirs", LIBDIRS),))
    found = {p.name.split("-")[1].split(".")[0]: parse(p.read_text(), places, "ch-run")
             for p in out.glob("rank-*.trace")}
    for p in (out / "batch").glob("rank-*.trace"):
        found["batch"] = parse(p.read_text(), places, "ch-run")
    return found


def _planned_here(t) -> bool:
    """The trace of the planning work: library directories listed, and looked into."""
    return (any(d.startswith(LIBDIRS) for d in t.listed)
            and t.metadata["library dirs"] > 500)


def _template(path: Path) -> dict:
    return json.loads(path.read_text())["template"]


@pytest.mark.slurm
@pytest.mark.skipif(bool(missing_programs()), reason="Slurm/munge not installed")
@pytest.mark.skipif(shutil.which("strace") is None, reason="strace not installed "
                    "(scripts/install.sh installs it)")
@pytest.mark.skipif(shutil.which("mpirun.openmpi") is None, reason="Open MPI not installed")
def test_startup_batch_script_plans_once_before_srun(tmp_path):
    """The script ``hpcai-launch sbatch`` writes plans the step on the batch host and no
    rank of the srun step plans; the
    control, the script that only runs srun, has rank 0 plan. Both plans are one template.
    A planning error (the image is gone) ends the job before srun: error:, hint:, exit 2,
    and no rank started."""
    tmp_path.chmod(0o755)
    image = _image(tmp_path / "img")
    with LocalCluster(fake_nodes=2, cpus_per_node=2) as cluster:
        code, log, out = _batch_job(cluster, tmp_path, "first", image, plan_first=True)
        assert code == 0, log
        traces = _traces(out)
        assert sorted(traces) == ["0", "1", "2", "3", "batch"], (sorted(traces), log)
        assert _planned_here(traces["batch"]), traces["batch"].to_dict()
        for rank in ("0", "1", "2", "3"):
            t = traces[rank]
            assert t.reached_exec, (rank, t.to_dict())
            assert t.programs == [], (rank, t.programs)     # no ldconfig, no scontrol
            assert not [d for d in t.listed if d.startswith(LIBDIRS)], (rank, t.listed)
            assert t.metadata.get("library dirs", 0) < 60, (rank, t.metadata)
        jobs = tmp_path / "cache" / "jobs"
        batch_plans = list(jobs.glob("plan-*.json"))
        assert [p.name.endswith(".batch.json") for p in batch_plans] == [True], batch_plans

        code, log, out = _batch_job(cluster, tmp_path, "control", image, plan_first=False)
        assert code == 0, log
        traces = _traces(out)
        assert sorted(traces) == ["0", "1", "2", "3"], (sorted(traces), log)
        assert _planned_here(traces["0"]), traces["0"].to_dict()
        assert not any(_planned_here(traces[r]) for r in ("1", "2", "3"))
        step_plans = [p for p in jobs.glob("plan-*.json") if p not in batch_plans]
        assert [p.name.endswith(".0.json") for p in step_plans] == [True], step_plans
        assert _template(batch_plans[0]) == _template(step_plans[0])

        shutil.rmtree(image)
        code, log, out = _batch_job(cluster, tmp_path, "failed", image, plan_first=True)
        assert code == 2, log
        assert "error:" in log and "hint:" in log, log
        assert sorted(_traces(out)) == ["batch"], log     # srun never ran


# --- the plan file's key, without a cluster ------------------------------------------------

def _rank_env(tmp_path: Path, rank: int, job: str, node: int = 0, **extra: str) -> dict[str, str]:
    """A rank of an srun step of 2 ranks per node on ``SLURM_STEP_NODELIST`` (default: this
    node alone); no Slurm runs, so ``scontrol`` (asked by rank 0 about --kill-on-bad-exit)
    is a program that fails at once."""
    fake = tmp_path / "noslurm"
    if not fake.exists():
        fake.mkdir()
        (fake / "scontrol").symlink_to("/bin/false")
    env = base_env(SLURM_JOB_ID=job, SLURM_STEP_ID="0", SLURM_PROCID=str(rank),
                   SLURM_LOCALID=str(rank % 2), SLURM_NODEID=str(node),
                   SLURM_STEP_NUM_TASKS="2", SLURM_STEP_TASKS_PER_NODE="2",
                   SLURM_STEP_NODELIST=socket.gethostname(), SLURM_MPI_TYPE="pmix",
                   PMIX_RANK=str(rank), SLURM_CONF="/nonexistent",
                   SLURM_SRUN_COMM_HOST="127.0.0.1", SLURM_SRUN_COMM_PORT="40001",
                   HPCAI_JOB_DIR=str(tmp_path / "jobs"))
    env.update(extra)
    env["PATH"] = f"{fake}:{env['PATH']}"
    return env


# an srun step of 2 nodes x 2 ranks (rank r on node r // 2)
TWO_NODES = {"SLURM_STEP_NODELIST": "n[1-2]", "SLURM_STEP_NUM_TASKS": "4",
             "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}


def _job(tmp_path: Path) -> str:
    return str(abs(hash(str(tmp_path))) % 10**6 + 1000)


OUT_ARGV = ["--oversubscribe", "--", sys.executable, "-c",
            "import os; print('rank', os.environ['RANK'], os.environ['OMP_NUM_THREADS'])"]


def _planned(tmp_path: Path) -> tuple[str, Path]:
    job = _job(tmp_path)
    first = run(["hpcai-launch", *OUT_ARGV], _rank_env(tmp_path, 0, job), cwd=tmp_path)
    assert first.returncode == 0 and "rank 0 1" in first.stdout, first.stderr
    plans = list((tmp_path / "jobs").glob("plan-*.json"))
    assert len(plans) == 1
    return job, plans[0]


def test_startup_rank_runs_from_its_jobs_plan(tmp_path):
    job, _ = _planned(tmp_path)
    result = run(["hpcai-launch", *OUT_ARGV], _rank_env(tmp_path, 1, job), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "rank 1 1" in result.stdout


def test_startup_foreign_plan_is_an_error(tmp_path):
    job, _ = _planned(tmp_path)
    other = ["--oversubscribe", "--threads-per-rank", "1", *OUT_ARGV[1:]]
    result = run(["hpcai-launch", *other], _rank_env(tmp_path, 1, job), cwd=tmp_path)
    assert result.returncode == 2
    assert "error: the plan" in result.stderr and "does not belong to this job" in result.stderr
    assert "hpcai-launch command line" in result.stderr and "hint:" in result.stderr
    assert "rank 1" not in result.stdout


def test_startup_changed_file_of_the_key_is_an_error(tmp_path):
    job, path = _planned(tmp_path)
    image = tmp_path / "image-file"
    image.write_text("v1")
    data = json.loads(path.read_text())
    data["key"]["files"] = [["image", str(image), "0:0:0"]]
    path.write_text(json.dumps(data))
    result = run(["hpcai-launch", *OUT_ARGV], _rank_env(tmp_path, 1, job), cwd=tmp_path)
    assert result.returncode == 2
    assert f"its image {image} changed since it was planned" in result.stderr
    assert "hint:" in result.stderr


@pytest.mark.parametrize("why", ["written long ago", "an earlier launch of this job id"])
def test_startup_stale_plan_is_an_error(tmp_path, why):
    job, path = _planned(tmp_path)
    data = json.loads(path.read_text())
    if why == "written long ago":
        data["written"] = time.time() - 3600
    else:      # a restarted Slurm counts job ids from 1 again: srun's contact point differs
        data["key"]["launch"] = data["key"]["launch"].replace("40001", "40002")
    path.write_text(json.dumps(data))
    result = run(["hpcai-launch", *OUT_ARGV],
                 _rank_env(tmp_path, 1, job, HPCAI_PLAN_TIMEOUT="0.5"), cwd=tmp_path)
    assert result.returncode == 2
    assert "is stale" in result.stderr and "hint:" in result.stderr
    assert "rank 1" not in result.stdout


def test_startup_no_plan_times_out_with_an_error(tmp_path):
    result = run(["hpcai-launch", *OUT_ARGV],
                 _rank_env(tmp_path, 1, _job(tmp_path), HPCAI_PLAN_TIMEOUT="0.3"),
                 cwd=tmp_path)
    assert result.returncode == 2
    assert "no plan from the planning rank (rank 0) within 0.3 s" in result.stderr
    assert "HPCAI_PLAN_TIMEOUT" in result.stderr


def test_startup_failed_planner_stops_the_others(tmp_path):
    """Said once per node, as before: by the planning rank on its node, by local rank 0 on
    each other node; the others stop silently."""
    job = _job(tmp_path)
    two = {**TWO_NODES, "HPCAI_PLAN_TIMEOUT": "5"}
    bad = ["--ranks-per-node", "3", *OUT_ARGV]
    first = run(["hpcai-launch", *bad], _rank_env(tmp_path, 0, job, **two), cwd=tmp_path)
    assert first.returncode == 2 and "error: srun started 2 task(s)" in first.stderr
    same_node = run(["hpcai-launch", *bad], _rank_env(tmp_path, 1, job, **two), cwd=tmp_path)
    assert same_node.returncode == 2 and same_node.stderr == "", same_node.stderr
    other_node = run(["hpcai-launch", *bad], _rank_env(tmp_path, 2, job, node=1, **two),
                     cwd=tmp_path)
    assert other_node.returncode == 2
    assert other_node.stderr.count("error: srun started 2 task(s)") == 1, other_node.stderr
    assert "hint: run: srun" in other_node.stderr
    second = run(["hpcai-launch", *bad], _rank_env(tmp_path, 3, job, node=1, **two),
                 cwd=tmp_path)
    assert second.returncode == 2 and second.stderr == "", second.stderr


@pytest.mark.parametrize("cpus", ["same", "other"])
def test_startup_node_with_another_cpu_count_plans_by_itself(tmp_path, cpus):
    """The plan's CPU sets are the planning node's: a rank on a node with another number of
    CPUs plans by itself (it imports the planner); with the same count (the control) it
    runs from the plan and never imports it. Python's own import log tells which."""
    job, path = _planned(tmp_path)
    if cpus == "other":
        data = json.loads(path.read_text())
        data["key"]["cpus"] = (os.cpu_count() or 1) + 2
        path.write_text(json.dumps(data))
    result = run(["hpcai-launch", *OUT_ARGV],
                 _rank_env(tmp_path, 1, job, PYTHONPROFILEIMPORTTIME="1"), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "rank 1 1" in result.stdout
    wrapper = _wrapper_imports(result.stderr)
    assert "hpcai.launcher.job.jobplan" in wrapper
    assert ("hpcai.launcher.planning.plan" in wrapper) == (cpus == "other"), sorted(wrapper)
    if cpus == "same":     # what a rank that runs from the plan loads of hpcai, and no more
        assert {m for m in wrapper if m.startswith("hpcai")} == RANK_MODULES, sorted(wrapper)
        assert not wrapper & {"dataclasses", "inspect", "tomllib", "typing", "subprocess",
                              "hpcai.launcher.job.site"}


RANK_MODULES = {"hpcai", "hpcai.core", "hpcai.core.errors", "hpcai.core.paths",
                "hpcai.core.record", "hpcai.launcher",
                "hpcai.launcher.cli", "hpcai.launcher.job", "hpcai.launcher.job.jobplan",
                "hpcai.launcher.job.rankenv", "hpcai.launcher.run", "hpcai.launcher.run.execute",
                "hpcai.launcher.run.child",
                "hpcai.slurm", "hpcai.slurm.nodelist"}


def _wrapper_imports(stderr: str) -> set[str]:
    """The modules the wrapper imported, from ``PYTHONPROFILEIMPORTTIME``'s log: the lines
    before the second header (the exec'd program starts a log of its own)."""
    header = "import time: self [us] | cumulative | imported package"
    parts = stderr.split(header)
    assert len(parts) >= 3, "expected the wrapper's and the program's import logs"
    return {line.rsplit("|", 1)[1].strip() for line in parts[1].splitlines()
            if line.startswith("import time:") and "|" in line}


# --- where the plan lives: the site profile's job directory, and pruning -------------------

def test_startup_site_profile_node_local_job_dir(tmp_path):
    """``job_dir_scope = "node"``: each node's local rank 0 plans into the site's job_dir
    (one plan per node, $VARS expanded), the other rank of each node runs from its node's
    plan, and nothing goes to the cache's job directory."""
    site = tmp_path / "site.toml"
    site.write_text('job_dir = "$HPCAI_TEST_SCRATCH/hpcai-jobs"\njob_dir_scope = "node"\n')
    two = {**TWO_NODES, "HPCAI_JOB_DIR": "", "HPCAI_SITE": str(site),
           "HPCAI_TEST_SCRATCH": str(tmp_path / "scratch"), "PYTHONPROFILEIMPORTTIME": "1",
           "HPCAI_PLAN_TIMEOUT": "20"}
    job = _job(tmp_path)
    planned = {}
    for rank in range(4):
        result = run(["hpcai-launch", *OUT_ARGV],
                     _rank_env(tmp_path, rank, job, node=rank // 2, **two), cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        assert f"rank {rank} 1" in result.stdout
        planned[rank] = "hpcai.launcher.planning.plan" in _wrapper_imports(result.stderr)
    assert planned == {0: True, 1: False, 2: True, 3: False}
    plans = sorted(p.name for p in (tmp_path / "scratch" / "hpcai-jobs").glob("plan-*"))
    host = socket.gethostname()
    assert plans == [f"plan-slurm_{job}.0_{host}-0.json", f"plan-slurm_{job}.0_{host}-1.json"]
    assert not (tmp_path / "jobs").exists()


@pytest.mark.parametrize("bad, why", [
    ('job_dir = "relative/jobs"', "'job_dir' must be an absolute path"),
    ('job_dir_scope = "rack"', "'job_dir_scope' must be 'shared' or 'node'"),
])
def test_startup_bad_job_dir_in_the_site_profile_is_an_error(tmp_path, bad, why):
    """Said by the planning rank; the others stop with it (exit 2), nothing is started."""
    site = tmp_path / "site.toml"
    site.write_text(bad + "\n")
    job = _job(tmp_path)
    env = {"HPCAI_SITE": str(site), "HPCAI_PLAN_TIMEOUT": "20"}
    first = run(["hpcai-launch", *OUT_ARGV], _rank_env(tmp_path, 0, job, **env), cwd=tmp_path)
    assert first.returncode == 2 and why in first.stderr and "hint:" in first.stderr
    assert "rank 0" not in first.stdout
    other = run(["hpcai-launch", *OUT_ARGV], _rank_env(tmp_path, 1, job, **env), cwd=tmp_path)
    assert other.returncode == 2 and "rank 1" not in other.stdout


def test_startup_planner_prunes_old_plans(tmp_path):
    """Plans (and left-over temporaries) older than a day go; a fresh one of another job,
    the control, stays. The directory is scanned at most hourly (its ``.pruned`` stamp)."""
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    old = [jobs / "plan-slurm_1.0.json", jobs / "plan-slurm_2.0.json.n1.77.tmp"]
    fresh = jobs / "plan-slurm_3.0.json"
    for path in (*old, fresh):
        path.write_text("{}")
    two_days_ago = time.time() - 2 * 86400
    for path in old:
        os.utime(path, (two_days_ago, two_days_ago))
    other = jobs / "notes.txt"          # not hpcai's: never touched
    other.write_text("x")
    os.utime(other, (two_days_ago, two_days_ago))
    job = _job(tmp_path)
    first = run(["hpcai-launch", *OUT_ARGV], _rank_env(tmp_path, 0, job), cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    left = sorted(p.name for p in jobs.iterdir())
    assert left == sorted([fresh.name, f"plan-slurm_{job}.0.json", other.name, ".pruned"])
    # at most hourly: within the hour another old plan stays; once the stamp is older, it goes
    late = jobs / "plan-slurm_4.0.json"
    late.write_text("{}")
    os.utime(late, (two_days_ago, two_days_ago))
    for stamp_age, stays in ((0, True), (2 * 3600, False)):
        then = time.time() - stamp_age
        os.utime(jobs / ".pruned", (then, then))
        again = run(["hpcai-launch", *OUT_ARGV], _rank_env(tmp_path, 0, _job(tmp_path)),
                    cwd=tmp_path)
        assert again.returncode == 0, again.stderr
        assert late.exists() == stays, (stamp_age, sorted(p.name for p in jobs.iterdir()))


def test_startup_node_local_job_dir_stages_the_host_libraries_there(tmp_path):
    """A container job with ``job_dir_scope = "node"``: the planning rank stages the host
    MPI under the site's job_dir, not in hpcai's cache (the control: the same job without
    the site profile stages in the cache). ch-run is /bin/true: the work ends at the exec."""
    image = _image(tmp_path / "img")
    runtime = _fake_runtime(tmp_path)
    argv = ["--oversubscribe", "--container", str(image), "--", "python3", "-c", "pass"]
    site = tmp_path / "site.toml"
    site.write_text(f'job_dir = "{tmp_path}/local"\njob_dir_scope = "node"\n')
    for with_site in (False, True):
        cache = tmp_path / f"cache-{with_site}"
        extra = {"HPCAI_CACHE": str(cache), "HPCAI_JOB_DIR": ""}
        if with_site:
            extra["HPCAI_SITE"] = str(site)
        env = _rank_env(tmp_path, 0, _job(tmp_path) + str(int(with_site)), **extra)
        env["PATH"] = f"{runtime}:{env['PATH']}"
        result = run(["hpcai-launch", *argv], env, cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        in_cache = list(cache.glob("hostlibs/*/lib/libmpi.so*"))
        in_site = list((tmp_path / "local").glob("hostlibs/*/lib/libmpi.so*"))
        if with_site:
            assert in_site and not in_cache, (in_site, in_cache)
        else:
            assert in_cache and not in_site, (in_site, in_cache)


@pytest.mark.parametrize("hpcai_cache, xdg, expected", [
    ("", "", "home"), ("", "XDG", "xdg"), ("MINE", "XDG", "mine"), (None, None, "home")])
def test_startup_planner_and_ranks_use_one_cache_rule(tmp_path, hpcai_cache, xdg, expected):
    """The planner's cache (where host libraries are staged) and the ranks' job directory
    come from one rule: an empty ``HPCAI_CACHE`` or ``XDG_CACHE_HOME`` counts as unset. The
    expected paths are written out, so a second rule that reads an empty variable as a
    path (as facts did) fails here."""
    from hpcai.launcher.planning import facts
    from hpcai.core.paths import cache_root
    from hpcai.launcher.job import jobplan
    from hpcai.launcher.planning.options import Options
    env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path / "h")}
    values = {"MINE": str(tmp_path / "mine"), "XDG": str(tmp_path / "xdg")}
    if hpcai_cache is not None:
        env["HPCAI_CACHE"] = values.get(hpcai_cache, hpcai_cache)
    if xdg is not None:
        env["XDG_CACHE_HOME"] = values.get(xdg, xdg)
    want = {"home": os.path.join(os.path.expanduser("~/.cache"), "hpcai"),
            "xdg": str(tmp_path / "xdg" / "hpcai"), "mine": str(tmp_path / "mine")}[expected]
    assert cache_root(env) == want
    assert jobplan.job_dir(env)[0] == os.path.join(want, "jobs")
    got = facts.gather_facts(Options(command=("true",), ranks_per_node=1), env, stage=False)
    assert got.cache_dir == want


# --- under mpirun on one host: the outer hpcai-launch plans for its ranks -----------------

PLANNER = "hpcai.launcher.planning.facts"
LAUNCHER = "hpcai.launcher.cli"
# one write per rank (the ranks' stdout is unbuffered: print's pieces could interleave)
SHOW = ("import os, sys; sys.stdout.write(' '.join(['rank', os.environ['RANK'], "
        "os.environ['OMP_NUM_THREADS'], os.environ.get('HPCAI_PLAN', '-'), "
        "str(sorted(os.sched_getaffinity(0)))]) + '\\n')")


def _imports_of(module: str, stderr: str) -> int:
    """How many processes imported ``module`` (PYTHONPROFILEIMPORTTIME: one line each)."""
    return sum(1 for line in stderr.splitlines()
               if line.startswith("import time:") and line.rstrip().endswith(f"| {module}"))


@pytest.mark.parametrize("how", ["direct", "plan file", "hosts"],
                         ids=["Open MPI on this host", "--report-bindings: plan file",
                              "--hosts (control)"])
def test_startup_outer_launcher_plans_for_its_mpirun_ranks(tmp_path, how):
    """``hpcai-launch -N 2`` under Open MPI's mpirun on this host plans every rank before
    mpirun starts, and mpirun starts the ranks' commands itself: only the outer process
    imports hpcai-launch at all, both ranks have their thread environment and one CPU each
    (taskset), no plan file is written, and the printed plan says so (``--dry-run``). With
    ``--report-bindings`` the ranks' wrappers run (they report) and start from the plan
    file written before mpirun (``HPCAI_PLAN``), which is gone afterwards: the planner is
    still imported only once. The control: the same launch with ``--hosts`` (a plan that
    may cover other hosts) prepares nothing, and rank 0 plans for the job (the planner
    imported again)."""
    jobs = tmp_path / "jobs"
    env = base_env(HPCAI_JOB_DIR=str(jobs), PYTHONPROFILEIMPORTTIME="1")
    where = ["--hosts", f"{socket.gethostname()}:2"] if how == "hosts" else []
    where += ["--report-bindings"] if how == "plan file" else []
    argv = ["hpcai-launch", "--mpi", "openmpi", "-N", "2", *where, "--", sys.executable,
            "-c", SHOW]
    result = run(argv, env, cwd=tmp_path, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    lines = sorted(ln.split(" ", 4) for ln in result.stdout.splitlines()
                   if ln.startswith("rank "))
    assert [ln[:3] for ln in lines] == [["rank", "0", "1"], ["rank", "1", "1"]], result.stdout
    cpus = [json.loads(ln[4]) for ln in lines]
    if os.cpu_count() >= 2:
        assert all(len(c) == 1 for c in cpus) and cpus[0] != cpus[1], cpus
    dry = run([*argv[:-4], "--dry-run", *argv[-4:]], base_env(HPCAI_JOB_DIR=str(jobs)),
              cwd=tmp_path, timeout=60)
    assert dry.returncode == 0, dry.stderr[-3000:]
    direct = "no hpcai-launch runs in the ranks" in dry.stdout
    assert direct == (how == "direct"), dry.stdout
    if how == "direct":
        assert _imports_of(LAUNCHER, result.stderr) == 1, result.stderr[-3000:]
        assert {ln[3] for ln in lines} == {"-"} and not jobs.exists()
        assert dry.stdout.count("taskset -c") == 2, dry.stdout
    elif how == "plan file":
        assert _imports_of(LAUNCHER, result.stderr) == 3, result.stderr[-3000:]
        assert _imports_of(PLANNER, result.stderr) == 1, result.stderr[-3000:]
        plan = lines[0][3]
        assert plan.startswith(str(jobs)) and lines[1][3] == plan
        assert not Path(plan).exists() and not list(jobs.glob("plan-launch_*"))
        assert result.stderr.count("hpcai: rank ") == 2, result.stderr[-3000:]
    else:
        assert _imports_of(PLANNER, result.stderr) == 2, result.stderr[-3000:]
        assert {ln[3] for ln in lines} == {"-"}
