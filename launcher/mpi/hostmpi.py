"""The host's MPI library: found and identified from the file itself.

- :func:`find_host_mpi` looks for the host's libmpi next to the launcher, in the MPI
  environment variables (``I_MPI_ROOT``, ``MPI_HOME``, EasyBuild's ``EBROOT*``, ...: see
  :data:`.abi.ROOT_VARS`), on ``LD_LIBRARY_PATH``, then in ``ldconfig -p``.
- :func:`identify_libmpi` names it from its soname and the version strings inside the file
  (:data:`.abi.IMPLEMENTATIONS`).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from ...core.record import record, replace

from ...core.paths import which
from . import abi, elf


@record
class HostMpi:
    """The host's MPI library, identified from the file itself."""

    family: str             # ABI: a name in abi.FAMILIES ("openmpi", "mpich", "mpiabi")
    name: str               # "openmpi" | "mpich" | "intel" | "mvapich" | "cray-mpich" | "unknown"
    version: str            # e.g. "4.1.4", "2021.19.0"; "unknown" when the file says nothing
    libmpi: str             # real path of the library file
    soname: str             # e.g. "libmpi.so.40", "libmpi.so.12", "libmpich.so.12"
    libdir: str             # directory it was found in
    root: str | None        # install prefix, None for the system library directories
    how: str = ""           # where it was found

    def to_dict(self) -> dict:
        return {"family": self.family, "name": self.name, "version": self.version,
                "libmpi": self.libmpi, "soname": self.soname, "libdir": self.libdir,
                "root": self.root, "how": self.how}


# --- identifying a libmpi ----------------------------------------------------------------

def _markers(path: str) -> tuple[abi.Implementation | None, str]:
    """(implementation, version) from the strings inside the library file."""
    import mmap
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for impl in abi.IMPLEMENTATIONS:
            if data.find(impl.marker) < 0:
                continue
            for pattern in impl.versions:
                m = re.search(pattern, data)
                if m:
                    return impl, m.group(1).decode("ascii", "replace")
            return impl, "unknown"
    return None, "unknown"


def _root_of(libdir: str) -> str | None:
    """Install prefix of a library directory (None for the system's own directories)."""
    from pathlib import Path   # here: a bare launch never asks
    parts = Path(libdir).parts
    while parts and parts[-1] in ("release", "release_mt", "debug", "debug_mt"):
        parts = parts[:-1]                       # Intel MPI: lib/release/libmpi.so.12
    if parts and parts[-1] == abi.MULTIARCH:
        return None                              # /usr/lib/<multiarch>
    if parts and parts[-1] in ("lib", "lib64"):
        parts = parts[:-1]
    root = str(Path(*parts)) if parts else None
    return None if root in (None, "/", "/usr", "/usr/local") else root


def identify_libmpi(path: str | os.PathLike) -> HostMpi:
    """Which MPI a libmpi file is. ValueError if it is not ELF or not recognisably MPI.

    A soname of a side-by-side family (``libmpi_abi.so.*``) decides the family; else the
    version strings do; else the soname, and the family's ``unmarked_name`` names it."""
    path = os.path.abspath(os.fspath(path))
    real = os.path.realpath(path)
    soname = elf.read_elf(real).soname or os.path.basename(path)
    impl, version = _markers(real)
    by_soname = abi.family_of_soname(soname)
    if by_soname and (by_soname.side_by_side or impl is None):
        family = by_soname
        name = impl.name if impl else family.unmarked_name
    elif impl is not None:
        family, name = impl.family, impl.name
    else:
        raise ValueError(f"{path}: not a known MPI library (soname {soname}, no MPI "
                         "version string inside)")
    libdir = os.path.dirname(path)
    return HostMpi(family=family.name, name=name, version=version, libmpi=real, soname=soname,
                   libdir=libdir, root=_root_of(libdir), how=f"identified from {path}")


# --- finding the host MPI ------------------------------------------------------------------

def _candidate_dirs(env: dict[str, str], launcher: str | None) -> list[tuple[str, str]]:
    """(directory, how) in search order."""
    from pathlib import Path   # here: a bare launch never asks
    out: list[tuple[str, str]] = []
    if launcher:
        real = Path(os.path.realpath(launcher))
        prefix = real.parent.parent
        for d in (prefix / "lib", prefix / "lib64", prefix / "lib" / abi.MULTIARCH):
            out.append((str(d), f"next to the launcher {launcher} ({real})"))
    for root in abi.ROOT_VARS:
        if env.get(root.var):
            out += [(str(Path(env[root.var]) / sub), f"${root.var}/{sub}")
                    for sub in root.subdirs]
    for d in env.get("LD_LIBRARY_PATH", "").split(":"):
        if d:
            out.append((d, "$LD_LIBRARY_PATH"))
    return out


def libmpis_in(directory: str, prefer: str | None = None) -> Iterator[HostMpi]:
    """The libmpi files in ``directory`` that identify, in :func:`abi.libmpi_names` order
    (``prefer``'s family first); nothing when the directory cannot be listed."""
    try:
        present = os.listdir(directory)
    except OSError:
        return
    for name in abi.libmpi_names(present, prefer):
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate):
            try:
                yield identify_libmpi(candidate)
            except (ValueError, OSError):
                continue


def _first_libmpi(directory: str, prefer: str | None) -> HostMpi | None:
    return next(libmpis_in(directory, prefer), None)


def parse_ldconfig(output: str) -> dict[str, str]:
    """``ldconfig -p`` output as {name: first path} (64-bit entries on 64-bit hosts)."""
    found: dict[str, str] = {}
    wide = sys.maxsize > 2 ** 32
    for line in output.splitlines():
        m = re.match(r"\s+(\S+)\s+\(([^)]*)\)\s+=>\s+(\S+)", line)
        if not m:
            continue
        name, tags, path = m.groups()
        if wide and "64" not in tags:
            continue
        found.setdefault(name, path)
    return found


def run_ldconfig(env: dict[str, str] | None = None) -> str:
    """``ldconfig -p`` output ('' when ldconfig is missing or fails)."""
    env = os.environ if env is None else env
    path = env.get("PATH", os.defpath) + ":/sbin:/usr/sbin"
    binary = which("ldconfig", path=path)
    if not binary:
        return ""
    import subprocess
    try:
        return subprocess.run([binary, "-p"], capture_output=True, text=True, timeout=30,
                              check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return ""


def find_host_mpi(env: dict[str, str], launcher: str | None = None,
                  ldconfig_output: str | None = None, *,
                  prefer: str | None = None, require: str | None = None) -> HostMpi | None:
    """The host's libmpi, or None. ``prefer`` (a family) breaks ties inside one directory;
    by default it is guessed from the launcher's name (orterun: openmpi, hydra: mpich).
    ``require`` (a family) skips every other family, e.g. under ``srun --mpi=pmix``."""
    prefer = prefer or require
    if launcher and "/" not in launcher:
        launcher = which(launcher, path=env.get("PATH", os.defpath)) or launcher
    if launcher and not prefer:
        implied = abi.family_of_launcher(os.path.basename(os.path.realpath(launcher)))
        prefer = implied.name if implied else None
    seen: set[str] = set()
    for directory, how in _candidate_dirs(env, launcher):
        key = os.path.realpath(directory)
        if key in seen:
            continue
        seen.add(key)
        found = _first_libmpi(directory, prefer)
        if found and (require is None or found.family == require):
            return replace(found, how=how)
    if ldconfig_output is None:
        ldconfig_output = run_ldconfig(env)
    cache = parse_ldconfig(ldconfig_output)
    for name in abi.libmpi_names(cache, prefer):
        if require and abi.family_of_soname(name).name != require:
            continue
        try:
            return replace(identify_libmpi(cache[name]), how=f"ldconfig -p: {name}")
        except (ValueError, OSError):
            continue
    return None
