"""MPI ABI facts in one table: ABI families, MPI libraries, launch flavours, install places.

- :data:`FAMILIES`: what a program built against one MPI can load. Sonames, mpi4py's
  ``MPI4PY_MPIABI`` name, the ``srun --mpi=`` plugin, compat links (Debian's MPICH ships
  ``libmpich.so.12`` but no ``libmpi.so.12``), the family's other libraries and plugins,
  the words in a launcher's file name that imply it.
- :data:`IMPLEMENTATIONS`: how a libmpi file names the MPI it is (strings inside it), and
  the fabric library directories that MPI bundles.
- :data:`FLAVOURS`: the MPIs that start ranks: launcher names, ``--version`` text, how
  their launcher exports env, lists hosts, binds ranks, and runs as root.
- :data:`PMI_LIBRARIES`, :data:`PMI_MARKERS`, :data:`PMI_PLUGINS`: Slurm's PMI client
  library as an MPI loads it, and how a libmpi shows which PMI clients it speaks
  (:mod:`.pmi`, :mod:`.mpis`).
- :data:`ROOT_VARS`, :data:`SYSTEM_LIBDIRS`: where MPI installs and system libraries live
  (the multiarch directory is this machine's, :data:`MULTIARCH`).

A new flavour, family or implementation is a new record here; other modules read the
records and never branch on their names.
"""

from __future__ import annotations

import os
import sys
from fnmatch import fnmatch

from ...core.record import record

TYPE_CHECKING = False     # typing's constant, without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable, Iterable
    from ..node.placement import Placement

# sysconfig's MULTIARCH, read where the interpreter keeps it (importing sysconfig: ~1 ms)
MULTIARCH: str = (getattr(sys.implementation, "_multiarch", "")
                  or f"{os.uname().machine}-linux-gnu")

# The dynamic loader's default directories (ld.so finds libraries there without
# LD_LIBRARY_PATH), most specific first.
SYSTEM_LIBDIRS = (f"/usr/lib/{MULTIARCH}", f"/lib/{MULTIARCH}", "/usr/lib64", "/usr/lib",
                  "/lib64", "/lib")


@record
class PluginSpec:
    """Plugins a library loads with dlopen from a directory of its own."""

    subdir: str                       # staged as lib/<subdir>/
    dirs: tuple[str, ...]             # searched relative to the library's directory
    pattern: str                      # glob of the plugin files
    host_env: str = ""                # host env var that overrides ``dirs`` (':'-separated)
    staged_env: str = ""              # env var that points the ranks at lib/<subdir>/


@record
class CompatLink:
    """A soname the family's programs load, and the file an install has instead."""

    name: str                         # e.g. libmpi.so.12
    target: str                       # e.g. libmpich.so.12 (Debian's MPICH)


@record
class Family:
    """An MPI ABI: programs built against one library of it run on any other."""

    name: str                         # "openmpi" | "mpich" | "mpiabi"
    title: str                        # in messages: "<title>-ABI programs"
    sonames: tuple[str, ...]          # libmpi file names, most common first
    mpi4py_abi: str                   # MPI4PY_MPIABI
    pmi: str                          # srun --mpi= plugin
    soname_glob: str = ""             # libmpi names beyond ``sonames`` (fnmatch pattern)
    compat: tuple[CompatLink, ...] = ()
    own_libs: tuple[str, ...] = ()    # the MPI's other libraries, beside libmpi
    components: tuple[PluginSpec, ...] = ()   # its plugin directories, beside libmpi
    launcher_words: tuple[str, ...] = ()      # in a launcher's file name: this family
    side_by_side: bool = False        # ships beside another family's libmpi (one install
                                      # can serve programs of both)
    unmarked_name: str = "unknown"    # the MPI a libmpi without version strings is

    def owns(self, soname: str) -> bool:
        return soname in self.sonames or bool(self.soname_glob
                                              and fnmatch(soname, self.soname_glob))

    @property
    def described(self) -> str:
        """The family's libmpi names, for messages."""
        return " / ".join(self.sonames) or self.soname_glob.removesuffix(".*")


OPENMPI_FAMILY = Family(
    name="openmpi", title="Open MPI", sonames=("libmpi.so.40",), mpi4py_abi="openmpi",
    pmi="pmix",
    # 4.x: ORTE/OPAL; 5.x: OPAL 80 and PRRTE
    own_libs=("libopen-rte.so.40", "libopen-pal.so.40", "libopen-pal.so.80", "libprrte.so.3",
              "libmpi_cxx.so.40"),       # C++ bindings (4.x; Horovod needs them)
    components=(PluginSpec("openmpi", ("openmpi", "openmpi/lib/openmpi3",
                                       "openmpi/lib/openmpi"), "mca_*.so",
                           staged_env="OMPI_MCA_mca_base_component_path"),),
    launcher_words=("orterun", "prterun", "openmpi", "ompi"), unmarked_name="openmpi")

MPICH_FAMILY = Family(
    name="mpich", title="MPICH", sonames=("libmpi.so.12", "libmpich.so.12"),
    mpi4py_abi="mpich", pmi="pmi2",
    compat=(CompatLink("libmpi.so.12", "libmpich.so.12"),),
    launcher_words=("hydra", "mpich"))

MPIABI_FAMILY = Family(            # the MPI-5 standard ABI
    name="mpiabi", title="MPI-5", sonames=(), soname_glob="libmpi_abi.so.*",
    mpi4py_abi="mpiabi", pmi="pmix", side_by_side=True)

FAMILIES: dict[str, Family] = {f.name: f for f in (OPENMPI_FAMILY, MPICH_FAMILY,
                                                    MPIABI_FAMILY)}


def family_of_soname(soname: str) -> Family | None:
    return next((f for f in FAMILIES.values() if f.owns(soname)), None)


def family_for_pmi(pmi: str) -> Family | None:
    """The family a srun PMI plugin implies (the first in the table that uses it)."""
    return next((f for f in FAMILIES.values() if f.pmi == pmi), None)


def family_of_launcher(filename: str) -> Family | None:
    """The family a launcher's file name implies (orterun: openmpi, mpiexec.hydra: mpich)."""
    name = filename.lower()
    return next((f for f in FAMILIES.values() if any(w in name for w in f.launcher_words)),
                None)


def libmpi_names(available: Iterable[str], prefer: str | None = None) -> list[str]:
    """The libmpi names among ``available``: the fixed names in table order, then pattern
    matches sorted; with ``prefer`` (a family name), that family's first."""
    present = set(available)
    names = [n for f in FAMILIES.values() for n in f.sonames if n in present]
    names += sorted(n for n in present - set(names) if family_of_soname(n))
    if prefer:
        names.sort(key=lambda n: family_of_soname(n).name != prefer)
    return names


# --- MPI libraries, as their files name them -----------------------------------------------

_V = rb"(\d+\.\d+(?:\.\d+)*[a-z0-9]*)"


@record
class Implementation:
    """An MPI library: the literal marker inside its file, then version patterns tried in
    order; fabric directories it bundles (``{root}``: install prefix, ``{libdir}``: the
    libmpi's directory), unless ``bundled_switch`` in the host env says no."""

    name: str
    family: Family
    marker: bytes
    versions: tuple[bytes, ...]
    bundled_dirs: tuple[str, ...] = ()
    bundled_switch: str = ""


IMPLEMENTATIONS: tuple[Implementation, ...] = (      # in the order they are tried
    Implementation(
        "intel", MPICH_FAMILY, b"Intel(R) MPI Library",
        (rb"Intel\(R\) MPI Library,? (?:Version )?(\d{4}(?:\.\d+)*(?: Update \d+)?)",
         rb"Intel\(R\) MPI Library %s for Linux\* OS\n?\x00(\d{4}\.\d+(?:\.\d+)*)\x00",
         rb"\x00(20\d\d\.\d+\.\d+)\x00"),
        bundled_dirs=("{root}/opt/mpi/libfabric/lib", "{root}/libfabric/lib",
                      "{libdir}/libfabric", "{libdir}/../libfabric/lib"),
        bundled_switch="I_MPI_OFI_LIBRARY_INTERNAL"),
    Implementation("cray-mpich", MPICH_FAMILY, b"CRAY MPICH", (rb"CRAY MPICH version " + _V,)),
    Implementation("mvapich", MPICH_FAMILY, b"MVAPICH",
                   (rb"MVAPICH2? Version:?[ \t]*" + _V, rb"MVAPICH2?[ -]" + _V)),
    Implementation("openmpi", OPENMPI_FAMILY, b"Open MPI",
                   (rb"Open MPI v" + _V, rb"\x00v(\d+\.\d+\.\d+[a-z0-9]*)\x00Open MPI\x00")),
    Implementation(
        "mpich", MPICH_FAMILY, b"MPICH",
        (rb"MPICH Version:[ \t]*" + _V,
         rb"\x00[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d [A-Z]+ \d{4}\x00" + _V
         + rb"\x00",
         rb"/mpich-(\d+\.\d+(?:\.\d+)?)[/=]")),
)


def implementation(name: str) -> Implementation | None:
    return next((i for i in IMPLEMENTATIONS if i.name == name), None)


@record
class RootVar:
    """An env var naming an MPI install prefix, and where its libmpi may be below it."""

    var: str
    subdirs: tuple[str, ...] = ("lib", "lib64")


_INTEL_SUBDIRS = ("intel64/lib", "intel64/lib/release")
ROOT_VARS: tuple[RootVar, ...] = (                   # in search order
    RootVar("I_MPI_ROOT", ("lib", "lib/release", "lib64", *_INTEL_SUBDIRS)),
    *map(RootVar, ("MPI_HOME", "MPI_ROOT", "MPICH_HOME", "OPENMPI_ROOT", "OMPI_HOME",
                   "EBROOTOPENMPI")),
    RootVar("EBROOTIMPI", ("lib", "lib64", "mpi/latest/lib", "mpi/latest/lib/release",
                           *_INTEL_SUBDIRS)),
    *map(RootVar, ("EBROOTMPICH", "CRAY_MPICH_DIR")),
)


# --- srun's PMI ----------------------------------------------------------------------------

@record
class PmiLibrary:
    """Slurm's PMI client library, as one MPI implementation loads it."""

    implementation: str             # Implementation / flavour name: "intel"
    title: str                      # in messages
    plugin: str                     # the srun --mpi= plugin it is the client of
    env_var: str                    # where that MPI reads the library's path
    sonames: tuple[str, ...]        # Slurm's file names, most specific first


PMI_LIBRARIES: tuple[PmiLibrary, ...] = (
    PmiLibrary("intel", "Intel MPI", "pmi2", "I_MPI_PMI_LIBRARY",
               ("libpmi2.so.0", "libpmi2.so")),
)


# Strings in a libmpi that show which PMI clients it speaks (the srun --mpi= plugin name).
PMI_MARKERS: tuple[tuple[bytes, str], ...] = (
    (b"PMIx_Init", "pmix"), (b"PMI2_Init", "pmi2"), (b"PMI_KVS_Put", "pmi1"))
# Open MPI 4 speaks PMIx through a plugin of its own: the file shows it.
PMI_PLUGINS: tuple[tuple[str, str], ...] = (("mca_pmix_ext*.so", "pmix"),
                                            ("mca_pmix_pmix*.so", "pmix"))


# --- launch flavours -----------------------------------------------------------------------

def _no_args(p: Placement) -> list[str]:
    return []


def _no_env(p: Placement) -> dict[str, str]:
    return {}


@record
class Flavour:
    """An MPI that starts ranks: what differs between them, as data."""

    name: str
    title: str
    abi: Family
    launchers: tuple[str, ...]        # candidate launcher names, most specific first
    version_pattern: str              # regex on `launcher --version` output
    export_env: tuple[str, ...]       # argv template per exported variable
    hosts_style: str                  # "slots" (h:n,...) or "ppn" (-hosts h,... -ppn n)
    binding_args: Callable[[Placement], list[str]] = _no_args   # launcher's binding flags
    binding_env: Callable[[Placement], dict[str, str]] = _no_env  # ... or env that binds
    root_flags: tuple[str, ...] = ()  # launcher flags needed when running as root
    root_var: str = ""                # env var of the install prefix (launchers in its bin/)
    detect_first: bool = False        # its --version text matches others' patterns too
    stop_signal: str = ""             # the signal its launcher passes on to the ranks when
                                      # a job is to stop (checkpoint, exit), where SIGTERM
                                      # is not: hpcai-launch relays SIGTERM as this one
    keep_env_flags: tuple[str, ...] = ()   # launcher flags that keep the ranks' PATH and
                                      # LD_LIBRARY_PATH the user's (Open MPI started by its
                                      # path acts as if given --prefix and puts that
                                      # install's bin/ and lib/ first: /usr/bin for apt's)

    @property
    def family(self) -> str:
        return self.abi.name

    @property
    def srun_mpi(self) -> str:
        return self.abi.pmi

    def env_args(self, env: dict[str, str]) -> list[str]:
        args: list[str] = []
        for key in sorted(env):
            args.extend(t.format(key=key, value=env[key]) for t in self.export_env)
        return args


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


def intel_binding_env(p: Placement) -> dict[str, str]:
    if p.oversubscribed:
        return {"I_MPI_PIN": "0"}
    masks = ",".join(s.mask for s in p.slots)
    return {"I_MPI_PIN": "1", "I_MPI_PIN_DOMAIN": f"[{masks}]"}


OPENMPI = Flavour(
    name="openmpi", title="Open MPI", abi=OPENMPI_FAMILY,
    launchers=("mpirun.openmpi", "mpirun", "mpiexec.openmpi", "mpiexec"),
    version_pattern=r"Open MPI|OpenRTE|Open RTE",
    export_env=("-x", "{key}={value}"), hosts_style="slots",
    binding_args=openmpi_binding, root_flags=("--allow-run-as-root",),
    # mpirun 4.1 and 5.0 end the ranks themselves within about 2 s of a SIGTERM, before a
    # step and its checkpoint can finish; SIGUSR1 they pass on (tests/test_signals.py)
    stop_signal="SIGUSR1", keep_env_flags=("--noprefix",))

MPICH = Flavour(
    name="mpich", title="MPICH", abi=MPICH_FAMILY,
    launchers=("mpiexec.mpich", "mpirun.mpich", "mpiexec.hydra", "mpiexec", "mpirun"),
    version_pattern=r"HYDRA|MPICH",
    export_env=("-genv", "{key}", "{value}"), hosts_style="ppn",
    binding_args=mpich_binding)

INTEL = Flavour(
    name="intel", title="Intel MPI", abi=MPICH_FAMILY,
    launchers=("mpiexec.hydra", "mpiexec", "mpirun"),
    version_pattern=r"Intel\(R\) MPI",
    export_env=("-genv", "{key}", "{value}"), hosts_style="ppn",
    binding_env=intel_binding_env, root_var="I_MPI_ROOT",
    detect_first=True)                # its hydra also says HYDRA

FLAVOURS: dict[str, Flavour] = {f.name: f for f in (OPENMPI, MPICH, INTEL)}
GENERIC_LAUNCHERS = ("mpirun", "mpiexec")   # looked for when no flavour is asked for
