"""Container runtimes as data: how each one binds, passes env and starts a rank's command.

Each rank's command becomes ``ch-run … IMG -- CMD`` or ``singularity exec … IMG CMD``. The
per-rank hpcai-launch (on the host) has already bound the CPUs and built the environment;
the runtime must carry that environment into the container:
- Charliecloud passes the host environment through, ``LD_LIBRARY_PATH``, ``SLURM_*`` and
  ``PMI*`` included, so env goes in the exec environment. Ranks of one node join one
  container (``--join-ct``/``--join-tag``) so shared memory and cross-memory attach work.
- Singularity/Apptainer imports most of the environment but not ``LD_LIBRARY_PATH``, and
  ``--containall`` would wipe ``SLURM_*``/``PMI_*``; so library paths go in as ``--env`` and
  ``--containall`` is never used. Binds carry ``:ro`` where read-only.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from ..core.errors import UserError

HOST_MOUNT = "/opt/hpcai/host"      # empty mount point in images built by charliecloud/
WORK_MOUNT = "/opt/hpcai/work"      # the launch directory


@dataclass(frozen=True)
class Bind:
    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class Runtime:
    """One container runtime's spellings; :func:`wrap` reads them, never the name."""

    name: str
    binaries: tuple[str, ...]           # looked up on PATH in this order
    install_hint: str
    exec_args: tuple[str, ...]          # after the binary: ``singularity exec``
    join_args: tuple[str, ...]          # ranks of one node share one container: {n}, {tag}
    bind_flag: str
    read_only_suffix: str | None        # None: binds of this runtime cannot be read-only
    env_flag: str | None                # None: the host environment passes through
    explicit_env: tuple[str, ...]       # names the runtime does not carry in by itself
    workdir_flag: str
    before_command: tuple[str, ...]     # between the image and the command

    def bind_args(self, bind: Bind) -> list[str]:
        suffix = self.read_only_suffix if bind.read_only and self.read_only_suffix else ""
        return [self.bind_flag, f"{bind.source}:{bind.target}{suffix}"]


RUNTIMES = {r.name: r for r in (
    Runtime("charliecloud", ("ch-run",),
            "install Charliecloud (Debian/Ubuntu: apt-get install charliecloud-runtime; or "
            "load the site's charliecloud module) so that ch-run is on PATH",
            exec_args=(), join_args=("--join-ct={n}", "--join-tag={tag}"), bind_flag="-b",
            read_only_suffix=None, env_flag=None, explicit_env=(), workdir_flag="-c",
            before_command=("--",)),
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


def get_runtime(name: str) -> Runtime:
    try:
        return RUNTIMES[name]
    except KeyError:
        raise UserError(f"unknown container runtime {name!r}",
                        f"use one of: {', '.join(RUNTIMES)}, or none") from None


def find_binary(runtime: Runtime, path: str | None) -> str:
    """The runtime's binary on ``path`` (the job's PATH); UserError if it has none."""
    for name in runtime.binaries:
        found = shutil.which(name, path=path)
        if found:
            return found
    raise UserError(f"container runtime {runtime.name}: {' or '.join(runtime.binaries)} not "
                    "found on PATH", runtime.install_hint)


@dataclass(frozen=True)
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
    if join_ct and join_ct > 1:
        argv += [a.format(n=join_ct, tag=join_tag or "hpcai") for a in rt.join_args]
    for bind in spec.binds:
        argv += rt.bind_args(bind)
    if rt.env_flag:
        argv += [arg for key, value in spec.env if key in rt.explicit_env
                 for arg in (rt.env_flag, f"{key}={value}")]
    return [*argv, rt.workdir_flag, spec.workdir, spec.image, *rt.before_command, *command]
