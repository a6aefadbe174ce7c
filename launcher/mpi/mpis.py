"""Every MPI install on the host, as a list: family, version, ABIs, launcher, PMI support.

:func:`discover` looks in ``ldconfig -p`` (the distribution's MPIs), the prefixes named by
the MPI environment variables (:data:`.abi.ROOT_VARS`), the site profile's
``mpi_prefixes``, the prefixes ``scripts/install.sh`` fills (``<venv>/opt/*``) and any
``extra`` path (``--mpi PATH``). One install can provide several ABIs (MPICH 5: its legacy
``libmpi.so.12`` and the MPI-5 standard ``libmpi_abi.so.1``): each is a :class:`.HostMpi`
of its ``libs``. :func:`select` picks one by family, ``family@version`` or path.
"""

from __future__ import annotations

import mmap
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from ...core.paths import which
from . import abi, hostmpi
from .hostmpi import HostMpi
from ...core.errors import UserError


@dataclass(frozen=True)
class HostInstall:
    """One MPI install on the host and the ABIs its libraries provide."""

    name: str                       # implementation: "openmpi" | "mpich" | "intel" | ...
    version: str
    libs: tuple[HostMpi, ...]       # one per ABI: legacy first, then the MPI-5 standard
    launcher: str | None            # its mpirun/mpiexec, None if none was found
    pmi: tuple[str, ...]            # PMI clients its libmpi speaks: "pmix", "pmi2", "pmi1"
    how: str                        # where it was found

    @property
    def family(self) -> str:
        """The install's own (first) ABI family."""
        return self.libs[0].family

    @property
    def abis(self) -> tuple[str, ...]:
        return tuple(lib.family for lib in self.libs)

    @property
    def prefix(self) -> str | None:
        return self.libs[0].root

    @property
    def label(self) -> str:
        """``name@version``, as ``--mpi`` accepts it."""
        return f"{self.name}@{self.version}"

    def lib_for(self, family: str) -> HostMpi | None:
        return next((lib for lib in self.libs if lib.family == family), None)

    def to_dict(self) -> dict:
        return {"name": self.name, "version": self.version, "family": self.family,
                "abis": list(self.abis), "prefix": self.prefix, "launcher": self.launcher,
                "pmi": list(self.pmi), "how": self.how,
                "libs": [{"family": x.family, "soname": x.soname, "libmpi": x.libmpi}
                         for x in self.libs]}


def _libs_in(directory: str) -> list[HostMpi]:
    """Every libmpi file in ``directory``, identified, one per ABI family."""
    found: dict[str, HostMpi] = {}
    for lib in hostmpi.libmpis_in(directory):
        found.setdefault(lib.family, lib)
    return list(found.values())


def _pmi_of(lib: HostMpi) -> tuple[str, ...]:
    out: list[str] = []
    with open(lib.libmpi, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        out += [pmi for marker, pmi in abi.PMI_MARKERS
                if data.find(marker) >= 0 and pmi not in out]
    family = abi.FAMILIES[lib.family]
    real_dir = Path(lib.libmpi).parent
    for spec in family.components:
        for sub in spec.dirs:
            for pattern, pmi in abi.PMI_PLUGINS:
                if pmi not in out and any((real_dir / sub).glob(pattern)):
                    out.append(pmi)
    return tuple(out)


def _flavour(lib: HostMpi) -> abi.Flavour:
    return abi.FLAVOURS.get(lib.name) or next(
        f for f in abi.FLAVOURS.values() if f.family == lib.family)


def _launcher(lib: HostMpi, env: dict[str, str]) -> str | None:
    """The install's launcher: in its prefix's bin/, else (a distribution MPI) the
    flavour's launcher names that carry the flavour's name (mpirun.openmpi, mpiexec.mpich)."""
    flavour = _flavour(lib)
    if lib.root:
        for name in flavour.launchers:
            candidate = Path(lib.root) / "bin" / name
            if os.access(candidate, os.X_OK):
                return str(candidate)
        return None
    path = env.get("PATH", os.defpath)
    for name in flavour.launchers:
        if flavour.name in name:
            found = which(name, path=path)
            if found:
                return found
    return None


def _install(libs: list[HostMpi], env: dict[str, str], how: str) -> HostInstall:
    libs = sorted(libs, key=lambda x: abi.FAMILIES[x.family].side_by_side)
    first = libs[0]
    pmi = tuple(dict.fromkeys(p for lib in libs for p in _pmi_of(lib)))
    return HostInstall(first.name, first.version, tuple(libs), _launcher(first, env), pmi, how)


def install_prefixes(env: dict[str, str], site_prefixes: tuple[str, ...] = ()
                     ) -> list[tuple[str, str]]:
    """(prefix or library directory, how) to look in, in order."""
    out: list[tuple[str, str]] = []
    for root in abi.ROOT_VARS:
        if env.get(root.var):
            out += [(str(Path(env[root.var]) / sub), f"${root.var}") for sub in root.subdirs]
    out += [(p, "site profile mpi_prefixes") for p in site_prefixes]
    opt = Path(sys.prefix) / "opt"
    if opt.is_dir():
        out += [(str(p), f"installed by scripts/install.sh in {opt}")
                for p in sorted(opt.iterdir()) if p.is_dir()]
    return out


def _dirs_of(path: str) -> list[str]:
    """Library directories of a prefix, a library directory, a libmpi file or a launcher."""
    p = Path(path)
    if p.is_file():
        real = Path(os.path.realpath(p))
        if real.parent.name == "bin":          # a launcher: its prefix
            p = real.parent.parent
        else:
            return [str(p.parent)]
    subs = ("", "lib", "lib64", "lib/release", f"lib/{abi.MULTIARCH}")
    return [str(p / s) if s else str(p) for s in subs]


def install_at(path: str, env: dict[str, str], how: str = "") -> HostInstall | None:
    """The MPI install at ``path`` (prefix, library directory, libmpi or launcher)."""
    for d in _dirs_of(path):
        libs = _libs_in(d)
        if libs:
            return _install(libs, env, how or f"at {path}")
    return None


def install_of(lib: HostMpi, env: dict[str, str]) -> HostInstall:
    """The install a found libmpi belongs to: with the other ABIs of its prefix (a system
    library directory holds several MPIs: there, the library alone)."""
    if lib.root:
        install = install_at(lib.libdir, env, lib.how)
        if install is not None and lib.libmpi in {x.libmpi for x in install.libs}:
            return install
    return _install([lib], env, lib.how)


def discover(env: dict[str, str], site_prefixes: tuple[str, ...] = (),
             extra: tuple[str, ...] = (), ldconfig_output: str | None = None
             ) -> list[HostInstall]:
    """Every MPI install on the host, each once (by its first libmpi's real path)."""
    found: list[HostInstall] = []
    seen: set[str] = set()

    def add(install: HostInstall | None) -> None:
        if install is None:
            return
        keys = {lib.libmpi for lib in install.libs}
        if keys & seen:
            return
        seen.update(keys)
        found.append(install)

    for path in extra:
        add(install_at(path, env, f"--mpi {path}"))
    for prefix, how in install_prefixes(env, site_prefixes):
        add(install_at(prefix, env, how))
    if ldconfig_output is None:
        ldconfig_output = hostmpi.run_ldconfig(env)
    cache = hostmpi.parse_ldconfig(ldconfig_output)
    for name in abi.libmpi_names(cache):
        try:
            lib = hostmpi.identify_libmpi(cache[name])
        except (ValueError, OSError):
            continue
        add(_install([lib], env, f"ldconfig -p: {name}"))
    return found


def _matches(install: HostInstall, word: str) -> bool:
    """``word`` is an implementation, flavour or ABI family name (``mpiabi`` too)."""
    return word in (install.name, _flavour(install.libs[0]).name) or word in install.abis


def select(spec: str, installs: list[HostInstall], env: dict[str, str]) -> HostInstall:
    """The install ``spec`` names: a path, ``name`` or ``name@version`` (a version prefix
    by components: ``openmpi@5`` matches 5.0.11). UserError naming what there is."""
    if "/" in spec:
        install = install_at(spec, env, f"--mpi {spec}")
        if install is None:
            raise UserError(f"--mpi {spec}: no libmpi there",
                            "give an MPI install prefix, its lib directory, its libmpi or "
                            "its mpirun/mpiexec; `hpcai-launch mpis` lists what was found")
        return install
    word, _, version = spec.partition("@")
    wanted = version.split(".") if version else []
    matches = [i for i in installs if _matches(i, word)
               and i.version.split(".")[:len(wanted)] == wanted]
    # "mpich" also matches Intel MPI (the same ABI); its own name goes first
    matches.sort(key=lambda i: i.name != word)
    if not matches:
        there = ", ".join(i.label for i in installs) or "none"
        raise UserError(f"unknown MPI {spec!r}: no such MPI on this host (found: {there})",
                        "give one of those, a family (openmpi, mpich, intel, mpiabi) or a "
                        "path; `hpcai-launch mpis` lists them")
    return matches[0]


def render(installs: list[HostInstall]) -> str:
    """The list as a table, one line per install and ABI."""
    rows = [("MPI", "ABI", "libmpi", "launcher", "PMI", "found")]
    for i in installs:
        for n, lib in enumerate(i.libs):
            rows.append((i.label if n == 0 else "", lib.family, lib.libmpi,
                         (i.launcher or "-") if n == 0 else "",
                         ",".join(i.pmi) or "-" if n == 0 else "", i.how if n == 0 else ""))
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]) - 1)]
    return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)) + "  " + r[-1]
                     for r in rows).rstrip() + "\n"
