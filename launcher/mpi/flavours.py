"""Finding the MPI to launch with: its launcher, flavour, version and library directory.

Detection runs the launcher's ``--version`` once; the flavour records themselves (how each
MPI exports env, places and binds ranks, talks to Slurm) are in :mod:`.abi`.
"""

from __future__ import annotations

import os
import re
from ...core.record import record

from ...core.paths import cache_root, which
from ...core.errors import UserError
from .abi import (
    FLAVOURS, GENERIC_LAUNCHERS, INTEL, MPICH, OPENMPI, SYSTEM_LIBDIRS, CompatLink, Flavour)

# The records come from .abi; callers reach them here beside the functions that find them.
__all__ = ["FLAVOURS", "INTEL", "MPICH", "OPENMPI", "Flavour", "MpiInstall",
           "classify_version_text", "detect", "find_launcher", "find_libdir", "get", "locate",
           "resolve"]


def get(name: str) -> Flavour:
    try:
        return FLAVOURS[name]
    except KeyError:
        raise UserError(f"unknown MPI flavour {name!r}",
                        f"use one of: {', '.join(FLAVOURS)} (or 'auto' to detect it "
                        "from the launcher on PATH)") from None


def classify_version_text(text: str) -> Flavour | None:
    """Map ``launcher --version`` output to a flavour (None if unknown)."""
    for flavour in sorted(FLAVOURS.values(), key=lambda f: not f.detect_first):
        if re.search(flavour.version_pattern, text):
            return flavour
    return None


@record
class MpiInstall:
    """A detected MPI: its flavour, launcher binary and library directory."""

    flavour: Flavour
    launcher: str
    version: str
    libdir: str | None
    how: str
    missing_compat: tuple[CompatLink, ...] = ()   # the family's links libdir lacks

    def to_dict(self) -> dict:
        return {"flavour": self.flavour.name, "launcher": self.launcher,
                "version": self.version, "libdir": self.libdir, "how": self.how}


def find_launcher(flavour: Flavour | None, env: dict[str, str]) -> str | None:
    """First launcher binary for ``flavour`` (or any): in the bin/ of the flavour's
    ``root_var`` (I_MPI_ROOT), then on PATH."""
    path = env.get("PATH", os.defpath)
    names = flavour.launchers if flavour else GENERIC_LAUNCHERS
    if flavour and flavour.root_var and env.get(flavour.root_var):
        for name in names:
            candidate = os.path.join(env[flavour.root_var], "bin", name)
            if os.path.exists(candidate):
                return candidate
    for name in names:
        found = which(name, path=path)
        if found:
            return found
    return None


VERSION_CACHE = "launchers"   # <cache>/launchers/: launchers' --version texts, by identity
VERSION_ENV = ("PATH", "LD_LIBRARY_PATH", "OPAL_PREFIX", "I_MPI_ROOT")   # in the identity


def detect(launcher: str, timeout: float = 20.0, cache: str | None = None
           ) -> tuple[Flavour, str]:
    """Run ``launcher --version`` once and classify it. Raises UserError if unknown.
    ``cache``: hpcai's cache directory, where the text is kept for the next launch under the
    launcher's identity (:func:`launcher_identity`); None: always run it."""
    text, keep = version_text(launcher, timeout, cache)
    flavour = classify_version_text(text)
    if flavour is None:
        first = text.strip().splitlines()[0] if text.strip() else "(no output)"
        raise UserError(f"unknown MPI behind {launcher}: {first!r}",
                        f"hpcai-launch knows {', '.join(FLAVOURS)}; pass --mpi to say which "
                        "one it is compatible with")
    if keep is not None:          # a known MPI's text, run now: written by keep_versions
        _UNSAVED.append((*keep, text))
    marker = re.search(flavour.version_pattern, text)
    match = re.search(r"(\d+\.\d+(?:\.\d+)?)", text[marker.start():] if marker else text)
    return flavour, match.group(1) if match else "unknown"


def launcher_identity(launcher: str) -> str:
    """What ``launcher --version`` says depends on: the path given and the real file, the
    inode, size and modification time of both and of the real file's directory (an update
    replaces files there), and :data:`VERSION_ENV` (a prefix variable or search path points
    a launcher at another install)."""
    real = os.path.realpath(launcher)
    parts = [launcher, real]
    for path in (launcher, real, os.path.dirname(real)):
        st = os.stat(path)
        parts.append(f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}")
    parts += [f"{name}={os.environ.get(name, '')}" for name in VERSION_ENV]
    return "\n".join(parts)


def version_text(launcher: str, timeout: float, cache: str | None
                 ) -> tuple[str, tuple[str, str] | None]:
    """``launcher --version``'s output, from ``cache`` when this identity ran it before;
    and, for a text run now that exited 0 with a cache given, (the cache file, the identity)
    to keep it under."""
    import json
    import zlib
    where = key = None
    if cache is not None:
        try:
            key = launcher_identity(launcher)
            where = os.path.join(cache, VERSION_CACHE, f"{zlib.crc32(key.encode()):08x}.json")
            with open(where, encoding="utf-8") as f:
                kept = json.load(f)
            if kept.get("identity") == key:
                return kept["text"], None
        except (OSError, ValueError, KeyError, AttributeError):
            pass
    import subprocess   # here: a launch whose text is in the cache runs nothing
    try:
        out = subprocess.run([launcher, "--version"], capture_output=True, text=True,
                             timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"cannot run {launcher} --version: {exc}",
                        f"pass --mpi {'|'.join(FLAVOURS)} and --mpirun PATH") from exc
    text = out.stdout + out.stderr
    keep = (where, key) if where is not None and out.returncode == 0 else None
    return text, keep


_UNSAVED: list[tuple[str, str, str]] = []   # (file, identity, text) that keep_versions writes


def keep_versions() -> None:
    """Write the ``--version`` texts run since the last call to the cache (atomically; an
    unwritable cache is no error). hpcai-launch calls it only when it carries out a plan,
    so a refused launch or a dry run writes nothing."""
    import json
    while _UNSAVED:
        where, key, text = _UNSAVED.pop()
        tmp = f"{where}.{os.getpid()}"
        try:
            os.makedirs(os.path.dirname(where), exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"identity": key, "text": text}, f)
            os.replace(tmp, where)
        except OSError:
            pass


def find_libdir(flavour: Flavour, launcher: str) -> str | None:
    """Directory holding the flavour's libmpi next to the launcher (bin/../lib)."""
    prefix = os.path.dirname(os.path.dirname(os.path.realpath(launcher)))
    for candidate in (os.path.join(prefix, "lib"), os.path.join(prefix, "lib64"),
                      *SYSTEM_LIBDIRS):
        if any(os.path.exists(os.path.join(candidate, name)) for name in flavour.abi.sonames):
            return candidate
    return None


def resolve(requested: str, launcher: str | None, env: dict[str, str]) -> MpiInstall:
    """Find and identify the MPI to launch with (the one impure step of planning)."""
    wanted = None if requested == "auto" else get(requested)
    binary = launcher or find_launcher(wanted, env)
    if binary is None:
        what = wanted.title if wanted else "an MPI launcher (mpirun/mpiexec)"
        raise UserError(f"no {what} found on PATH",
                        "install MPI (see README), load its module, or pass --mpirun PATH")
    if launcher and not which(launcher):
        raise UserError(f"MPI launcher {launcher} does not exist or is not executable",
                        "check --mpirun, or leave it out to search PATH")
    detected, version = detect(binary, cache=cache_root(env))
    if wanted is not None and wanted.family != detected.family:
        raise UserError(f"--mpi {wanted.name} asked for, but {binary} is {detected.title}",
                        f"pass --mpirun with a {wanted.title} launcher or --mpi {detected.name}")
    flavour = wanted or detected
    how = (f"{binary} --version says {detected.title} {version}" +
           ("" if wanted is None else f"; --mpi {wanted.name}"))
    libdir = find_libdir(flavour, binary)
    return MpiInstall(flavour, binary, version, libdir, how, missing_compat(flavour, libdir))


def locate(flavour: Flavour, launcher: str | None, env: dict[str, str]) -> MpiInstall:
    """Where a flavour named by the user lives, without running anything (per-rank use)."""
    binary = launcher or find_launcher(flavour, env) or ""
    libdir = find_libdir(flavour, binary) if binary else None
    return MpiInstall(flavour, binary, "unknown", libdir, f"--mpi {flavour.name}",
                      missing_compat(flavour, libdir))


def missing_compat(flavour: Flavour, libdir: str | None) -> tuple[CompatLink, ...]:
    """The family's compat links that ``libdir`` lacks while it has their target (Debian's
    MPICH: ``libmpich.so.12`` but no ``libmpi.so.12``); the plan makes them."""
    if not libdir:
        return ()
    return tuple(c for c in flavour.abi.compat
                 if not os.path.exists(os.path.join(libdir, c.name))
                 and os.path.exists(os.path.join(libdir, c.target)))
