"""``hpcai-launch validate``: the healthy set-up passes, every negative control FAILS naming
its cause, a bare side that cannot be measured is UNVERIFIED (exit 3), all as real runs in
the image (testbed/validate_controls.py). Plus the checks on hand-made records and the
``dladdr`` helper that says which libmpi a process really uses."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import pytest

from conftest import base_env, run
from test_image import image, image_env  # noqa: F401 - fixture
from test_image import pytestmark as IMAGE_MARKS
from validate_controls import CAUSES, CONTROLS, HEALTHY, cpuset, missing, shared_scenario

from hpcai.launcher.probe import PingPong, ProbeRecord
from hpcai.launcher import validate
from hpcai.launcher.validate import (Expectation, Launch, SizeResult, check_cpus,
                                     check_fabric, check_mpi, check_world)


def container(test):
    """The image tests' marks (skipped where Charliecloud is missing), per test: the checks on
    hand-made records below run everywhere."""
    for mark in IMAGE_MARKS:
        test = mark(test)
    return test


def _scenario(name: str, image: Path, tmp_path_factory):
    """The scenario's run, shared with tests/test_containers.py (one run per session)."""
    why = missing(name)
    if why:
        pytest.skip(why)
    return shared_scenario(name, image, image_env(), tmp_path_factory)


@container
def test_healthy_set_up_passes(image, tmp_path_factory):
    """Every check of a healthy set-up passes: world, MPI library, fabric, binding. Whether
    the container also holds the bandwidth floor is a measurement of this machine at this
    moment (two busy loops beside it can halve one side), so here the verdict only has to
    follow the measured ratios; bench/validate_repeat.py counts how often the floor holds."""
    result = _scenario(HEALTHY, image, tmp_path_factory)
    report = result.report
    why = result.stdout + result.stderr[-3000:] + _per_trial(report)
    assert report is not None and report["unverified"] == [], why
    below = [s for s in report["sizes"] if s["judged"] and s["ratio"] < report["threshold"]]
    floor = [p for p in report["problems"] if "ping-pong: the container reaches" in p]
    assert report["problems"] == floor and len(floor) == len(below), why   # nothing else
    assert result.code == (1 if below else 0), why
    assert result.cause_named() == (not below), why
    # 5 trials per side, or 15 where a size's first five lay on both sides of the floor
    n = report["trials_run"]
    assert report["verdict"] == ("FAIL" if below else "OK") and (
        n, bool(report["extended"])) in ((5, False), (15, True)), report
    assert [len(r["records"]) for r in report["container"]] == [2] * n
    assert [s["nbytes"] for s in report["sizes"]] == [8, 64 << 10, 4 << 20]
    assert all(len(s["container_us"]) == len(s["bare_us"]) == n for s in report["sizes"])
    for line in ("8 B: container", "64 KiB: container", "4 MiB: container", "spread", "ratio"):
        assert line in result.stdout, result.stdout


def _per_trial(report: dict | None) -> str:
    """For a failure message: each trial's figures per size and the container launches'
    stderr (what a FAIL on a machine that is not this one leaves to go on)."""
    if not report:
        return "\nno report"
    lines = ["", "per trial (half round trip, us: container / bare):"]
    for s in report["sizes"]:
        pairs = ", ".join(f"{c:.1f}/{b:.1f}" for c, b in zip(s["container_us"], s["bare_us"]))
        lines.append(f"  {s['nbytes']} B: {pairs}")
    for i, launch in enumerate(report["container"], 1):
        if launch["stderr_tail"].strip():
            lines.append(f"container trial {i} stderr: {launch['stderr_tail'][-600:]}")
    return "\n".join(lines)


@container
@pytest.mark.parametrize("control", CONTROLS)
def test_negative_control_fails_naming_its_cause(control, image, tmp_path_factory):
    result = _scenario(control, image, tmp_path_factory)
    assert result.code == 1, f"{control}: exit {result.code}\n{result.stdout}{result.stderr}"
    assert result.report["verdict"] == "FAIL" and not result.report["valid"]
    assert result.cause_named(), \
        f"{control}: cause not named\n{result.stdout}{_per_trial(result.report)}"
    assert "verdict: FAIL (exit 1)" in result.stdout
    if control == "tcp-fallback":   # world, MPI and CPUs are right: only the floor sees it
        problems = result.report["problems"]
        assert problems and all("ping-pong" in p for p in problems), problems
        # every judged size is below the floor, so the FAIL does not hang on one size; how
        # far below is the machine's (0.45 / 0.66 at 64 KiB / 4 MiB on an Intel Xeon VM)
        judged = {s["nbytes"]: s["ratio"] for s in result.report["sizes"] if s["judged"]}
        assert sorted(judged) == [64 << 10, 4 << 20], judged
        assert all(r < validate.DEFAULT_THRESHOLD for r in judged.values()), judged
        assert len(problems) == len(judged), problems


@container
def test_a_real_run_split_around_the_floor_runs_up_to_max_trials(image, tmp_path):
    """Healthy ratios lie near 1 here, so a floor of 1.0 usually splits the first five
    trials of some size: then the run goes on to --max-trials; where it does not, it stops
    at 5. Either way the report's own per-trial figures must agree with what ran."""
    if missing(HEALTHY):
        pytest.skip(missing(HEALTHY))
    report_file = tmp_path / "r.json"
    result = run(["hpcai-launch", "validate", "--container", str(image), "-N", "2",
                  "--threshold", "1.0", "--max-trials", "6", "--json", str(report_file)],
                 image_env(), cwd=tmp_path, timeout=600)
    report = json.loads(report_file.read_text())
    assert result.returncode in (0, 1), result.stdout + result.stderr[-3000:]
    first_five_split = []
    for s in report["sizes"]:
        ratios = [b / c for b, c in zip(s["bare_us"][:5], s["container_us"][:5])]
        below = sum(r < 1.0 for r in ratios)
        if s["judged"] and 0 < below < 5:
            first_five_split.append(f"{validate._size(s['nbytes'])}: {below} of 5 trials "
                                    "below the floor")
    assert report["extended"] == first_five_split, (report["extended"], report["sizes"])
    assert report["trials_run"] == (6 if first_five_split else 5)
    if first_five_split:
        assert "6 trial(s) per side run: 5, then up to 6 as" in result.stdout, result.stdout
        assert "median of 6 trials per side" in result.stdout


@container
def test_validate_inside_a_one_cpu_cpuset_is_refused_before_any_rank_starts(image, tmp_path):
    """The launcher itself in a cpuset cgroup that allows only CPU 0 plans within it: 2 ranks
    need 2 cores, so validate refuses (error/hint, exit 2) naming the CPU set, and writes no
    report. The healthy set-up above, outside the cgroup, is the control."""
    why = missing("cpu-binding")
    if why:
        pytest.skip(why)
    report = tmp_path / "report.json"
    with cpuset("0") as group:
        result = run(["sh", "-c", 'echo $$ > "$0/tasks" && exec "$@"', str(group),
                      "hpcai-launch", "validate", "--container", str(image), "-N", "2",
                      "--json", str(report)], image_env(), timeout=300)
    assert result.returncode == 2, result.stdout + result.stderr
    assert result.stderr.startswith("error: 2 ranks x 1 cores each need 2 cores"), \
        result.stderr
    assert "cpus 0 (this process's CPU affinity)" in result.stderr
    assert "hint: " in result.stderr and not report.exists()


@container
def test_bare_side_that_cannot_run_is_unverified(image, tmp_path):
    """The host's Python cannot import mpi4py (a sitecustomize blocks it, on PYTHONPATH in
    /var/tmp, which ch-run does not bind: the image's Python is unaffected). The floor cannot
    be checked: exit 3, never OK."""
    shim = Path(tempfile.mkdtemp(prefix="hpcai-no-mpi4py-", dir="/var/tmp"))
    try:
        (shim / "sitecustomize.py").write_text("import sys\nsys.modules['mpi4py'] = None\n")
        env = image_env()
        env["PYTHONPATH"] = str(shim)
        result = run(["hpcai-launch", "validate", "--container", str(image), "-N", "2",
                      "--json", str(tmp_path / "r.json")], env, cwd=tmp_path, timeout=600)
    finally:
        shutil.rmtree(shim)
    assert result.returncode == 3, result.stdout + result.stderr[-3000:]
    assert "UNVERIFIED: the bare host probe did not measure in trial(s) 1-5 of 5" \
        in result.stdout, result.stdout
    assert "mpi4py" in result.stdout, result.stdout     # the reason, from the bare probe
    assert "verdict: UNVERIFIED (exit 3)" in result.stdout and "OK:" not in result.stdout
    assert json.loads((tmp_path / "r.json").read_text())["verdict"] == "UNVERIFIED"


@container
@pytest.mark.parametrize("args, message", [
    (["--trials", "3"], "needs at least 5 trials"),
    (["--threshold", "1.5"], "is not a ratio"),
    (["--max-trials", "4"], "--max-trials 4 is below --trials 5"),
    (["-N", "1"], "validate needs two"),
    (["--only", "mpi,speedy"], "--only mpi,speedy: unknown check 'speedy'"),
    (["--only", "mpi", "--trials", "5"], "--trials with --only mpi: trials are the speed"),
])
def test_usage_errors(args, message, image, tmp_path):
    result = run(["hpcai-launch", "validate", "--container", str(image), "-N", "2", *args],
                 image_env(), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert message in result.stderr and "hint: " in result.stderr
    assert not list(tmp_path.iterdir()), "nothing may be run or written"


@container
def test_only_runs_the_named_checks_and_says_what_it_left_out(image, tmp_path):
    """``--only``: the image's own MPI (``--no-bind-host-mpi``) passes a validate that leaves
    mpi out, saying so, in one container launch; with mpi named it FAILS as the full
    validate does (the image-mpi control)."""
    if missing("image-mpi"):
        pytest.skip(missing("image-mpi"))
    base = ["hpcai-launch", "validate", "--container", str(image), "-N", "2",
            "--no-bind-host-mpi"]
    left_out = run([*base, "--only", "world,binding", "--json", "left-out.json"],
                   image_env(), cwd=tmp_path, timeout=300)
    assert left_out.returncode == 0, left_out.stdout + left_out.stderr[-3000:]
    assert "OK: 2 ranks, one world, bound as planned; not checked (--only): mpi, fabric, " \
        "gpu, speed" in left_out.stdout, left_out.stdout
    report = json.loads((tmp_path / "left-out.json").read_text())
    assert report["checks"] == ["world", "binding"] and report["valid"], report["checks"]
    assert report["not_checked"] == ["mpi", "fabric", "gpu", "speed"]
    assert len(report["container"]) == 1 and report["bare"] == [] and report["sizes"] == []
    named = run([*base, "--only", "mpi", "--json", "named.json"], image_env(), cwd=tmp_path,
                timeout=300)
    assert named.returncode == 1, named.stdout + named.stderr[-3000:]
    assert re.search(CAUSES["image-mpi"], named.stdout, re.MULTILINE), named.stdout
    assert "verdict: FAIL (exit 1)" in named.stdout
    assert json.loads((tmp_path / "named.json").read_text())["checks"] == ["world", "mpi"]


# --- the checks, on hand-made records -----------------------------------------------------

WANT = Expectation(world=2, host="n1", cpus={0: (0,), 1: (1,)},
                   libmpi_prefix="/opt/hpcai/host", unbound=None,
                   host_roots=("/opt/hpcai/host", "/opt/hpcai/work"), topology="test")


def _record(rank: int, size: int = 2, *, pid: int = 100, host: str = "n1", local: int = 0,
            cpus: tuple[int, ...] = (0,), libmpi: str = "/opt/hpcai/host/lib/libmpi.so.40",
            fabric: dict[str, str] | None = None, plan: str | None = None) -> ProbeRecord:
    return ProbeRecord(rank=rank, size=size, allreduce_ok=True, host=host, pid=pid + rank,
                       affinity=cpus, affinity_list=",".join(map(str, cpus)),
                       env={"LOCAL_RANK": str(local), "HPCAI_CPUS": plan},
                       mpi_library_version="Open MPI v4.1.4",
                       libmpi=(libmpi,), fabric=fabric or {},
                       pingpong=(PingPong(8, 0.5, 0.4, 60),) if rank == 0 else None)


def _launch(*records: ProbeRecord) -> Launch:
    return Launch("container", 0, "", records)


def test_world_checks():
    good = _launch(_record(0), _record(1, local=1, cpus=(1,)))
    assert check_world(good, WANT) == []
    singletons = check_world(_launch(_record(0, 1), _record(0, 1, pid=200)), WANT)
    assert any("rank 0 reported by 2 processes" in p for p in singletons), singletons
    assert any(p.startswith("singleton world: 2 processes") for p in singletons), singletons
    short = check_world(_launch(_record(0)), WANT)
    assert "1 probe record(s) for a planned world of 2" in short
    assert "rank(s) 1 of 2 did not report; the container probe exited 0: no output" in short
    # one of two singletons ended before reporting: still named as a singleton world
    lone = Launch("container", 1, "ORTE_ERROR_LOG: Error in file ess_singleton_module.c\n",
                  (_record(0, 1),))
    assert check_world(lone, WANT) == [
        "1 probe record(s) for a planned world of 2",
        "singleton world: the one process that reported is rank 0 of 1 (the ranks' MPI found "
        "no PMI it speaks: check the launcher, its PMI and the MPI the ranks load)",
        "1 of 2 planned process(es) did not report; the container probe exited 1: "
        "ORTE_ERROR_LOG: Error in file ess_singleton_module.c"]
    big = check_world(_launch(_record(0, 3), _record(1, 3), _record(2, 3)), WANT)
    assert "3 probe record(s) for a planned world of 2" in big
    assert "rank 0 on n1 sees a world of 3, the plan has 2" in big
    crashed = Launch("container", 1, "Traceback\n  File x\nImportError: no mpi4py\n"
                                     "mpirun detected that one or more processes exited", ())
    assert check_world(crashed, WANT) == [
        "no rank reported; the container probe exited 1: ImportError: no mpi4py"]


def test_mpi_cpu_and_fabric_checks():
    image_mpi = _launch(_record(0, libmpi="/usr/lib/x86_64-linux-gnu/libmpi.so.40.30.4"))
    assert check_mpi(image_mpi, WANT) == [
        "rank 0 on n1 runs MPI from the image's /usr/lib/x86_64-linux-gnu/libmpi.so.40.30.4, "
        "not from /opt/hpcai/host"]
    swapped = _launch(_record(0, cpus=(1,)), _record(1, local=1, cpus=(0,)))
    assert [p.split(",")[0] for p in check_cpus(swapped, WANT)] == [
        "rank 0 on n1 (local rank 0) runs on CPUs 1", "rank 1 on n1 (local rank 1) runs on CPUs 0"]
    remote = _launch(_record(1, host="n2", cpus=(3,), plan="2"))
    assert "the per-rank plan (HPCAI_CPUS) has 2" in check_cpus(remote, WANT)[0]
    bare = Launch("bare", 0, "", (_record(0, fabric={"libucp": "/usr/lib/libucp.so.0"}),))
    host_ucx = _launch(_record(0, fabric={"libucp": "/opt/hpcai/host/lib/libucp.so.0"}))
    assert check_fabric(host_ucx, bare, WANT) == []
    image_ucx = _launch(_record(0, fabric={"libucp": "/usr/lib/libucp.so.0"}))
    assert "loads libucp from the image (/usr/lib/libucp.so.0)" in check_fabric(
        image_ucx, bare, WANT)[0]
    assert "loads no libucp" in check_fabric(_launch(_record(0)), bare, WANT)[0]


def _speeds(side: str, us: float) -> Launch:
    """A launch whose rank 0 measured ``us`` at 64 KiB and 4 MiB (8 B: 1 us)."""
    cpus = {0: (0,), 1: (1,)}
    pingpong = (PingPong(8, 1.0, 1.0, 60), PingPong(64 << 10, us / 10, us / 10, 60),
                PingPong(4 << 20, us, us, 60))
    rank0 = replace(_record(0, cpus=cpus[0]), pingpong=pingpong)
    return Launch(side, 0, "", (rank0, _record(1, local=1, cpus=cpus[1])))


def _trials(container_us: list[float], trials: int = 5, max_trials: int = 15):
    """run_trials over hand-made launches: the bare side at 200 us every time, the
    container's trial i at container_us[i]; returns the outcome and the launches asked for."""
    asked: list[str] = []

    def run(options, side, out):
        asked.append(side)
        trial = int(out.name.rsplit("-", 1)[1])
        return _speeds(side, 200.0 if side == "bare" else container_us[trial])

    outcome = validate.run_trials(None, WANT, trials, 0.8, Path("/nonexistent"), max_trials,
                                  run=run)
    return outcome, asked


@pytest.mark.parametrize("container_us, trials_run, verdict, extended", [
    ([210.0] * 15, 5, "OK", []),                    # every trial above the floor: settled
    ([800.0] * 15, 5, "FAIL", []),                  # every trial below (TCP): settled
    # split 3 below / 2 above in the first five: more trials, up to 15; the later ones
    # decide the median, either way
    ([800, 200, 800, 200, 800] + [200] * 10, 15, "OK", ["3 of 5"]),
    ([800, 200, 800, 200, 800] + [800, 200] * 5, 15, "FAIL", ["3 of 5"]),
    # one trial of five below: split too, so all 15 run (the median stays above)
    ([200, 800, 200, 200, 200] + [200] * 10, 15, "OK", ["1 of 5"]),
])
def test_a_size_split_around_the_floor_gets_more_trials(container_us, trials_run, verdict,
                                                         extended):
    outcome, asked = _trials(container_us)
    assert outcome.trials_run == trials_run and len(asked) == 2 * trials_run
    assert asked[:4] == ["container", "bare", "bare", "container"]     # alternated
    assert outcome.verdict[0] == verdict, outcome.problems
    assert outcome.extended == [f"{size}: {e} trials below the floor"
                                for e in extended for size in ("64 KiB", "4 MiB")]
    assert all(len(s.container_us) == trials_run for s in outcome.sizes)


@pytest.mark.parametrize("checks, sides", [
    (("world", "binding"), ["container"]),
    (("world", "mpi"), ["container", "bare"]),
    (("world", "fabric", "gpu"), ["container", "bare"]),
])
def test_without_speed_each_side_runs_once_and_only_the_named_checks_judge(checks, sides):
    """No trials without speed: one container launch, one bare launch only for what compares
    with it; rank 1 on rank 0's CPUs FAILS only where binding is named."""
    asked: list[str] = []

    def run(options, side, out):
        asked.append(side)
        return _launch(_record(0), _record(1, local=1, cpus=(0,)))

    outcome = validate.run_trials(None, WANT, 5, 0.8, Path("/nonexistent"), 15, run=run,
                                  checks=checks)
    assert asked == sides and outcome.trials_run == 1 and outcome.sizes == []
    assert outcome.checks == checks
    if "binding" in checks:
        assert outcome.verdict[0] == "FAIL", outcome.problems
        assert outcome.problems[0].startswith("rank 1 on n1 (local rank 1) runs on CPUs 0")
    else:
        assert outcome.verdict[0] == "OK", outcome.problems


def test_only_names_checks_in_their_order_with_world_and_the_probe_follows():
    assert validate._checks(None) == validate.CHECKS
    assert validate._checks("speed, mpi") == ("world", "mpi", "speed")
    assert validate.probe_args(("world", "mpi")) == ("-m", "hpcai.launcher.probe", "--quiet")
    assert validate.probe_args() == validate.PROBE
    for bad in ("", "mpi,,speed", "MPI"):
        with pytest.raises(validate.UserError):
            validate._checks(bad)


def test_max_trials_equal_to_trials_never_extends():
    outcome, _ = _trials([800, 200, 800, 200, 800], max_trials=5)
    assert outcome.trials_run == 5 and outcome.verdict[0] == "FAIL" and not outcome.extended
    assert "median of 5 trials" in outcome.problems[0]


def test_launch_warnings_name_the_trials_and_the_whole_message():
    cma = ("----\nWARNING: The default btl_vader_single_copy_mechanism CMA is\nnot available "
           "due to different user namespaces.\n\nThe vader shared memory BTL will fall back\n")
    runs = [Launch("container", 0, cma, ()), Launch("container", 0, "", ()),
            Launch("container", 0, "warning: x\n" + cma, ())]
    assert validate.launch_warnings(runs) == [
        "container trial(s) 1,3 printed: WARNING: The default btl_vader_single_copy_mechanism "
        "CMA is not available due to different user namespaces.",
        "container trial(s) 3 printed: warning: x"]


def test_a_launch_that_does_not_end_is_stopped_with_its_children(monkeypatch, tmp_path):
    monkeypatch.setattr(validate, "LAUNCH_TIMEOUT_S", 1)
    pid_file = tmp_path / "child"
    code, err = validate._run(["sh", "-c", 'sleep 60 & echo $! > "$0"; wait', str(pid_file)])
    assert code == -1 and "no end after 1 s: stopped" in err
    child = int(pid_file.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the launch's child {child} is still running")


# --- which libmpi: dladdr ----------------------------------------------------------------

def _python(code: str, **env: str) -> str:
    result = subprocess.run([sys.executable, "-c", code], env=base_env(**env),
                            capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.mpi
def test_libmpi_path_is_the_file_defining_mpi_init():
    from conftest import FLAVOURS
    if "openmpi" not in FLAVOURS:
        pytest.skip("needs Open MPI")
    expected = os.path.realpath("/usr/lib/x86_64-linux-gnu/libmpi.so.40")
    code = ("from hpcai.launcher.mpi.libmpi import libmpi_path; before = libmpi_path()\n"
            "{load}\nprint(before, libmpi_path())")
    # no MPI loaded: None; mpi4py's libmpi; a libmpi loaded privately (RTLD_LOCAL)
    assert _python(code.format(load="from mpi4py import MPI"),
                   MPI4PY_MPIABI="openmpi") == f"None {expected}"
    assert _python(code.format(load="import ctypes, os; "
                                    "ctypes.CDLL('libmpi.so.40', mode=os.RTLD_LOCAL)")) \
        == f"None {expected}"


def test_a_size_line_says_when_trials_timed_fewer_samples():
    """The probe cuts a slow size's samples (tests/test_probe.py); the line says so, and
    only then. 64 KiB in 16 ms is 4 MB/s, not '0.00 GB/s'."""
    slow = SizeResult(64 << 10, (16000.0,) * 5, (15000.0,) * 5, (10,) * 5, (10, 12, 10, 10, 11))
    line = slow.describe(0.1)
    assert "10-12 of 60 samples per trial" in line, line
    assert "4.10 MB/s" in line and "4.37 MB/s" in line and "GB/s" not in line, line
    full = SizeResult(64 << 10, (16.0,) * 5, (15.0,) * 5, (60,) * 5, (60,) * 5)
    assert "samples per trial" not in full.describe(0.1), full.describe(0.1)
    assert "4.10 GB/s" in full.describe(0.1)
