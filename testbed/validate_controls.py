"""``hpcai-launch validate`` on a healthy set-up and on each negative control, as real runs.

Shared by ``tests/test_validate.py`` (each once) and ``bench/validate_repeat.py`` (20 and 5
times). Every control is a set-up a site can really end up with; each must FAIL with a
line that names its cause (:data:`CAUSES`):

- ``singleton``: MPICH's ``mpiexec`` starts the ranks, but they run the host's Open MPI
  (its staged libraries given with ``--host-libs``): no PMI that Open MPI speaks, so each
  rank is "rank 0 of 1";
- ``image-mpi``: ``--no-bind-host-mpi``: the ranks run the image's own Open MPI;
- ``tcp-fallback``: Open MPI inside the container forced onto TCP (``OMPI_MCA_btl=self,tcp``
  from a site profile's env, which only the container gets): the slow path that still works;
- ``missing-fabric``: host MPICH (built on UCX) with the host's ``libucp.so.0`` missing from
  the staged libraries: MPICH silently loads the image's UCX instead;
- ``cpu-binding``: the ranks in a cpuset cgroup (what Slurm's ConstrainCores makes) that
  allows only CPU 0, which neither the launcher (outside it: ``--mpirun`` is a wrapper that
  moves MPICH's ``mpiexec`` into it) nor the ranks' wrappers can read (the wrapper runs
  mpiexec in a mount namespace with an empty directory over ``/sys/fs/cgroup``). The plan
  gives rank 1 CPU 1, the kernel refuses it, and it runs on CPU 0. (A launcher inside such a cgroup plans within it and refuses 2 ranks
  on 1 CPU before any starts: ``tests/test_validate.py``.)
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

HEALTHY = "healthy"
CONTROLS = ("singleton", "image-mpi", "tcp-fallback", "missing-fabric", "cpu-binding")
SCENARIOS = (HEALTHY, *CONTROLS)

# The FAIL line that names each control's cause.
CAUSES = {
    "singleton": r"FAIL: singleton world: .* rank 0 of 1 ",
    "image-mpi": r"FAIL: rank \d on \S+ runs MPI from the image's /usr/lib/\S*/libmpi\.so\.40",
    "tcp-fallback": r"FAIL: (64 KiB|4 MiB) ping-pong: the container reaches 0\.\d\d x the "
                    r"bare bandwidth",
    "missing-fabric": r"FAIL: rank \d on \S+ loads libucp from the image \(/usr/lib/\S+\)",
    "cpu-binding": r"FAIL: rank 1 on \S+ \(local rank 1\) runs on CPUs 0, the plan .* has 1$",
}
# What each scenario needs on the host, beyond the image and Charliecloud.
NEEDS = {HEALTHY: ("mpirun.openmpi",), "singleton": ("mpirun.openmpi", "mpiexec.mpich"),
         "image-mpi": ("mpirun.openmpi",), "tcp-fallback": ("mpirun.openmpi",),
         "missing-fabric": ("mpiexec.mpich",), "cpu-binding": ("mpiexec.mpich", "unshare")}
CPUSET_ROOT = Path("/sys/fs/cgroup/cpuset")


@dataclass(frozen=True)
class Result:
    scenario: str
    code: int
    stdout: str
    stderr: str
    report: dict | None
    seconds: float

    @property
    def verdict(self) -> str:
        return self.report["verdict"] if self.report else f"no report (exit {self.code})"

    def cause_named(self) -> bool:
        """Does the output name the scenario's cause (or, healthy: say OK)?"""
        if self.scenario == HEALTHY:
            return self.code == 0 and "verdict: OK" in self.stdout
        return re.search(CAUSES[self.scenario], self.stdout, re.MULTILINE) is not None

    def ratios(self) -> dict[str, float]:
        return {str(s["nbytes"]): s["ratio"] for s in (self.report or {}).get("sizes", [])}


def missing(scenario: str) -> str | None:
    """Why this scenario cannot run on this machine (None: it can)."""
    absent = [cmd for cmd in NEEDS[scenario] if shutil.which(cmd) is None]
    if absent:
        return f"{' and '.join(absent)} not installed"
    if scenario == "cpu-binding" and (os.geteuid() != 0 or not os.access(CPUSET_ROOT, os.W_OK)):
        return f"needs root and a writable cgroup v1 cpuset hierarchy at {CPUSET_ROOT}"
    return None


def _mpich() -> list[str]:
    return ["--mpi", "mpich", "--mpirun", shutil.which("mpiexec.mpich") or "mpiexec.mpich"]


def staged_host_libs(image: Path, mpi_args: list[str], env: dict[str, str], cwd: Path) -> Path:
    """The host libraries hpcai-launch stages for this MPI (staged by a real 1-rank run)."""
    base = ["hpcai-launch", "-N", "1", *mpi_args, "--container", str(image)]
    subprocess.run([*base, "--", "true"], env=env, cwd=cwd, capture_output=True, text=True,
                   timeout=300, check=True)
    plan = subprocess.run([*base, "--dry-run", "--json", "--", "true"], env=env, cwd=cwd,
                          capture_output=True, text=True, timeout=300, check=True)
    argv = json.loads(plan.stdout)["argv"]
    return Path(argv[argv.index("--host-libs") + 1])


@contextmanager
def cpuset(cpus: str) -> Iterator[Path]:
    """A cpuset cgroup allowing only ``cpus``; processes left in it are moved out after."""
    group = CPUSET_ROOT / f"hpcai-validate-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpuset.mems").write_text((CPUSET_ROOT / "cpuset.mems").read_text())
        (group / "cpuset.cpus").write_text(cpus)
        yield group
    finally:
        for pid in (group / "tasks").read_text().split():
            try:
                (CPUSET_ROOT / "tasks").write_text(pid)
            except OSError:
                pass   # it ended meanwhile
        group.rmdir()


@contextmanager
def scenario_argv(scenario: str, image: Path, env: dict[str, str],
                  work: Path) -> Iterator[list[str]]:
    """The command that runs ``hpcai-launch validate`` for this scenario (set up, cleaned up
    after)."""
    validate = ["hpcai-launch", "validate", "--container", str(image), "-N", "2"]
    if scenario == HEALTHY:
        yield validate
    elif scenario == "singleton":
        openmpi = staged_host_libs(image, [], env, work)
        yield [*validate, *_mpich(), "--host-libs", str(openmpi)]
    elif scenario == "image-mpi":
        yield [*validate, "--no-bind-host-mpi"]
    elif scenario == "tcp-fallback":
        site = work / "tcp-site.toml"
        site.write_text('[env]\nOMPI_MCA_btl = "self,tcp"\n')
        yield [*validate, "--mpi", "openmpi", "--site", str(site)]
    elif scenario == "missing-fabric":
        staged = staged_host_libs(image, _mpich(), env, work)
        broken = work / "staged-without-libucp"
        if not broken.exists():
            shutil.copytree(staged, broken, symlinks=True)
            (broken / "lib" / "libucp.so.0").unlink()
        yield [*validate, *_mpich(), "--host-libs", str(broken)]
    elif scenario == "cpu-binding":
        hidden = work / "no-cgroups"
        hidden.mkdir(exist_ok=True)
        with cpuset("0") as group:
            # mpiexec moves itself into the cpuset, then runs in a mount namespace in which
            # an empty directory hides /sys/fs/cgroup (root: the test owns both)
            wrapper = work / "mpiexec-in-hidden-cpuset"
            wrapper.write_text(
                "#!/bin/sh\n"
                f"echo $$ > {shlex.quote(str(group / 'tasks'))} && exec unshare --mount "
                "sh -c 'mount --bind \"$0\" /sys/fs/cgroup && exec \"$@\"' "
                f"{shlex.quote(str(hidden))} {shlex.quote(_mpich()[-1])} \"$@\"\n")
            wrapper.chmod(0o755)
            yield [*validate, "--mpi", "mpich", "--mpirun", str(wrapper)]
    else:
        raise ValueError(f"unknown scenario {scenario!r}")


_SHARED: dict[tuple[str, str], Result] = {}


def shared_scenario(scenario: str, image: Path, env: dict[str, str], factory) -> Result:
    """:func:`run_scenario`, run once per test run for each scenario and image: the tests that
    only read a run's output share it (``tests/test_validate.py`` and
    ``tests/test_containers.py``). ``factory`` is pytest's ``tmp_path_factory``. Under
    pytest-xdist the workers share the run's base directory: the first worker to ask runs the
    scenario there while holding a lock, and the others wait on the lock and read its result."""
    key = (scenario, str(Path(image).resolve()))
    if key in _SHARED:
        return _SHARED[key]
    base = factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    name = f"validate-{scenario}-{hashlib.sha256(key[1].encode()).hexdigest()[:12]}"
    done = root / f"{name}.json"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if done.exists():
            result = Result(**json.loads(done.read_text()))
        else:
            work = root / name
            work.mkdir(exist_ok=True)
            result = run_scenario(scenario, image, env, work)
            tmp = done.with_suffix(".tmp")
            tmp.write_text(json.dumps(asdict(result)))
            tmp.replace(done)
    _SHARED[key] = result
    return result


def run_scenario(scenario: str, image: Path, env: dict[str, str], work: Path) -> Result:
    """One ``hpcai-launch validate`` run of this scenario, in ``work`` (bound as the ranks'
    working directory)."""
    import time

    report = work / f"{scenario}.json"
    report.unlink(missing_ok=True)
    with scenario_argv(scenario, image, env, work) as argv:
        start = time.monotonic()
        result = subprocess.run([*argv, "--json", str(report)], env=env, cwd=work,
                                capture_output=True, text=True, timeout=900, check=False)
        seconds = time.monotonic() - start
    data = json.loads(report.read_text()) if report.exists() else None
    return Result(scenario, result.returncode, result.stdout, result.stderr, data, seconds)
