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
    name: str
    binaries: tuple[str, ...]
    # env names the runtime does NOT carry in from the host: passed explicitly
    explicit_env: tuple[str, ...]


RUNTIMES = {
    "charliecloud": Runtime("charliecloud", ("ch-run",), ()),
    "singularity": Runtime("singularity", ("singularity", "apptainer"),
                           ("LD_LIBRARY_PATH", "FI_PROVIDER_PATH", "UCX_MODULE_DIR",
                            "MPI4PY_MPIABI", "OMPI_MCA_mca_base_component_path")),
}


def get_runtime(name: str) -> Runtime:
    try:
        return RUNTIMES[name]
    except KeyError:
        raise UserError(f"unknown container runtime {name!r}",
                        f"use one of: {', '.join(RUNTIMES)}, or none") from None


def find_binary(runtime: Runtime, path: str | None) -> str | None:
    for name in runtime.binaries:
        found = shutil.which(name, path=path)
        if found:
            return found
    return None


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
    runtime = get_runtime(spec.runtime)
    if runtime.name == "charliecloud":
        argv = [spec.binary]
        if join_ct and join_ct > 1:
            argv += [f"--join-ct={join_ct}", f"--join-tag={join_tag or 'hpcai'}"]
        for b in spec.binds:
            argv += ["-b", f"{b.source}:{b.target}"]
        argv += ["-c", spec.workdir, spec.image, "--", *command]
        return argv
    argv = [spec.binary, "exec"]
    for b in spec.binds:
        argv += ["-B", f"{b.source}:{b.target}{':ro' if b.read_only else ''}"]
    for key, value in spec.env:
        if key in runtime.explicit_env:
            argv += ["--env", f"{key}={value}"]
    argv += ["--pwd", spec.workdir, spec.image, *command]
    return argv
