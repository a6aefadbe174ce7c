"""The dynamic-linking facts of ELF files, read with pyelftools: soname, DT_NEEDED, run
paths and glibc version needs.

- :func:`read_elf` reads the dynamic section (``SHT_DYNAMIC``; without section headers the
  ``PT_DYNAMIC`` segment) and the version needs (``.gnu.version_r``): a host library needing
  ``GLIBC_2.38`` cannot load in an image whose glibc is 2.36. Results are cached per
  (path, size, mtime).
- :func:`glibc_version_of` reads the version of a ``libc.so.6`` file: its banner
  ("GNU C Library ... release version 2.36.") or else the highest ``GLIBC_2.x`` it defines.
- :func:`ident` is the (class, byte order, machine) of a file, read from its first 20 bytes.
- :func:`dynamic_symbols`: the names a file defines and the names it needs (``.dynsym``).

pyelftools is imported inside the functions, so modules on the per-rank path do not pay
for it. Measured against the struct-based reader this replaced (Python 3.11, medians, 2 busy
cores): ``import elftools.elf.elffile`` 28 ms; one read 1.0-1.6 ms against 0.06-0.15 ms
(libmpi.so.40 1 MB, libmpich.so.12 42 MB, libtorch_cpu.so 434 MB, libtensorflow_cc.so.2
788 MB), the same results for all 1086 libraries in /lib/x86_64-linux-gnu; finding,
collecting and glibc-checking the host Open MPI's 175 libraries 0.30-0.38 s against 0.05 s.
Kept: that is paid once per container launch (by the outer launcher; by each rank only
when srun starts ranks without one), beside seconds of rank start-up, and pyelftools reads
any ELF class and byte order. Sections are made one type at
a time (:func:`_sections`): making them all parses the GNU hash table, 93 ms for
libtensorflow_cc.so.2.
"""

from __future__ import annotations

import functools
import mmap
import os
import re
from ...core.record import record

TYPE_CHECKING = False     # typing's constant, without importing typing
if TYPE_CHECKING:
    from collections.abc import Iterator
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import Section

_GLIBC_VERSION = re.compile(r"GLIBC_(\d+)\.(\d+)(?:\.\d+)*$")


@record
class ElfInfo:
    """The dynamic-linking facts of one ELF file."""

    path: str
    soname: str | None
    needed: tuple[str, ...]                  # DT_NEEDED, in file order
    runpath: tuple[str, ...]                 # DT_RUNPATH entries (unexpanded: $ORIGIN kept)
    rpath: tuple[str, ...]                   # DT_RPATH entries (used only without RUNPATH)
    glibc_needed: tuple[int, int] | None     # highest GLIBC_x.y required, None if none
    version_needs: tuple[tuple[str, tuple[str, ...]], ...] = ()  # (file, (version, ...))

    @property
    def search_path(self) -> tuple[str, ...]:
        """The file's own library search path, as ld.so uses it (RUNPATH wins over RPATH)."""
        return self.runpath if self.runpath else self.rpath


def ident(path: str | os.PathLike) -> tuple[int, int, int] | None:
    """(EI_CLASS, EI_DATA, e_machine) of an ELF file; None if it is not one or unreadable."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return None
    if len(head) < 20 or head[:4] != b"\x7fELF":
        return None
    return head[4], head[5], int.from_bytes(head[18:20], "little" if head[5] == 1 else "big")


def read_elf(path: str | os.PathLike) -> ElfInfo:
    """Parse ``path``; ValueError if it is not an ELF file or is truncated or corrupt."""
    path = os.fspath(path)
    st = os.stat(path)
    return _read_elf(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=4096)
def _read_elf(path: str, size: int, mtime_ns: int) -> ElfInfo:
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    with open(path, "rb") as f:
        if f.read(4) != b"\x7fELF":
            raise ValueError(f"{path}: not an ELF file")
        try:
            return _info(path, ELFFile(f))
        except ELFError as exc:
            raise ValueError(f"{path}: truncated or corrupt ELF file ({exc})") from None


def _info(path: str, elffile: ELFFile) -> ElfInfo:
    from elftools.elf.dynamic import DynamicSegment

    wanted = {s["sh_type"]: s for s in _sections(elffile, ("SHT_DYNAMIC", "SHT_GNU_verneed"))}
    dynamic = wanted.get("SHT_DYNAMIC") or next(
        (s for s in elffile.iter_segments() if isinstance(s, DynamicSegment)), None)
    if dynamic is None:         # static executable, object file: nothing dynamic
        return ElfInfo(path, None, (), (), (), None, ())
    tags: dict[str, list[str]] = {}
    for tag in dynamic.iter_tags():
        kind = tag.entry.d_tag
        if kind in ("DT_NEEDED", "DT_SONAME", "DT_RUNPATH", "DT_RPATH"):
            tags.setdefault(kind, []).append(getattr(tag, kind[3:].lower()))

    def paths(kind: str) -> tuple[str, ...]:
        return tuple(p for value in tags.get(kind, ()) for p in value.split(":") if p)

    needs: tuple[tuple[str, tuple[str, ...]], ...] = ()
    if "SHT_GNU_verneed" in wanted:
        needs = tuple((vn.name, tuple(aux.name for aux in auxes))
                      for vn, auxes in wanted["SHT_GNU_verneed"].iter_versions())
    glibc = [v for _, names in needs for n in names if (v := _glibc_tuple(n))]
    return ElfInfo(path, tags.get("DT_SONAME", [None])[0], tuple(tags.get("DT_NEEDED", ())),
                   paths("DT_RUNPATH"), paths("DT_RPATH"), max(glibc) if glibc else None,
                   needs)


def _sections(elffile: ELFFile, types: tuple[str, ...]) -> Iterator[Section]:
    """The sections of these types, without making the others (``get_section`` checks the
    type in the header before it builds the section)."""
    from elftools.common.exceptions import ELFError, ELFParseError

    for i in range(elffile.num_sections()):
        try:
            yield elffile.get_section(i, type=types)
        except ELFParseError:
            raise
        except ELFError:        # "Unexpected section type": one of the others
            continue


def glibc_version_of(libc_path: str | os.PathLike) -> tuple[int, int]:
    """The glibc version of a ``libc.so.6`` file, e.g. (2, 36). ValueError if not glibc."""
    path = os.fspath(libc_path)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise ValueError(f"{path}: empty file, not a glibc libc.so.6")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            banner = re.search(rb"GNU C Library[^\x00\n]{0,200}?version (\d+)\.(\d+)", data)
            if banner:
                return int(banner.group(1)), int(banner.group(2))
        defined = _defined_glibc(f) if ident(path) else None
    if defined:
        return defined
    raise ValueError(f"{path}: no glibc version found (neither the 'GNU C Library ... "
                     "version' banner nor GLIBC_2.x version definitions)")


def _defined_glibc(stream) -> tuple[int, int] | None:
    """Highest GLIBC_x.y a file defines (.gnu.version_d), e.g. libc.so.6 itself."""
    from elftools.common.exceptions import ELFError
    from elftools.elf.elffile import ELFFile

    try:
        found = [v for section in _sections(ELFFile(stream), ("SHT_GNU_verdef",))
                 for _, auxes in section.iter_versions()
                 for aux in list(auxes)[:1] if (v := _glibc_tuple(aux.name))]
    except ELFError:
        return None
    return max(found) if found else None


def _glibc_tuple(name: str) -> tuple[int, int] | None:
    m = _GLIBC_VERSION.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def dynamic_symbols(path: str | os.PathLike) -> tuple[frozenset[str], frozenset[str]]:
    """(defined, undefined) names of the file's dynamic symbol table (``.dynsym``)."""
    path = os.fspath(path)
    st = os.stat(path)
    return _dynamic_symbols(path, st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _dynamic_symbols(path: str, size: int, mtime_ns: int
                     ) -> tuple[frozenset[str], frozenset[str]]:
    from elftools.elf.elffile import ELFFile

    defined: set[str] = set()
    undefined: set[str] = set()
    with open(path, "rb") as f:
        for section in _sections(ELFFile(f), ("SHT_DYNSYM",)):
            for sym in section.iter_symbols():
                if sym.name:
                    (undefined if sym["st_shndx"] == "SHN_UNDEF" else defined).add(sym.name)
    return frozenset(defined), frozenset(undefined)
