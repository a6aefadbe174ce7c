"""Checks before any rank starts: each raises ``UserError(message, hint)`` (the CLI prints
``error:``/``hint:`` and exits 2).

- :func:`check_image`: the image exists (directory, SquashFS or SIF) and, for a directory,
  has the empty mount point the host libraries are bound at;
- :func:`check_abi`: host and image MPI are of the same ABI family;
- :func:`check_glibc`: no bound library needs a newer glibc than the image's.
(srun's PMI plugin is checked in :mod:`hpcai.launcher.mpi.pmi`.)

:func:`read_image` describes an image: from ``IMG/opt/hpcai/manifest.json`` when the image
has one (``{"glibc": "2.36", "mpi": {"family": "mpich", "soname": "libmpich.so.12"}}``),
else by looking at its library directories and reading its ``libc.so.6``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from ..mpi import abi, elf
from ...core.errors import UserError

MANIFEST = "opt/hpcai/manifest.json"
# The image is of this machine's architecture: its multiarch directory is ours.
IMAGE_LIB_DIRS = (f"/usr/lib/{abi.MULTIARCH}", f"/lib/{abi.MULTIARCH}", "/usr/lib64",
                  "/usr/local/lib")
SQUASH_SUFFIXES = (".sqfs", ".squashfs", ".squash")
SIF_SUFFIXES = (".sif", ".simg")


def format_version(version: tuple[int, int] | None) -> str:
    return ".".join(map(str, version)) if version else "unknown"


# --- the image -----------------------------------------------------------------------------

def image_kind(path: str | os.PathLike) -> str | None:
    """"dir", "squash" or "sif" (by magic number, then by suffix); None if not an image."""
    p = Path(path)
    if p.is_dir():
        return "dir"
    if not p.is_file():
        return None
    try:
        with open(p, "rb") as f:
            head = f.read(64)
    except OSError:
        return None
    if head[:4] == b"hsqs":
        return "squash"
    if b"SIF_MAGIC" in head:
        return "sif"
    name = p.name.lower()
    if name.endswith(SQUASH_SUFFIXES):
        return "squash"
    if name.endswith(SIF_SUFFIXES):
        return "sif"
    return None


def check_image(path: str | os.PathLike, mount_point: str) -> str:
    """The image's kind; UserError if it is missing, not an image, or (for a directory
    image) lacks ``mount_point``, which bind mounts need to exist."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise UserError(f"container image {path} does not exist",
                        "build one with charliecloud/build-image.sh, or give the path of an "
                        "image directory, a SquashFS file (.sqfs) or a SIF file (.sif)")
    kind = image_kind(path)
    if kind is None:
        raise UserError(f"{path} is not a container image (neither a directory nor a "
                        "SquashFS or SIF file)",
                        "give an unpacked image directory, a .sqfs or a .sif file")
    if kind == "dir":
        inside = _in_root(Path(path), mount_point)
        if not inside.is_dir():
            raise UserError(f"image {path} has no mount point {mount_point} for the host "
                            "libraries",
                            "rebuild the image with charliecloud/build-image.sh (it creates "
                            f"{mount_point}), or add 'mkdir -p {mount_point}' to your image "
                            "recipe: bind targets must exist in the image")
    return kind


def _in_root(root: Path, path: str, max_links: int = 40) -> Path:
    """``path`` inside an image root, following the image's symlinks (absolute ones
    relative to the image root, as inside the container), never leaving the root."""
    parts = deque(p for p in path.split("/") if p not in ("", "."))
    current: list[str] = []
    links = 0
    while parts:
        part = parts.popleft()
        if part == "..":
            if current:
                current.pop()
            continue
        candidate = root.joinpath(*current, part)
        if candidate.is_symlink() and links < max_links:
            links += 1
            target = os.readlink(candidate)
            if target.startswith("/"):
                current = []
            parts.extendleft(reversed([p for p in target.split("/") if p not in ("", ".")]))
        else:
            current.append(part)
    return root.joinpath(*current)


@dataclass(frozen=True)
class ImageInfo:
    path: str
    kind: str                           # "dir" | "squash" | "sif"
    mpi_family: str | None              # "openmpi" | "mpich" | "mpiabi" | None (no MPI)
    mpi_soname: str | None
    glibc: tuple[int, int] | None
    sonames: frozenset[str]             # library file names in the image's library dirs
    how: str = ""                       # "manifest", "scan ...", "unsquashfs ...", "unknown"
    abis: tuple[str, ...] = ()          # MPI ABIs the image's programs can use (manifest)

    def to_dict(self) -> dict:
        return {"path": self.path, "kind": self.kind, "mpi_family": self.mpi_family,
                "mpi_soname": self.mpi_soname, "glibc": format_version(self.glibc),
                "libraries": len(self.sonames), "how": self.how}


def _parse_glibc(text) -> tuple[int, int] | None:
    m = re.match(r"\s*(\d+)\.(\d+)", str(text)) if text else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def _mpi_from_names(names: set[str], libmpi_target: str | None
                    ) -> tuple[str | None, str | None, str]:
    """(family, soname, note) from the library names an image has.

    With several MPI families present, the development link ``libmpi.so`` (Debian's
    alternatives) decides; without it the family is left open (None) and the note says so.
    """
    found = [(n, abi.family_of_soname(n).name) for n in abi.libmpi_names(names)]
    families = sorted({family for _, family in found})
    if len(families) > 1:
        if libmpi_target:
            for soname, family in found:
                if os.path.basename(libmpi_target).startswith(soname):
                    return family, soname, f" ({family} chosen by libmpi.so)"
        return None, None, f" (several MPI families: {', '.join(families)}; none chosen)"
    return (found[0][1], found[0][0], "") if found else (None, None, "")


def _is_lib(name: str) -> bool:
    return ".so" in name and not name.endswith((".a", ".la"))


def read_image(path: str | os.PathLike) -> ImageInfo:
    """What the image offers (see the module docstring). UserError if it is no image."""
    path = os.fspath(path)
    kind = image_kind(path)
    if kind is None:
        raise UserError(f"container image {path} does not exist or is not an image",
                        "build one with charliecloud/build-image.sh")
    if kind == "squash":
        return _read_squash(path)
    if kind != "dir":
        return ImageInfo(path, kind, None, None, None, frozenset(), "unknown")
    root = Path(path)
    names: set[str] = set()
    for d in IMAGE_LIB_DIRS:
        real = _in_root(root, d)
        if real.is_dir():
            names.update(n for n in os.listdir(real) if _is_lib(n))
    manifest = _in_root(root, MANIFEST)
    if manifest.is_file():
        try:
            data = json.loads(manifest.read_text())
        except (OSError, ValueError) as exc:
            raise UserError(f"image manifest {manifest} is unreadable: {exc}",
                            "rebuild the image with charliecloud/build-image.sh") from None
        return _from_manifest(path, kind, data, names)
    libmpi = None
    for d in IMAGE_LIB_DIRS:
        link = _in_root(root, d) / "libmpi.so"
        if link.is_symlink() or link.exists():
            libmpi = str(_in_root(root, f"{d}/libmpi.so"))
            break
    family, soname, note = _mpi_from_names(names, libmpi)
    glibc = None
    for d in IMAGE_LIB_DIRS:
        libc = _in_root(root, f"{d}/libc.so.6")
        if libc.is_file():
            try:
                glibc = elf.glibc_version_of(libc)
                break
            except (ValueError, OSError):
                continue
    return ImageInfo(path, kind, family, soname, glibc, frozenset(names), "scan" + note)


def _from_manifest(path: str, kind: str, data: dict, names: set[str]) -> ImageInfo:
    mpi = data.get("mpi") or {}
    if not isinstance(mpi, dict):
        mpi = {}
    listed = data.get("sonames") or data.get("libraries") or []
    names = set(names) | {n for n in listed if isinstance(n, str)}
    family, soname = mpi.get("family"), mpi.get("soname")
    known = abi.FAMILIES.get(family) if family else abi.family_of_soname(soname or "")
    if family and not soname and known and known.sonames:
        soname = known.sonames[0]
    if soname and not family and known:
        family = known.name
    abis = tuple(a for a in mpi.get("abis") or () if isinstance(a, str))
    return ImageInfo(path, kind, family or None, soname or None, _parse_glibc(data.get("glibc")),
                     frozenset(names), "manifest", abis)


def _read_squash(path: str) -> ImageInfo:
    """A SquashFS image, read with unsquashfs when it is installed (nothing is extracted)."""
    binary = shutil.which("unsquashfs")
    if not binary:
        return ImageInfo(path, "squash", None, None, None, frozenset(), "unknown")

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([binary, *args], capture_output=True, timeout=120, check=False)

    listing = run("-lc", "-d", "", path)
    names: set[str] = set()
    wanted = tuple(d.strip("/") + "/" for d in IMAGE_LIB_DIRS)
    for line in listing.stdout.decode(errors="replace").splitlines():
        rel = line.strip().lstrip("/")
        if rel.startswith(wanted) and "/" not in rel[len(_prefix(rel, wanted)):]:
            if _is_lib(os.path.basename(rel)):
                names.add(os.path.basename(rel))
    manifest = run("-cat", path, MANIFEST)
    if manifest.returncode == 0 and manifest.stdout.strip():
        try:
            return _from_manifest(path, "squash", json.loads(manifest.stdout), names)
        except ValueError:
            pass
    family, soname, note = _mpi_from_names(names, None)
    return ImageInfo(path, "squash", family, soname, None, frozenset(names),
                     "unsquashfs" + note)


def _prefix(rel: str, prefixes: tuple[str, ...]) -> str:
    return next(p for p in prefixes if rel.startswith(p))


# --- ABI, glibc and PMI ------------------------------------------------------------------

def check_abi(host, image_family: str | None, image_soname: str | None) -> None:
    """Host MPI (a ``hostmpi.HostMpi``) and image MPI must share an ABI family.

    An image without MPI is fine (the host's is all there is). An image built for a
    side-by-side family (the MPI-5 standard ABI) also runs on a host whose MPI ships that
    family's library (``libmpi_abi.so``) beside its own.
    """
    if not image_family or image_family == host.family:
        return
    wanted = abi.FAMILIES.get(image_family)
    if wanted and wanted.side_by_side and _ships(host.libdir, wanted):
        return
    host_family = abi.FAMILIES.get(host.family)
    image_what = image_soname or (wanted.described if wanted else image_family)
    raise UserError(
        f"ABI mismatch: the host MPI is {host.name} {host.version} ({host.soname}, "
        f"{host.family} ABI) but the image's MPI is {image_family} ({image_what}); "
        "binding one into the other breaks at the first MPI call",
        f"use an image built with the host's MPI family ({host.family}: "
        f"{host_family.described if host_family else host.soname}), or run with "
        "--no-bind-host-mpi to use the image's own MPI")


def _ships(libdir: str, family: abi.Family) -> bool:
    """Whether ``libdir`` holds a libmpi of ``family``."""
    try:
        return any(map(family.owns, os.listdir(libdir)))
    except OSError:
        return False


def check_glibc(libs, image_glibc: tuple[int, int]) -> None:
    """Every bound library (``hostlibs.LibFile``) must load with the image's glibc."""
    too_new = []
    for lib in libs:
        needed = elf.read_elf(lib.path).glibc_needed
        if needed and needed > tuple(image_glibc):
            too_new.append((needed, lib))
    if not too_new:
        return
    too_new.sort(key=lambda x: x[0], reverse=True)
    needed, lib = too_new[0]
    others = f" (and {len(too_new) - 1} more)" if len(too_new) > 1 else ""
    raise UserError(
        f"host library {lib.name} ({lib.path}) needs GLIBC_{format_version(needed)} "
        f"but the image has "
        f"glibc {format_version(tuple(image_glibc))}{others}",
        f"rebuild the image on a newer base (glibc >= {format_version(needed)}), or bind fewer "
        "libraries (--no-bind-host-mpi, or drop them from the site profile)")


