"""What in an image needs MPI, and which ABI each expects, read from the ELF files.

:func:`inspect` reads a directory image's Python packages (``dist-packages`` and
``site-packages``) and ``/usr/local/bin``, ``/usr/local/lib``: every ELF whose ``DT_NEEDED``
names a libmpi is a consumer. mpi4py's ``MPI.*.so`` files form one consumer (the PyPI wheel
carries an Open MPI and an MPICH build and picks one at run time; a build for the MPI-5
standard ABI needs ``libmpi_abi.so``); every other file (Horovod's ``mpi_lib``) is its own.
The image's own MPI (``/usr/lib``, ``/usr/bin``) is not a consumer: the host MPI replaces it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from ..mpi import abi, elf
from .preflight import IMAGE_LIB_DIRS, _in_root

SCAN_GLOBS = ("usr/local/lib/python3*/dist-packages", "usr/local/lib/python3*/site-packages",
              "usr/lib/python3/dist-packages", "usr/lib/python3*/site-packages",
              "usr/local/bin", "usr/local/lib")


@dataclass(frozen=True)
class Need:
    """One build of a consumer: the file, the libmpi soname it needs, and the other
    libraries of that MPI family it needs (Open MPI's ``libmpi_cxx.so.40``)."""

    path: str                        # inside the image
    family: str                      # abi.FAMILIES name of the libmpi it needs
    soname: str
    family_libs: tuple[str, ...] = ()


@dataclass(frozen=True)
class Consumer:
    """A program or module in the image that loads libmpi: any one of ``builds`` works."""

    kind: str                        # "mpi4py" | "horovod" | "elf"
    title: str                       # "mpi4py (wheel: Open MPI + MPICH builds)"
    builds: tuple[Need, ...]

    @property
    def abis(self) -> tuple[str, ...]:
        return tuple(b.family for b in self.builds)

    def to_dict(self) -> dict:
        return {"kind": self.kind, "title": self.title, "abis": list(self.abis),
                "builds": [{"path": b.path, "family": b.family, "soname": b.soname,
                            "family_libs": list(b.family_libs)} for b in self.builds]}


def _family_libs(needed: tuple[str, ...], family: abi.Family) -> tuple[str, ...]:
    """The other libraries of the MPI that a file needs: libmpi_cxx.so.40 is Open MPI's."""
    stems = {s.split(".so")[0] for s in family.sonames}
    return tuple(n for n in needed if not family.owns(n)
                 and any(n.startswith(stem + "_") for stem in stems))


def _need(root: Path, path: Path) -> Need | None:
    if path.is_symlink() or not path.is_file() or elf.ident(path) is None:
        return None
    try:
        needed = elf.read_elf(path).needed
    except (ValueError, OSError):
        return None
    for name in needed:
        family = abi.family_of_soname(name)
        if family:
            return Need("/" + str(path.relative_to(root)), family.name, name,
                        _family_libs(needed, family))
    return None


def _files(root: Path) -> list[Path]:
    out: list[Path] = []
    for pattern in SCAN_GLOBS:
        for top in sorted(root.glob(pattern)):
            if top.name == "bin":
                out += sorted(top.iterdir())
            elif top.name == "lib":
                out += sorted(p for p in top.iterdir() if ".so" in p.name)
            else:
                out += sorted(p for p in top.rglob("*.so*"))
    return out


def _title(kind: str, builds: list[Need]) -> str:
    if kind == "horovod":      # .../horovod/torch/mpi_lib_v2.cpython-311-....so
        part = builds[0].path.split("/horovod/", 1)[1]
        return f"Horovod {part.split('.', 1)[0]}"
    if kind != "mpi4py":
        return builds[0].path
    titles = [abi.FAMILIES[b.family].title for b in builds]
    return f"mpi4py ({' + '.join(titles)} build{'s' if len(builds) > 1 else ''})"


def inspect(image: str | os.PathLike) -> list[Consumer] | None:
    """The MPI consumers of a directory image; None for an image that cannot be read
    here (SquashFS, SIF)."""
    root = Path(image)
    if not root.is_dir():
        return None
    mpi4py: list[Need] = []
    out: list[Consumer] = []
    seen: set[str] = set()
    for path in _files(root):
        need = _need(root, path)
        if need is None or need.path in seen:
            continue
        seen.add(need.path)
        if "/mpi4py/" in need.path:
            mpi4py.append(need)
        else:
            kind = "horovod" if "/horovod/" in need.path else "elf"
            out.append(Consumer(kind, _title(kind, [need]), (need,)))
    if mpi4py:
        out.insert(0, Consumer("mpi4py", _title("mpi4py", mpi4py), tuple(mpi4py)))
    return out


def image_library(image: str | os.PathLike, soname: str) -> str | None:
    """Host path of ``soname`` in the image's library directories, or None."""
    for d in IMAGE_LIB_DIRS:
        candidate = _in_root(Path(image), f"{d}/{soname}")
        if candidate.is_file():
            return str(candidate)
    return None
