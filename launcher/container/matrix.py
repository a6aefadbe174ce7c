"""The ABI matrix: every host MPI install x every MPI consumer in the image, decided.

:func:`decide` says whether a consumer (:mod:`.consumers`) runs on a host install
(:mod:`.mpis`): it works when one of the consumer's builds needs a libmpi of an ABI family
the install provides, with what that takes (the library bound, the soname link staged, the
``MPI4PY_MPIABI`` set), and when every other library of that MPI the build needs
(``libmpi_cxx.so.40``) is the host's, or the image's copy finds every symbol it takes from
libmpi in the host's libmpi (Open MPI 5 dropped ``libmpi_cxx``, and 4.1's copy needs
``ompi_mpi_errors_throw_exceptions``, which 5.0 does not define). Otherwise it is refused,
and why. ``hpcai-launch abi`` prints the matrix; the launch plan refuses a refused cell
of a consumer the command uses (:func:`required`) before any rank starts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..mpi import abi, elf
from . import consumers
from .consumers import Consumer, Need
from ..mpi.hostmpi import HostMpi
from ..mpi.mpis import HostInstall
from ...core.errors import UserError


@dataclass(frozen=True)
class Cell:
    """One host install x one consumer."""

    host: str                        # install label: "openmpi@4.1.4"
    consumer: str                    # consumer title
    works: bool
    lib: HostMpi | None              # the host library to bind (works)
    how: tuple[str, ...]             # what it takes (works)
    why: str                         # why not (refused)

    def to_dict(self) -> dict:
        return {"host": self.host, "consumer": self.consumer,
                "verdict": "works" if self.works else "refused",
                "libmpi": self.lib.libmpi if self.lib else None, "how": list(self.how),
                "why": self.why}

    @property
    def text(self) -> str:
        return ("works: " + "; ".join(self.how)) if self.works else "refused: " + self.why


def _missing_symbols(image: str, need: Need, name: str, lib: HostMpi) -> list[str]:
    """Symbols the image's copy of ``name`` takes from the image's libmpi that the host's
    libmpi does not define ([] when the image has no copy to check: then ``name`` is
    missing altogether, which the caller says)."""
    copy = consumers.image_library(image, name)
    image_libmpi = consumers.image_library(image, need.soname)
    if copy is None or image_libmpi is None:
        return []
    _, wanted = elf.dynamic_symbols(copy)
    from_libmpi = wanted & elf.dynamic_symbols(image_libmpi)[0]
    return sorted(from_libmpi - elf.dynamic_symbols(lib.libmpi)[0])


def _try(install: HostInstall, consumer: Consumer, need: Need, image: str
         ) -> tuple[HostMpi | None, tuple[str, ...], str]:
    lib = install.lib_for(need.family)
    family = abi.FAMILIES[need.family]
    if lib is None:
        return None, (), ""
    how = [f"binds {lib.libmpi}"]
    if lib.soname != need.soname:
        how.append(f"stages the soname link {need.soname} -> {lib.soname}")
    if consumer.kind == "mpi4py":
        how.append(f"MPI4PY_MPIABI={family.mpi4py_abi}")
    for name in need.family_libs:
        if os.path.isfile(os.path.join(lib.libdir, name)):
            how.append(f"binds the host's {name}")
            continue
        if consumers.image_library(image, name) is None:
            return None, (), (f"{consumer.title} needs {name}; neither {install.label} nor "
                              "the image has it")
        missing = _missing_symbols(image, need, name, lib)
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            return None, (), (f"{consumer.title} needs {name}, which {install.label} does not "
                              f"ship; the image's copy needs {missing[0]}{more}, which the "
                              f"host's {lib.soname} does not define")
        how.append(f"uses the image's {name} (every libmpi symbol it needs is in the host's)")
    return lib, tuple(how), ""


def decide(install: HostInstall, consumer: Consumer, image: str) -> Cell:
    reasons: list[str] = []
    for need in consumer.builds:
        lib, how, why = _try(install, consumer, need, image)
        if lib is not None:
            return Cell(install.label, consumer.title, True, lib, how, "")
        if why:
            reasons.append(why)
    if not reasons:
        wanted = " or ".join(f"{abi.FAMILIES[n.family].title}'s {n.soname}"
                             for n in consumer.builds)
        has = ", ".join(f"{abi.FAMILIES[x.family].title} ({x.soname})" for x in install.libs)
        reasons.append(f"{consumer.title} in the image needs {wanted}; the host MPI "
                       f"{install.label} provides {has}")
    return Cell(install.label, consumer.title, False, None, (), "; ".join(reasons))


def table(installs: list[HostInstall], found: list[Consumer], image: str) -> list[Cell]:
    return [decide(i, c, image) for i in installs for c in found]


def required(found: list[Consumer], command: tuple[str, ...]) -> list[Consumer]:
    """The consumers a command uses: mpi4py (hpcai's engine talks MPI through it), Horovod
    when an argument names it (``--comm horovod``, a horovod script), a program by path."""
    words = " ".join(command).lower()
    out = []
    for c in found:
        if c.kind == "mpi4py" or (c.kind == "horovod" and "horovod" in words) or (
                c.kind == "elf" and any(b.path in command for b in c.builds)):
            out.append(c)
    return out


def check(install: HostInstall, needed: list[Consumer], image: str,
          alternatives: list[HostInstall]) -> list[Cell]:
    """The cells of the consumers the command needs; UserError at the first refused one,
    its hint naming the host MPIs on which every needed consumer works."""
    cells = [decide(install, c, image) for c in needed]
    refused = next((c for c in cells if not c.works), None)
    if refused is None:
        return cells
    good = [i.label for i in alternatives
            if all(decide(i, c, image).works for c in needed)]
    hint = (f"use --mpi {' or --mpi '.join(good)}" if good else
            "no host MPI here runs it: rebuild the image's MPI programs for the host MPI's "
            "family") + "; `hpcai-launch abi --container IMG` prints every combination"
    raise UserError(f"refused before launch: {refused.why}", hint)


def render(cells: list[Cell], installs: list[HostInstall], found: list[Consumer]) -> str:
    lines = []
    for i in installs:
        lines.append(f"{i.label} ({', '.join(i.abis)}; {i.launcher or 'no launcher'})")
        for c in cells:
            if c.host == i.label:
                lines.append(f"  {c.consumer}: {c.text}")
    if not found:
        lines.append("(no MPI consumers in the image)")
    return "\n".join(lines) + "\n"
