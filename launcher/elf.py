"""A minimal ELF64 little-endian reader: soname, DT_NEEDED, run paths and glibc needs.

Only what host-library binding needs, in the standard library (no pyelftools):

- ``read_elf(path)`` reads the dynamic segment (``PT_DYNAMIC``; its string table and
  version tables are virtual addresses, mapped to file offsets through the ``PT_LOAD``
  segments). Files without program headers (separate debug files, relocatable objects) fall
  back to the section headers (``SHT_DYNAMIC`` and its linked string table).
- ``glibc_needed`` is the highest ``GLIBC_x.y`` version this file requires
  (``.gnu.version_r`` / ``DT_VERNEED``): a host library needing ``GLIBC_2.38`` cannot load in
  an image whose glibc is 2.36.
- ``glibc_version_of(libc)`` reads the version of a ``libc.so.6`` file: its banner
  ("GNU C Library ... release version 2.36.") or else the highest ``GLIBC_2.x`` it defines.

Files are memory-mapped, so a 40 MB libmpich costs a few page reads, not a 40 MB read.
"""

from __future__ import annotations

import mmap
import os
import re
import struct
from dataclasses import dataclass

ELF_MAGIC = b"\x7fELF"

_PT_LOAD, _PT_DYNAMIC = 1, 2
_SHT_DYNAMIC = 6

_DT_NULL, _DT_NEEDED, _DT_STRTAB, _DT_STRSZ = 0, 1, 5, 10
_DT_SONAME, _DT_RPATH, _DT_RUNPATH = 14, 15, 29
_DT_VERDEF, _DT_VERDEFNUM = 0x6FFFFFFC, 0x6FFFFFFD
_DT_VERNEED, _DT_VERNEEDNUM = 0x6FFFFFFE, 0x6FFFFFFF

_GLIBC_VERSION = re.compile(r"GLIBC_(\d+)\.(\d+)(?:\.\d+)*$")


@dataclass(frozen=True)
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


def is_elf(path: str | os.PathLike) -> bool:
    """True when ``path`` is a readable file starting with the ELF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == ELF_MAGIC
    except OSError:
        return False


def read_elf(path: str | os.PathLike) -> ElfInfo:
    """Parse ``path``; ValueError if it is not a 64-bit little-endian ELF (or is truncated)."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 64:
            raise ValueError(f"{path}: not an ELF file ({size} bytes)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            try:
                return _Parser(path, data).parse()
            except struct.error as exc:
                raise ValueError(f"{path}: truncated or corrupt ELF file ({exc})") from None


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
            if data[:4] == ELF_MAGIC:
                try:
                    defined = _Parser(path, data).defined_glibc()
                except struct.error:
                    defined = None
                if defined:
                    return defined
    raise ValueError(f"{path}: no glibc version found (neither the 'GNU C Library ... "
                     "version' banner nor GLIBC_2.x version definitions)")


def _glibc_tuple(name: str) -> tuple[int, int] | None:
    m = _GLIBC_VERSION.match(name)
    return (int(m.group(1)), int(m.group(2))) if m else None


class _Parser:
    def __init__(self, path: str, data) -> None:
        self.path = path
        self.data = data
        if data[:4] != ELF_MAGIC:
            raise ValueError(f"{path}: not an ELF file (magic {bytes(data[:4])!r})")
        if data[4] != 2:
            raise ValueError(f"{path}: 32-bit ELF (ELFCLASS{32 if data[4] == 1 else '?'}); "
                             "only 64-bit ELF is supported")
        if data[5] != 1:
            raise ValueError(f"{path}: big-endian ELF; only little-endian is supported")
        (self.e_type, self.e_machine, _, _, self.phoff, self.shoff, _, _, self.phentsize,
         phnum, self.shentsize, shnum, self.shstrndx) = struct.unpack_from(
            "<HHIQQQIHHHHHH", data, 16)
        if shnum == 0 and self.shoff:
            shnum = self._section(0)[5]          # sh_size of section 0 holds the real count
        if phnum == 0xFFFF and self.shoff:
            phnum = self._section(0)[7]          # PN_XNUM: sh_info of section 0
        self.phnum, self.shnum = phnum, shnum

    # --- raw structures ----------------------------------------------------------------

    def _program_headers(self):
        for i in range(self.phnum if self.phoff else 0):
            # p_type, p_flags, p_offset, p_vaddr, p_paddr, p_filesz, p_memsz, p_align
            yield struct.unpack_from("<IIQQQQQQ", self.data, self.phoff + i * self.phentsize)

    def _section(self, i: int):
        # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info, ...
        return struct.unpack_from("<IIQQQQIIQQ", self.data, self.shoff + i * self.shentsize)

    def _sections(self):
        for i in range(self.shnum if self.shoff else 0):
            yield self._section(i)

    def _cstr(self, offset: int, limit: int | None = None) -> str:
        end = self.data.find(b"\x00", offset, limit if limit is not None else len(self.data))
        if offset >= len(self.data) or end < 0:
            raise ValueError(f"{self.path}: string at offset {offset} outside the file")
        return self.data[offset:end].decode("utf-8", "surrogateescape")

    # --- the dynamic section, via program headers or section headers -------------------

    def _dynamic(self):
        """(entries, to_offset, strtab_offset or None) of the dynamic section, or None.

        ``to_offset`` maps the entries' virtual addresses to file offsets. Through the
        section headers the linked string table's offset is known directly.
        """
        loads, dyn = [], None
        for p_type, _, offset, vaddr, _, filesz, _, _ in self._program_headers():
            if p_type == _PT_LOAD:
                loads.append((vaddr, offset, filesz))
            elif p_type == _PT_DYNAMIC:
                dyn = (offset, filesz)
        if dyn is None or not loads:       # no program headers: use the section headers
            sections = list(self._sections())
            loads = [(s[3], s[4], s[5]) for s in sections if s[3]]
            dynamic = [s for s in sections if s[1] == _SHT_DYNAMIC]
            if not dynamic:
                return None
            link = dynamic[0][6]
            strtab = sections[link][4] if 0 < link < len(sections) else None
            dyn = (dynamic[0][4], dynamic[0][5])
        else:
            strtab = None

        def to_offset(addr: int) -> int:
            for vaddr, offset, filesz in loads:
                if vaddr <= addr < vaddr + filesz:
                    return addr - vaddr + offset
            raise ValueError(f"{self.path}: address {addr:#x} is not backed by the file")
        return self._entries(*dyn), to_offset, strtab

    def _entries(self, offset: int, size: int) -> list[tuple[int, int]]:
        entries = []
        for pos in range(offset, offset + size - 15, 16):
            tag, value = struct.unpack_from("<qQ", self.data, pos)
            if tag == _DT_NULL:
                break
            entries.append((tag, value))
        return entries

    # --- public results -----------------------------------------------------------------

    def parse(self) -> ElfInfo:
        found = self._dynamic()
        if found is None:       # static executable, object file: nothing dynamic
            return ElfInfo(self.path, None, (), (), (), None, ())
        entries, to_offset, strtab = found
        values: dict[int, list[int]] = {}
        for tag, value in entries:
            values.setdefault(tag, []).append(value)
        if strtab is None:
            if _DT_STRTAB not in values:
                raise ValueError(f"{self.path}: dynamic section without DT_STRTAB")
            strtab = to_offset(values[_DT_STRTAB][0])
        strsz = values.get(_DT_STRSZ, [None])[0]
        limit = strtab + strsz if strsz else None

        def string(index: int) -> str:
            return self._cstr(strtab + index, limit)

        def paths(tag: int) -> tuple[str, ...]:
            return tuple(p for v in values.get(tag, []) for p in string(v).split(":") if p)

        soname = string(values[_DT_SONAME][0]) if _DT_SONAME in values else None
        needed = tuple(string(v) for v in values.get(_DT_NEEDED, []))
        needs: list[tuple[str, tuple[str, ...]]] = []
        if _DT_VERNEED in values:
            count = values.get(_DT_VERNEEDNUM, [1 << 16])[0]
            needs = self._verneed(to_offset(values[_DT_VERNEED][0]), count, string)
        glibc = [v for _, names in needs for n in names if (v := _glibc_tuple(n))]
        return ElfInfo(self.path, soname, needed, paths(_DT_RUNPATH), paths(_DT_RPATH),
                       max(glibc) if glibc else None, tuple(needs))

    def _verneed(self, offset: int, count: int, string) -> list[tuple[str, tuple[str, ...]]]:
        out = []
        for _ in range(count):
            _, vn_cnt, vn_file, vn_aux, vn_next = struct.unpack_from("<HHIII", self.data, offset)
            names, aux = [], offset + vn_aux
            for _ in range(vn_cnt):
                _, _, _, vna_name, vna_next = struct.unpack_from("<IHHII", self.data, aux)
                names.append(string(vna_name))
                if not vna_next:
                    break
                aux += vna_next
            out.append((string(vn_file), tuple(names)))
            if not vn_next:
                break
            offset += vn_next
        return out

    def defined_glibc(self) -> tuple[int, int] | None:
        """Highest GLIBC_x.y this file defines (.gnu.version_d), e.g. libc.so.6 itself."""
        found = self._dynamic()
        if found is None:
            return None
        entries, to_offset, strtab = found
        values = dict(reversed(entries))
        if _DT_VERDEF not in values or (strtab is None and _DT_STRTAB not in values):
            return None
        if strtab is None:
            strtab = to_offset(values[_DT_STRTAB])
        offset = to_offset(values[_DT_VERDEF])
        best = None
        for _ in range(values.get(_DT_VERDEFNUM, 1 << 16)):
            _, _, _, vd_cnt, _, vd_aux, vd_next = struct.unpack_from("<HHHHIII", self.data,
                                                                     offset)
            if vd_cnt:
                (vda_name,) = struct.unpack_from("<I", self.data, offset + vd_aux)
                version = _glibc_tuple(self._cstr(strtab + vda_name))
                if version and (best is None or version > best):
                    best = version
            if not vd_next:
                break
            offset += vd_next
        return best
