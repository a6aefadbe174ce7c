"""hpcai-launch's own fork and exec (:func:`hpcai.launcher.run.child.start_child`): the
child's exit status, its process group, its signals and descriptors, death with its parent,
and a program that cannot start; and what the outer hpcai-launch imports before it starts
anything (each unneeded module is start-up time of every launch)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from hpcai.launcher.run.child import start_child

PY = sys.executable


def test_exit_status_and_ending_signal_are_subprocess_s():
    assert start_child((PY, "-c", "raise SystemExit(3)"), {}).wait() == 3
    child = start_child((PY, "-c", "import time; time.sleep(60)"), {})
    child.send_signal(signal.SIGTERM)
    assert child.wait() == -signal.SIGTERM
    child.send_signal(signal.SIGTERM)          # waited for: nothing is sent any more


def test_the_child_has_its_own_group_the_plan_env_and_default_sigpipe(tmp_path):
    """The shell's own process group and variable, and ``cat``'s ignored signals: Python
    ignores SIGPIPE, and an exec keeps what is ignored (the control)."""
    out = tmp_path / "out"
    script = ('out=$1; set -- $(cat /proc/$$/stat); test "$5" -eq $$ && '
              'echo "group $HPCAI_T" > "$out"; grep SigIgn /proc/self/status >> "$out"')
    assert start_child(("/bin/sh", "-c", script, "sh", str(out)), {"HPCAI_T": "x"}).wait() == 0
    group, ignored = out.read_text().splitlines()
    assert group == "group x"
    assert not int(ignored.split()[1], 16) & 1 << (signal.SIGPIPE - 1), ignored
    control = subprocess.run(["grep", "SigIgn", "/proc/self/status"], capture_output=True,
                             text=True, restore_signals=False, check=True).stdout
    assert int(control.split()[1], 16) & 1 << (signal.SIGPIPE - 1), control


@pytest.mark.parametrize("keep", [False, True])
def test_inheritable_descriptors_are_closed_unless_kept(keep):
    read_end, write_end = os.pipe()
    os.set_inheritable(write_end, True)
    try:
        code = f"import os; os.write({write_end}, b'open')"
        status = start_child((PY, "-c", code), {}, keep_fds=keep).wait()
        os.close(write_end)
        said = os.read(read_end, 16)
    finally:
        os.close(read_end)
    assert (status, said) == ((0, b"open") if keep else (1, b""))


def _zombies() -> set[int]:
    """This process's children that ended and were not waited for."""
    found = set()
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(") ", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            found.add(int(name))
    return found


def test_a_program_that_cannot_start_raises_and_leaves_no_child(tmp_path):
    before = _zombies()
    with pytest.raises(FileNotFoundError):
        start_child((str(tmp_path / "missing"),), {})
    script = tmp_path / "not-executable"
    script.write_text("#!/bin/sh\n")
    with pytest.raises(PermissionError):
        start_child((str(script),), {})
    assert _zombies() == before                 # both children were waited for
    control = subprocess.Popen(["true"])
    control.returncode = 0                      # Popen will not wait for it now
    deadline = time.monotonic() + 5
    while control.pid not in _zombies() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _zombies() == before | {control.pid}
    os.waitpid(control.pid, 0)


PARENT = """
import os, signal, subprocess, sys, time
from hpcai.launcher.run.child import start_child
argv = (sys.executable, "-c", "import time; time.sleep(60)")
child = start_child(argv, {}) if sys.argv[1] == "start_child" else subprocess.Popen(
    argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
print(child.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("how", ["start_child", "control: Popen"])
def test_the_child_dies_with_its_parent(how):
    """A parent killed by SIGKILL (nothing of it runs any more) takes its child along; a
    child started with plain Popen outlives it (the control), and is ended here."""
    result = subprocess.run([PY, "-c", PARENT, how.split()[-1]], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == -signal.SIGKILL, result.stderr
    pid = int(result.stdout)
    deadline = time.monotonic() + 2
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    gone = not _alive(pid)
    if not gone:
        os.kill(pid, signal.SIGKILL)
    assert gone == (how == "start_child")


def _imports(argv: list[str], env: dict[str, str]) -> set[str]:
    """The modules a Python process imported, from its own import log (-X importtime)."""
    env = dict(env, PYTHONPROFILEIMPORTTIME="1")
    result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 0, result.stderr[-2000:]
    return {line.split("|")[-1].strip() for line in result.stderr.splitlines()
            if line.startswith("import time:")}


HEAVY = {"typing", "subprocess", "threading", "traceback", "sysconfig", "dataclasses",
         "socket", "inspect"}


def test_the_outer_launcher_plans_without_heavy_imports(tmp_path):
    """``hpcai-launch --dry-run`` for a bare mpirun launch, its MPI's ``--version`` text in
    the cache, imports none of :data:`HEAVY` (typing alone is about 5 ms of every launch).
    Controls: with an empty cache it runs ``mpirun --version`` and so imports subprocess;
    the same log of a process that imports them all shows them all."""
    env = dict(os.environ, HPCAI_CACHE=str(tmp_path / "cache"))
    launch = [os.path.join(os.path.dirname(PY), "hpcai-launch"), "--ranks-per-node", "2",
              "--launcher", "mpirun", "--mpi", "openmpi", "--dry-run", "--",
              "python", "-c", "pass"]
    missed = _imports(launch, env)
    assert "hpcai.launcher.planning.plan" in missed and "subprocess" in missed
    keep = ("from hpcai.launcher.mpi import flavours; import sys; "
            "flavours.detect(flavours.find_launcher(flavours.get('openmpi'), dict(os.environ)), "
            "cache=sys.argv[1]); flavours.keep_versions()")
    subprocess.run([PY, "-c", "import os; " + keep, env["HPCAI_CACHE"]], check=True, env=env)
    seen = _imports(launch, env)
    assert "hpcai.launcher.planning.plan" in seen               # it did plan
    assert not HEAVY & seen, sorted(HEAVY & seen)
    assert HEAVY <= _imports([PY, "-c", "import " + ", ".join(sorted(HEAVY))], env)
