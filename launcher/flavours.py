"""MPI flavours as data: how each one exports env, places ranks and talks to Slurm.

Detection runs the launcher's ``--version`` once; everything else reads these tables.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from ..core.errors import UserError
from .placement import Placement


@dataclass(frozen=True)
class Flavour:
    """What differs between MPI implementations, as data."""

    name: str
    title: str
    launchers: tuple[str, ...]        # candidate launcher names, most specific first
    version_pattern: str              # regex on `launcher --version` output
    export_env: tuple[str, ...]       # argv template per exported variable
    hosts_style: str                  # "slots" (h:n,...) or "ppn" (-hosts h,... -ppn n)
    srun_mpi: str                     # srun --mpi= plugin this MPI needs
    mpi4py_abi: str                   # MPI4PY_MPIABI value
    libmpi_soname: str                # soname mpi4py and apps load
    family: str                       # ABI family: "openmpi" or "mpich"

    def env_args(self, env: dict[str, str]) -> list[str]:
        args: list[str] = []
        for key in sorted(env):
            args.extend(t.format(key=key, value=env[key]) for t in self.export_env)
        return args


OPENMPI = Flavour(
    name="openmpi", title="Open MPI",
    launchers=("mpirun.openmpi", "mpirun", "mpiexec.openmpi", "mpiexec"),
    version_pattern=r"Open MPI|OpenRTE|Open RTE",
    export_env=("-x", "{key}={value}"),
    hosts_style="slots", srun_mpi="pmix", mpi4py_abi="openmpi",
    libmpi_soname="libmpi.so.40", family="openmpi")

MPICH = Flavour(
    name="mpich", title="MPICH",
    launchers=("mpiexec.mpich", "mpirun.mpich", "mpiexec.hydra", "mpiexec", "mpirun"),
    version_pattern=r"HYDRA|MPICH",
    export_env=("-genv", "{key}", "{value}"),
    hosts_style="ppn", srun_mpi="pmi2", mpi4py_abi="mpich",
    libmpi_soname="libmpi.so.12", family="mpich")

INTEL = Flavour(
    name="intel", title="Intel MPI",
    launchers=("mpiexec.hydra", "mpiexec", "mpirun"),
    version_pattern=r"Intel\(R\) MPI",
    export_env=("-genv", "{key}", "{value}"),
    hosts_style="ppn", srun_mpi="pmi2", mpi4py_abi="mpich",
    libmpi_soname="libmpi.so.12", family="mpich")

FLAVOURS: dict[str, Flavour] = {f.name: f for f in (OPENMPI, MPICH, INTEL)}
# Intel first: its hydra also says HYDRA.
_DETECTION_ORDER = (INTEL, OPENMPI, MPICH)


def get(name: str) -> Flavour:
    try:
        return FLAVOURS[name]
    except KeyError:
        raise UserError(f"unknown MPI flavour {name!r}",
                        f"use one of: {', '.join(FLAVOURS)} (or 'auto' to detect it "
                        "from the launcher on PATH)") from None


def classify_version_text(text: str) -> Flavour | None:
    """Map ``launcher --version`` output to a flavour (None if unknown)."""
    for flavour in _DETECTION_ORDER:
        if re.search(flavour.version_pattern, text):
            return flavour
    return None


@dataclass(frozen=True)
class MpiInstall:
    """A detected MPI: its flavour, launcher binary and library directory."""

    flavour: Flavour
    launcher: str
    version: str
    libdir: str | None
    how: str

    def to_dict(self) -> dict:
        return {"flavour": self.flavour.name, "launcher": self.launcher,
                "version": self.version, "libdir": self.libdir, "how": self.how}


def find_launcher(flavour: Flavour | None, env: dict[str, str]) -> str | None:
    """First launcher binary for ``flavour`` (or any) on PATH, honouring I_MPI_ROOT."""
    path = env.get("PATH", os.defpath)
    names = flavour.launchers if flavour else ("mpirun", "mpiexec")
    if flavour is INTEL and env.get("I_MPI_ROOT"):
        candidate = Path(env["I_MPI_ROOT"]) / "bin" / "mpiexec.hydra"
        if candidate.exists():
            return str(candidate)
    for name in names:
        found = shutil.which(name, path=path)
        if found:
            return found
    return None


def detect(launcher: str, timeout: float = 20.0) -> tuple[Flavour, str]:
    """Run ``launcher --version`` once and classify it. Raises UserError if unknown."""
    try:
        out = subprocess.run([launcher, "--version"], capture_output=True, text=True,
                             timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"cannot run {launcher} --version: {exc}",
                        "pass --mpi openmpi|mpich|intel and --mpirun PATH") from exc
    text = out.stdout + out.stderr
    flavour = classify_version_text(text)
    if flavour is None:
        first = text.strip().splitlines()[0] if text.strip() else "(no output)"
        raise UserError(f"unknown MPI behind {launcher}: {first!r}",
                        f"hpcai-launch knows {', '.join(FLAVOURS)}; pass --mpi to say which "
                        "one it is compatible with")
    marker = re.search(flavour.version_pattern, text)
    match = re.search(r"(\d+\.\d+(?:\.\d+)?)", text[marker.start():] if marker else text)
    return flavour, match.group(1) if match else "unknown"


_SYSTEM_LIBDIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/lib64", "/lib")


def find_libdir(flavour: Flavour, launcher: str) -> str | None:
    """Directory holding the flavour's libmpi next to the launcher (bin/../lib)."""
    real = Path(os.path.realpath(launcher))
    for candidate in (real.parent.parent / "lib", real.parent.parent / "lib64",
                      *map(Path, _SYSTEM_LIBDIRS)):
        if any((candidate / name).exists() for name in _lib_names(flavour)):
            return str(candidate)
    return None


def _lib_names(flavour: Flavour) -> tuple[str, ...]:
    if flavour.family == "mpich":
        return (flavour.libmpi_soname, "libmpich.so.12")
    return (flavour.libmpi_soname,)


def resolve(requested: str, launcher: str | None, env: dict[str, str]) -> MpiInstall:
    """Find and identify the MPI to launch with (the one impure step of planning)."""
    wanted = None if requested == "auto" else get(requested)
    binary = launcher or find_launcher(wanted, env)
    if binary is None:
        what = wanted.title if wanted else "an MPI launcher (mpirun/mpiexec)"
        raise UserError(f"no {what} found on PATH",
                        "install MPI (see README), load its module, or pass --mpirun PATH")
    if launcher and not shutil.which(launcher):
        raise UserError(f"MPI launcher {launcher} does not exist or is not executable",
                        "check --mpirun, or leave it out to search PATH")
    detected, version = detect(binary)
    if wanted is not None and wanted.family != detected.family:
        raise UserError(f"--mpi {wanted.name} asked for, but {binary} is {detected.title}",
                        f"pass --mpirun with a {wanted.title} launcher or --mpi {detected.name}")
    flavour = wanted or detected
    how = (f"{binary} --version says {detected.title} {version}" +
           ("" if wanted is None else f"; --mpi {wanted.name}"))
    return MpiInstall(flavour, binary, version, find_libdir(flavour, binary), how)


def locate(flavour: Flavour, launcher: str | None, env: dict[str, str]) -> MpiInstall:
    """Where a flavour named by the user lives, without running anything (per-rank use)."""
    binary = launcher or find_launcher(flavour, env) or ""
    libdir = find_libdir(flavour, binary) if binary else None
    return MpiInstall(flavour, binary, "unknown", libdir, f"--mpi {flavour.name}")


# --- binding flags per flavour ---------------------------------------------------------

def openmpi_binding(p: Placement) -> list[str]:
    if p.oversubscribed:
        return ["--map-by", f"ppr:{p.ranks_per_node}:node", "--bind-to", "none",
                "--oversubscribe"]
    unit, count = ("numa", p.ranks_per_numa) if p.layout == "per-numa" else (
        "node", p.ranks_per_node)
    pe = f":PE={p.cores_per_rank}"
    args = ["--map-by", f"ppr:{count}:{unit}{pe}", "--bind-to", "core"]
    if p.hyperthreads:
        args[1] = f"ppr:{count}:{unit}:PE={p.threads_per_rank}"
        args[3] = "hwthread"
        args.append("--use-hwthread-cpus")
    return args


def mpich_binding(p: Placement) -> list[str]:
    if p.oversubscribed:
        return ["-bind-to", "none"]
    return ["-bind-to", "user:" + ",".join("+".join(map(str, s.cpus)) for s in p.slots)]


def intel_binding(p: Placement) -> list[str]:
    return []


def intel_binding_env(p: Placement) -> dict[str, str]:
    if p.oversubscribed:
        return {"I_MPI_PIN": "0"}
    masks = ",".join(s.mask for s in p.slots)
    return {"I_MPI_PIN": "1", "I_MPI_PIN_DOMAIN": f"[{masks}]"}


BINDING_ARGS = {"openmpi": openmpi_binding, "mpich": mpich_binding, "intel": intel_binding}
BINDING_ENV = {"openmpi": lambda p: {}, "mpich": lambda p: {}, "intel": intel_binding_env}


def srun_binding(p: Placement) -> list[str]:
    if p.oversubscribed:
        return ["--cpu-bind=none", "--overcommit"]
    return ["--cpu-bind=mask_cpu:" + ",".join(s.mask for s in p.slots)]
