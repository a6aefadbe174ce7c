"""Plan once per job: the one plan file that the planning rank writes and the others read.

When mpirun, mpiexec or srun starts ``hpcai-launch`` as the per-rank wrapper, one rank per
job plans: rank 0, or every node's local rank 0 where the job's identity is node-local
(plain MPICH's Hydra outside Slurm) or the job directory is (the site profile's
``job_dir_scope = "node"``). It gathers the facts as before (MPI, host libraries, staging)
and writes a :class:`RankTemplate` - every local rank's binding and environment, the
job-wide environment and the command - as one JSON file in the job directory
(:func:`job_dir`: ``HPCAI_JOB_DIR``, the site profile's ``job_dir``, or ``<cache>/jobs``,
under the home directory and so shared between the nodes at a site), after removing plans
older than a day (:func:`prune`, at most hourly). Every other rank waits for that file
(``HPCAI_PLAN_TIMEOUT`` seconds, default 120), checks its :class:`PlanKey` against itself,
takes its local rank's entry and execs (:func:`hpcai.launcher.run.execute.run_rank`): no MPI
detection, no ``ldconfig``, no library scans, and no import beyond this module,
:mod:`.rankenv`, the ``run`` room's :mod:`~hpcai.launcher.run.execute` and
:mod:`~hpcai.launcher.run.child`, :mod:`hpcai.core.record` and ``json`` (``tomllib`` too
with a site profile; :mod:`~hpcai.launcher.run.rankwatch` under Hydra).

A plan for another job, node list, world size, command line or directory, or one whose image,
host MPI or staged libraries changed since it was written, is an error. A plan of an earlier
launch with the same job id (other :data:`LAUNCH_KEYS` values), or written long before this
rank started (:data:`STALE_S`), is not read: the rank waits for a fresh one.
A rank of an srun step whose environment has :data:`PLAN_ENV` (set by the job scripts of
``hpcai-launch sbatch`` after ``hpcai-launch plan-step`` planned the step on the batch host)
reads that file at once, keyed ``slurm:JOB.batch``, and never plans for the others. So do
the ranks of an outer ``hpcai-launch`` that starts them all on its own host with mpirun or
mpiexec (:mod:`hpcai.launcher.outerplan`): it writes their plan before the launch and passes
:data:`PLAN_ENV` and :data:`LAUNCH_ENV` (a token of that launch, keyed ``launch:TOKEN``).
Where planning would differ on this rank (another number of local ranks or of CPUs on its
node, other environment variables that planning reads) the rank plans by itself, as before.
"""

from __future__ import annotations

import os
import time

from ...core.errors import UserError
from ...core.paths import cache_root
from ...core.record import named_tuple
from .rankenv import RankInfo, torch_env

SHARED, NODE = "shared", "node"   # the site profile's job_dir_scope values, owned here
JOB_DIR_SCOPES = (SHARED, NODE)    # because a rank reads them without importing .site

FORMAT = 1
DEFAULT_TIMEOUT_S = 120.0
STALE_S = 120.0          # a plan older than this before the rank started is another job's
KEEP_S = 86400.0         # planners remove plans older than this from the job directory
PRUNE_EVERY_S = 3600.0   # at most this often (the mtime of PRUNED_STAMP there says when)
PRUNED_STAMP = ".pruned"
NODE_MARK = "\0node\0"   # stands for the node rank in the template's argv (argv has no NUL)
JOB_MARK = "\0job\0"     # stands for the rank's job key (RankInfo.job_key) there
PLAN_ENV = "HPCAI_PLAN"  # a plan prepared before the launch (plan-step, or the outer launcher)
LAUNCH_ENV = "HPCAI_PLAN_LAUNCH"   # beside it: the outer hpcai-launch's token for its launch
# Per launcher (RankInfo.started_by): variables equal on every rank of one launch and new
# at the next one (srun's contact point; mpirun's URI and PMIx namespace; Hydra's id). A plan
# of an earlier launch with the same job id (a restarted Slurm counts from 1 again) is stale.
LAUNCH_KEYS = {"slurm": ("SLURM_SRUN_COMM_HOST", "SLURM_SRUN_COMM_PORT",
                         "SLURM_STEP_LAUNCHER_PORT"),
               "openmpi": ("OMPI_MCA_orte_hnp_uri", "PMIX_NAMESPACE"),
               "hydra": ("I_MPI_HYDRA_UUID",)}
# Variables that planning reads; a rank whose values differ plans by itself.
ENV_KEYS = ("PATH", "LD_LIBRARY_PATH", "HOME", "XDG_CACHE_HOME", "MASTER_ADDR",
            "MASTER_PORT", "MPI4PY_MPIABI", "SLURM_MPI_TYPE", "I_MPI_ROOT", "I_MPI_PMI_LIBRARY",
            "MPI_HOME", "MPI_ROOT", "MPICH_HOME", "OPAL_PREFIX")


@named_tuple
class PlanKey:
    """What a plan belongs to. ``files``: (role, path, identity) of the image, host MPI and
    staged libraries the plan uses; a rank re-reads only their ``stat``."""

    job: str                                  # RankInfo.job_key: slurm:JOB.STEP, ompi:ID
    launch: str                               # LAUNCH_KEYS' values
    nodes: tuple[str, ...]
    size: int
    argv: tuple[str, ...]                     # the wrapper's options and command
    cwd: str
    env: tuple[tuple[str, str], ...]
    cpus: int | None                          # the node's CPU count (the template's CPU sets)
    files: tuple[tuple[str, str, str], ...] = ()


@named_tuple
class RankEntry:
    """One local rank: its thread environment and CPU set (None: not bound)."""

    env: tuple[tuple[str, str], ...]
    bind_cpus: tuple[int, ...] | None


@named_tuple
class RankTemplate:
    """Everything a rank of one node needs, the same for every node of the job."""

    ranks: tuple[RankEntry, ...]              # by local rank
    env: tuple[tuple[str, str], ...]          # job-wide: host MPI, container, PMI
    argv: tuple[str, ...]                     # NODE_MARK where the node rank goes
    compat_links: tuple[tuple[str, str], ...] = ()


@named_tuple
class JobRole:
    """This rank's part in planning: where the job's plan lives, and who writes it."""

    info: RankInfo
    path: str
    planner: bool
    argv: tuple[str, ...]
    loud: bool          # says this node's errors: its first rank that does not plan
    launch: str         # LAUNCH_KEYS' values: which launch of the job this is
    prepared: str = ""  # the key of a plan written before the launch (PLAN_ENV), else ""


def role(argv: list[str], env: dict[str, str], info: RankInfo | None) -> JobRole | None:
    """None when this process is no rank, asks for no launch (``--dry-run``, help), or
    cannot write the job directory (a read-only home inside a container): every rank then
    plans by itself, as before plan-once. The answer is the same on every rank that sees
    the same file system."""
    head = argv[:argv.index("--")] if "--" in argv else argv
    if info is None or any(a in ("--dry-run", "-h", "--help") for a in head):
        return None
    if env.get(PLAN_ENV) and env.get(LAUNCH_ENV) and info.started_by != "slurm":
        token = env[LAUNCH_ENV]
        return JobRole(info, env[PLAN_ENV], False, tuple(argv), loud=info.local_rank == 0,
                       launch=outer_launch(token), prepared=outer_key(token))
    if env.get(PLAN_ENV) and info.started_by == "slurm":
        job = env.get("SLURM_JOB_ID", "")
        return JobRole(info, env[PLAN_ENV], False, tuple(argv), loud=info.local_rank == 0,
                       launch=prepared_launch(job), prepared=prepared_key(job))
    where, scope = job_dir(env, head)
    if not writable(where):
        return None
    # a node-local identity (plain MPICH's Hydra outside Slurm) or a node-local job dir
    node_scoped = info.job_key.startswith("hydra-ppid:") or scope == NODE
    name = info.job_key
    if node_scoped:
        name += f"@{os.uname().nodename}" + (f"-{info.node_rank}" if scope == NODE else "")
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in name)
    path = os.path.join(where, f"plan-{safe}.json")
    planner = info.local_rank == 0 if node_scoped else info.rank == 0
    plans_here = node_scoped or info.node_rank == 0
    launch = ";".join(f"{k}={env[k]}" for k in LAUNCH_KEYS[info.started_by] if k in env)
    return JobRole(info, path, planner, tuple(argv),
                   loud=info.local_rank == (1 if plans_here else 0), launch=launch)


def prepared_key(job_id: str) -> str:
    """The job key of the plan that ``hpcai-launch plan-step`` writes in batch job
    ``job_id`` for the srun step the script starts next."""
    return f"slurm:{job_id}.batch"


def prepared_launch(job_id: str) -> str:
    return f"batch={job_id}"


def outer_key(token: str) -> str:
    """The job key of the plan an outer hpcai-launch writes for the launch ``token``."""
    return f"launch:{token}"


def outer_launch(token: str) -> str:
    return f"launch={token}"


def prepared_path(env: dict[str, str], head: list[str] | tuple[str, ...]) -> str:
    """Where ``plan-step`` writes the plan of batch job ``SLURM_JOB_ID``: the job
    directory (:func:`job_dir`)."""
    where, _ = job_dir(env, head)
    return os.path.join(where, f"plan-slurm_{env.get('SLURM_JOB_ID', '0')}.batch.json")


def writable(path: str) -> bool:
    """Whether ``path``, or the nearest directory above it that exists, can be written."""
    while not os.path.isdir(path):
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent
    return os.access(path, os.W_OK | os.X_OK)


def job_dir(env: dict[str, str], head: list[str] | tuple[str, ...] = ()) -> tuple[str, str]:
    """(directory, scope) of the job's plan: ``HPCAI_JOB_DIR``, else the site profile's
    ``job_dir`` (``--site`` in ``head``, else ``HPCAI_SITE``), else ``jobs`` in hpcai's cache
    (``HPCAI_CACHE``, else ``$XDG_CACHE_HOME/hpcai``, else ``~/.cache/hpcai``). The scope
    is the profile's ``job_dir_scope``: "shared" (default) or "node"."""
    site_dir, scope = _site_job_dir(_site_path(env, head))
    if env.get("HPCAI_JOB_DIR"):
        return env["HPCAI_JOB_DIR"], scope
    if site_dir:
        return site_dir, scope
    return os.path.join(cache_root(env), "jobs"), scope


def _site_path(env: dict[str, str], head: list[str] | tuple[str, ...]) -> str | None:
    for i, arg in enumerate(head):
        if arg == "--site" and i + 1 < len(head):
            return head[i + 1]
        if arg.startswith("--site="):
            return arg.split("=", 1)[1]
    return env.get("HPCAI_SITE") or None


def _site_job_dir(path: str | None) -> tuple[str | None, str]:
    """The site profile's ``job_dir`` ($VARS expanded) and ``job_dir_scope``, read without
    :mod:`.site` (a rank imports no more than it needs). A value that :mod:`.site` would
    refuse counts as unset here: the planning rank then says the error, at the default
    place, where the other ranks look for it."""
    if not path:
        return None, SHARED
    try:
        import tomllib
        with open(path, "rb") as f:
            data = tomllib.load(f)
    except (OSError, ValueError, ImportError):
        return None, SHARED
    where = data.get("job_dir")
    where = os.path.expandvars(where) if isinstance(where, str) else None
    scope = data.get("job_dir_scope", SHARED)
    return (where if where and where.startswith("/") else None,
            scope if scope in JOB_DIR_SCOPES else SHARED)


def make_key(job: JobRole, env: dict[str, str], cwd: str,
             files: tuple[tuple[str, str], ...] = ()) -> PlanKey:
    """The key of ``job``'s plan; ``files``: (role, path) to identify by their ``stat``."""
    return PlanKey(job=job.prepared or job.info.job_key, launch=job.launch,
                   nodes=job.info.nodes, size=job.info.size,
                   argv=job.argv, cwd=cwd, env=_env_key(env), cpus=os.cpu_count(),
                   files=tuple((r, p, identity(p)) for r, p in files))


def identity(path: str) -> str:
    """A file's identity for the key: inode, size and modification time ('' if absent)."""
    try:
        st = os.stat(path)
    except OSError:
        return ""
    return f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _env_key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    names = sorted(k for k in env
                   if k.startswith("HPCAI_")
                   and k not in ("HPCAI_PLAN_TIMEOUT", PLAN_ENV, LAUNCH_ENV))
    return tuple((k, env[k]) for k in (*ENV_KEYS, *names) if k in env)


# --- writing (the planning rank) -------------------------------------------------------

def write(path: str, key: PlanKey, template: RankTemplate) -> None:
    """Write the plan atomically (readers never see half a file), after removing the job
    directory's plans older than :data:`KEEP_S` (:func:`prune`) when the last removal was
    more than :data:`PRUNE_EVERY_S` ago (the time of the directory's ``.pruned`` stamp): a
    directory of thousands of plans takes tens of milliseconds to scan."""
    directory, now = os.path.dirname(path), time.time()
    stamp = os.path.join(directory, PRUNED_STAMP)
    try:
        due = os.stat(stamp).st_mtime < now - PRUNE_EVERY_S
    except OSError:
        due = True
    if due:
        prune(directory, now)
    _write(path, {"format": FORMAT, "written": time.time(), "key": _key_dict(key),
                  "template": {"ranks": [{"env": [list(kv) for kv in r.env],
                                          "bind_cpus": None if r.bind_cpus is None
                                          else list(r.bind_cpus)} for r in template.ranks],
                               "env": [list(kv) for kv in template.env],
                               "argv": list(template.argv),
                               "compat_links": [list(x) for x in template.compat_links]}})
    if due:   # after _write, which made the directory
        try:
            with open(stamp, "w"):
                pass
        except OSError:
            pass


def prune(directory: str, now: float, keep_s: float | None = None) -> list[str]:
    """Remove ``plan-*`` files (and left-over temporaries) last written more than
    ``keep_s`` (default :data:`KEEP_S`) before ``now``: every rank of their jobs has read
    them long ago. Returns the names removed; a file another planner removed first, or
    one this user cannot remove, is left to it."""
    keep = KEEP_S if keep_s is None else keep_s
    removed = []
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith("plan-"):
            continue
        try:
            if entry.stat(follow_symlinks=False).st_mtime < now - keep:
                os.unlink(entry.path)
                removed.append(entry.name)
        except OSError:
            continue
    return removed


def write_error(job: JobRole, exc: UserError) -> None:
    """The planning rank failed (and said why): the others stop with exit 2, silently."""
    _write(job.path, {"format": FORMAT, "written": time.time(),
                      "key": {"job": job.info.job_key, "launch": job.launch},
                      "error": exc.message, "hint": exc.hint})


def _write(path: str, data: dict) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.uname().nodename}.{os.getpid()}.tmp"
    import json     # here: the outer hpcai-launch of a direct mpirun launch writes no plan
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _key_dict(key: PlanKey) -> dict:
    return {"job": key.job, "launch": key.launch, "nodes": list(key.nodes), "size": key.size,
            "argv": list(key.argv), "cwd": key.cwd, "env": [list(kv) for kv in key.env],
            "cpus": key.cpus,
            "files": [list(f) for f in key.files]}


# --- reading (every other rank) --------------------------------------------------------

class PlannerFailed(Exception):
    """The planning rank wrote an error (and has said it on its node)."""

    def __init__(self, error: UserError) -> None:
        super().__init__(error.message)
        self.error = error


def wait(path: str, started: float, timeout: float, launch: str) -> dict:
    """The plan at ``path`` once a fresh one is there: of this ``launch``, written at most
    :data:`STALE_S` before ``started``. UserError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    import json
    delay = 0.1
    stale: float | None = None
    while True:
        try:
            data = json.loads(_read(path))
        except FileNotFoundError:
            data = None
        except (OSError, ValueError) as exc:
            raise UserError(f"cannot read the job's plan {path}: {exc}",
                            "remove the file and start the job again") from None
        if data is not None:
            written = float(data.get("written", 0))
            if written >= started - STALE_S and data.get("key", {}).get("launch") == launch:
                return data
            stale = written
        if time.monotonic() >= deadline:
            raise _timeout_error(path, timeout, stale)
        time.sleep(delay)
        delay = min(delay * 2, 1.0)     # few polls of the shared directory, <= 1 s late


def read_prepared(path: str) -> dict:
    """The plan written before the launch (:data:`PLAN_ENV`): there, or an error."""
    import json
    try:
        return json.loads(_read(path))
    except FileNotFoundError:
        raise UserError(f"{PLAN_ENV}={path}, but there is no plan there",
                        "run the job script as hpcai-launch sbatch wrote it (its plan-step "
                        f"line writes the plan before srun), or unset {PLAN_ENV}") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read the job's plan {path}: {exc}",
                        "submit the job script again (its plan-step line writes a new "
                        "plan)") from None


def _read(path: str) -> bytes:
    """The whole file in as few calls as there are (open, read until empty, close)."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _timeout_error(path: str, timeout: float, stale: float | None) -> UserError:
    if stale is not None:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stale))
        return UserError(f"the plan {path} is stale: written {when} by an earlier launch "
                         f"with this job id, and no fresh one came within {timeout:g} s",
                         "delete it; if it comes back, see the planning rank's (rank 0's) "
                         "output")
    return UserError(f"no plan from the planning rank (rank 0) within {timeout:g} s: "
                     f"{path} was not written",
                     "see rank 0's output for its error; set HPCAI_JOB_DIR to a directory "
                     "that every node sees, or raise HPCAI_PLAN_TIMEOUT")


def check(data: dict, key: PlanKey, path: str) -> RankTemplate | None:
    """The template, if ``data`` is this job's plan. UserError for a foreign or changed
    plan; None where this rank must plan by itself (other environment, or a node with
    another number of CPUs). PlannerFailed when the planning rank failed."""
    got = data.get("key", {})
    if data.get("format") != FORMAT or got.get("job") != key.job:
        raise _foreign(path, f"it is for job {got.get('job')!r}, this rank is in {key.job!r}")
    if "error" in data:
        raise PlannerFailed(UserError(data["error"], data.get("hint") or ""))
    want = _key_dict(key)
    for field, what in (("nodes", "node list"), ("size", "world size"),
                        ("argv", "hpcai-launch command line"), ("cwd", "directory")):
        if got.get(field) != want[field]:
            raise _foreign(path, f"its {what} is {got.get(field)!r}, this rank's is "
                                 f"{want[field]!r}")
    for role_, file, ident in got.get("files", []):
        now = identity(file)
        if now != ident:
            raise _foreign(path, f"its {role_} {file} changed since it was planned "
                                 f"({ident or 'absent'} -> {now or 'absent'})")
    if got.get("env") != want["env"] or got.get("cpus") != want["cpus"]:
        return None
    t = data["template"]
    return RankTemplate(
        ranks=tuple(RankEntry(tuple(map(tuple, r["env"])),
                              None if r["bind_cpus"] is None else tuple(r["bind_cpus"]))
                    for r in t["ranks"]),
        env=tuple(map(tuple, t["env"])), argv=tuple(t["argv"]),
        compat_links=tuple(map(tuple, t["compat_links"])))


def _foreign(path: str, why: str) -> UserError:
    return UserError(f"the plan {path} does not belong to this job: {why}",
                     "never reuse a plan: delete it and start the job again (rank 0 writes "
                     "a new one); every rank must run the same hpcai-launch command")


def for_rank(template: RankTemplate, info: RankInfo,
             env: dict[str, str]) -> tuple[tuple[str, ...], dict[str, str], tuple[int, ...] | None]:
    """(argv, env, CPUs to bind) of one rank: its local entry, the torch.distributed
    variables, the job-wide env (in that order, as :func:`.plan.build_plan` has them)."""
    entry = template.ranks[info.local_rank]
    out = dict(entry.env)
    out.update(torch_env(info, env))
    out.update(template.env)
    node = str(info.node_rank)
    argv = tuple(a.replace(NODE_MARK, node).replace(JOB_MARK, info.job_key)
                 for a in template.argv)
    return argv, out, entry.bind_cpus


def plan_timeout(env: dict[str, str]) -> float:
    text = env.get("HPCAI_PLAN_TIMEOUT", "").strip()
    if not text:
        return DEFAULT_TIMEOUT_S
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise UserError(f"HPCAI_PLAN_TIMEOUT={text!r} is not a positive number of seconds",
                        "set it to e.g. 300, or unset it (default 120)")
    return value
