"""Container runtimes as data: how each one binds, passes env and starts a rank's command.

Each rank's command becomes ``ch-run … IMG -- CMD`` or ``singularity exec … IMG CMD``. The
per-rank hpcai-launch (on the host) has already bound the CPUs and built the environment;
the runtime must carry that environment into the container:
- Charliecloud passes the host environment through, ``LD_LIBRARY_PATH``, ``SLURM_*`` and
  ``PMI*`` included, so env goes in the exec environment. Ranks of one node join one
  container (``--join-ct``/``--join-tag``) so shared memory and cross-memory attach work.
  ``ch-run -b`` binds read-write (0.31 here; the source up to 0.39~pre has no read-only bind
  either), so read-only binds are remounted read-only inside the container by
  :mod:`.readonly`, run by the image's ``python3`` between ``IMG --`` and the command.
  ch-run bind-mounts the host's whole ``/dev``, so the GPUs' ``/dev/nvidia*`` are there.
- Singularity/Apptainer imports most of the environment but not ``LD_LIBRARY_PATH``, and
  ``--containall`` would wipe ``SLURM_*``/``PMI_*``; so library paths go in as ``--env`` and
  ``--containall`` is never used. Read-only binds carry ``:ro``. Its ``/dev`` is the
  host's only under ``mount dev = yes`` in the site's configuration (``minimal`` is common),
  so the GPUs' ``/dev/nvidia*`` nodes are bound one by one, as ``--nv`` does.
"""

from __future__ import annotations

from ...core.record import record

from ...core.paths import which
from ...core.errors import UserError

HOST_MOUNT = "/opt/hpcai/host"      # empty mount point in images built by charliecloud/
WORK_MOUNT = "/opt/hpcai/work"      # the launch directory
CACHE_MOUNT = "/opt/hpcai/cache"    # hpcai's cache inside (HPCAI_CACHE), of which only
FLOPS_MOUNT = CACHE_MOUNT + "/flops"   # the FLOP counts are the host's, bound read-write


@record
class Bind:
    source: str
    target: str
    read_only: bool = True


@record
class Runtime:
    """One container runtime's spellings; :func:`wrap` reads them, never the name."""

    name: str
    binaries: tuple[str, ...]           # looked up on PATH in this order
    install_hint: str
    exec_args: tuple[str, ...]          # after the binary: ``singularity exec``
    join_args: tuple[str, ...]          # ranks of one node share one container: {n}, {tag}
    bind_flag: str
    read_only_suffix: str | None        # None: the runtime binds read-write, always
    env_flag: str | None                # None: the host environment passes through
    explicit_env: tuple[str, ...]       # names the runtime does not carry in by itself
    workdir_flag: str
    before_command: tuple[str, ...]     # between the image and the command
    read_only_helper: str | None = None  # else: a module the image's python3 runs first
    needs_env: tuple[str, ...] = ()     # the runtime refuses to start without them
    binds_host_dev: bool = False        # the container's /dev is the host's whole /dev

    def bind_args(self, bind: Bind) -> list[str]:
        suffix = self.read_only_suffix if bind.read_only and self.read_only_suffix else ""
        return [self.bind_flag, f"{bind.source}:{bind.target}{suffix}"]

    def helper_args(self, binds: tuple[Bind, ...], join: tuple[str, int] | None) -> list[str]:
        """``python3 -m HELPER [--join-tag TAG --join-ct N] [--rw DST]... DST... --`` before
        the command, when the binds cannot carry read-only themselves and one is read-only
        (``join``: the ranks of a node share one container, and one namespace); else []."""
        targets = [b.target for b in binds if b.read_only]
        if self.read_only_suffix or not self.read_only_helper or not targets:
            return []
        joined = ["--join-tag", join[0], "--join-ct", str(join[1])] if join else []
        keep = [arg for b in binds if not b.read_only for arg in ("--rw", b.target)]
        return ["python3", "-m", self.read_only_helper, *joined, *keep, *targets, "--"]

    @property
    def read_only_how(self) -> str:
        """What is really done to a read-only bind (for the dry run)."""
        if self.read_only_suffix:
            return f"bound with {self.bind_flag} SRC:DST{self.read_only_suffix}"
        if self.read_only_helper:
            return (f"{' '.join(self.binaries)} {self.bind_flag} binds read-write, so python3 "
                    f"-m {self.read_only_helper} runs in the image before the command and "
                    "remounts them read-only, in a nested user+mount namespace that locks "
                    "the flag")
        return "none: this runtime cannot make a bind read-only"


RUNTIMES = {r.name: r for r in (
    Runtime("charliecloud", ("ch-run",),
            "install Charliecloud (Debian/Ubuntu: apt-get install charliecloud-runtime; or "
            "load the site's charliecloud module) so that ch-run is on PATH",
            exec_args=(), join_args=("--join-ct={n}", "--join-tag={tag}"), bind_flag="-b",
            read_only_suffix=None, env_flag=None, explicit_env=(), workdir_flag="-c",
            before_command=("--",), read_only_helper="hpcai.launcher.readonly",
            needs_env=("USER",),    # ch-run: "error: $USER not set"
            binds_host_dev=True),   # ch-run bind-mounts the host's /dev recursively
    Runtime("singularity", ("singularity", "apptainer"),
            "install Apptainer or SingularityCE (https://apptainer.org/docs/admin/main/"
            "installation.html; Debian 12 packages neither) or load the site's module, so "
            "that singularity or apptainer is on PATH",
            exec_args=("exec",), join_args=(), bind_flag="-B", read_only_suffix=":ro",
            env_flag="--env",
            explicit_env=("LD_LIBRARY_PATH", "FI_PROVIDER_PATH", "UCX_MODULE_DIR",
                          "MPI4PY_MPIABI", "OMPI_MCA_mca_base_component_path"),
            workdir_flag="--pwd", before_command=()),
)}


DEFAULT_RUNTIME = "charliecloud"
NO_RUNTIME = "none"     # --runtime none: run bare, even with an image named


def get_runtime(name: str) -> Runtime:
    try:
        return RUNTIMES[name]
    except KeyError:
        raise UserError(f"unknown container runtime {name!r}",
                        f"use one of: {', '.join(RUNTIMES)}, or {NO_RUNTIME}") from None


def find_binary(runtime: Runtime, path: str | None) -> str:
    """The runtime's binary on ``path`` (the job's PATH); UserError if it has none."""
    for name in runtime.binaries:
        found = which(name, path=path)
        if found:
            return found
    raise UserError(f"container runtime {runtime.name}: {' or '.join(runtime.binaries)} not "
                    "found on PATH", runtime.install_hint)


@record
class ContainerSpec:
    """Everything that turns a rank's command into a containerised one."""

    runtime: str
    binary: str
    image: str
    binds: tuple[Bind, ...]
    workdir: str
    env: tuple[tuple[str, str], ...] = ()   # values as seen inside the container

    def to_dict(self) -> dict:
        return {"runtime": self.runtime, "binary": self.binary, "image": self.image,
                "binds": [f"{b.source}:{b.target}{':ro' if b.read_only else ''}"
                          for b in self.binds],
                "workdir": self.workdir, "env": dict(self.env)}


def wrap(spec: ContainerSpec, command: tuple[str, ...], *, join_ct: int | None = None,
         join_tag: str | None = None) -> list[str]:
    """The argv that runs ``command`` inside the container (pure)."""
    rt = get_runtime(spec.runtime)
    argv = [spec.binary, *rt.exec_args]
    join = (join_tag or "hpcai", join_ct) if join_ct and join_ct > 1 and rt.join_args else None
    if join:
        argv += [a.format(n=join[1], tag=join[0]) for a in rt.join_args]
    for bind in spec.binds:
        argv += rt.bind_args(bind)
    if rt.env_flag:
        argv += [arg for key, value in spec.env if key in rt.explicit_env
                 for arg in (rt.env_flag, f"{key}={value}")]
    return [*argv, rt.workdir_flag, spec.workdir, spec.image, *rt.before_command,
            *rt.helper_args(spec.binds, join), *command]
