"""The host's MPI and fabric libraries, found, collected and staged for a read-only bind.

The image is never modified: the host libraries are staged (hard links, or copies across
file systems) in a content-addressed cache directory, which the runtime binds read-only at a
mount point such as ``/opt/hpcai/host``; the ranks find them through ``LD_LIBRARY_PATH`` and
the plugin-directory variables of :func:`binding_env`.

- :func:`find_host_mpi` looks for the host's libmpi next to the launcher, in the MPI
  environment variables (``I_MPI_ROOT``, ``MPI_HOME``, EasyBuild's ``EBROOT*``, ...), on
  ``LD_LIBRARY_PATH``, then in ``ldconfig -p``; :func:`identify_libmpi` names it from its
  soname and the version strings inside the file.
- :func:`collect` gathers the libmpi (and its own pieces), the fabric and accelerator
  libraries with their provider plugins (:data:`FABRIC_LIBS`, :data:`ACCELERATOR_LIBS`), the
  site's extra libraries, and the transitive ``DT_NEEDED`` closure of all of them, minus the
  glibc family and whatever the image already has.
- :func:`stage` makes the directory; :func:`binding_env` says how the ranks find it.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import json
import mmap
import os
import platform
import re
import shutil
import subprocess
import tempfile
from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path

from . import elf
from ..core.errors import UserError
from .site import SiteProfile

MULTIARCH = f"{platform.machine()}-linux-gnu"

ROLES = ("mpi", "fabric", "accelerator", "dependency", "site")

# glibc's own libraries: always the image's, never the host's.
GLIBC_FAMILY = frozenset({
    "libc.so.6", "libm.so.6", "libpthread.so.0", "libdl.so.2", "librt.so.1", "libutil.so.1",
    "libresolv.so.2", "ld-linux-x86-64.so.2", "ld-linux-aarch64.so.1", "ld-linux.so.2",
    "ld64.so.2", "libnsl.so.1", "libanl.so.1", "libmvec.so.1", "libthread_db.so.1",
    "libBrokenLocale.so.1", "libc_malloc_debug.so.0", "libmemusage.so", "libpcprofile.so",
})


def is_glibc_family(name: str) -> bool:
    return (name in GLIBC_FAMILY or name.startswith(("ld-linux", "libnss_", "libnsl.so",
                                                     "libanl.so")))


@dataclass(frozen=True)
class HostMpi:
    """The host's MPI library, identified from the file itself."""

    family: str             # ABI: "openmpi" | "mpich" (MPICH ABI) | "mpiabi" (MPI-5 ABI)
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


@dataclass(frozen=True)
class LibFile:
    """One file to stage: the real file and the name the loader will look for."""

    path: str               # real path of the file on the host
    name: str               # exposed name: the soname when there is one, else the basename
    role: str               # "mpi" | "fabric" | "accelerator" | "dependency" | "site"
    subdir: str = ""        # "" or a plugin directory: "libfabric", "ucx", "libibverbs", ...

    @property
    def relpath(self) -> str:
        return f"{self.subdir}/{self.name}" if self.subdir else self.name


@dataclass(frozen=True)
class PluginSpec:
    """Plugins a library loads with dlopen from a directory of its own."""

    subdir: str                       # staged as lib/<subdir>/
    dirs: tuple[str, ...]             # searched relative to the library's directory
    pattern: str                      # glob of the plugin files
    env: str = ""                     # host env var that overrides ``dirs`` (':'-separated)


@dataclass(frozen=True)
class LibSpec:
    soname: str
    role: str
    plugins: tuple[PluginSpec, ...] = ()


LIBFABRIC_PROVIDERS = PluginSpec("libfabric", ("libfabric", "prov"), "lib*-fi.so",
                                 "FI_PROVIDER_PATH")
UCX_MODULES = PluginSpec("ucx", ("ucx",), "lib*.so*")
VERBS_PROVIDERS = PluginSpec("libibverbs", ("libibverbs",), "lib*-rdmav*.so")
OPENMPI_COMPONENTS = PluginSpec("openmpi", ("openmpi", "openmpi/lib/openmpi3",
                                            "openmpi/lib/openmpi"), "mca_*.so")

FABRIC_LIBS: tuple[LibSpec, ...] = (
    LibSpec("libfabric.so.1", "fabric", (LIBFABRIC_PROVIDERS,)),
    LibSpec("libpsm2.so.2", "fabric"),
    LibSpec("libucp.so.0", "fabric"),
    LibSpec("libucs.so.0", "fabric", (UCX_MODULES,)),   # UCX looks beside libucs: ucx/
    LibSpec("libuct.so.0", "fabric"),
    LibSpec("libucm.so.0", "fabric"),
    LibSpec("libibverbs.so.1", "fabric", (VERBS_PROVIDERS,)),
    LibSpec("librdmacm.so.1", "fabric"),
)

ACCELERATOR_LIBS: tuple[LibSpec, ...] = (
    LibSpec("libnccl.so.2", "accelerator"),
    LibSpec("libcuda.so.1", "accelerator"),
    LibSpec("libnvidia-ml.so.1", "accelerator"),
)

# Open MPI's own libraries beside libmpi (4.x: ORTE/OPAL; 5.x: OPAL 80 and PRRTE).
OPENMPI_LIBS = ("libopen-rte.so.40", "libopen-pal.so.40", "libopen-pal.so.80", "libprrte.so.3")

# libmpi names, most common first; libmpi_abi.so.* (MPI-5 standard ABI) is globbed.
LIBMPI_NAMES = ("libmpi.so.40", "libmpi.so.12", "libmpich.so.12")
_FAMILY_OF_SONAME = {"libmpi.so.40": "openmpi", "libmpi.so.12": "mpich",
                     "libmpich.so.12": "mpich"}
MPI4PY_ABI = {"openmpi": "openmpi", "mpich": "mpich", "mpiabi": "mpiabi"}


# --- identifying a libmpi ----------------------------------------------------------------

_V = rb"(\d+\.\d+(?:\.\d+)*[a-z0-9]*)"
_MARKERS: tuple[tuple[str, bytes, tuple[bytes, ...]], ...] = (
    # (name, literal marker, version patterns tried in order)
    ("intel", b"Intel(R) MPI Library",
     (rb"Intel\(R\) MPI Library,? (?:Version )?(\d{4}(?:\.\d+)*(?: Update \d+)?)",
      rb"Intel\(R\) MPI Library %s for Linux\* OS\n?\x00(\d{4}\.\d+(?:\.\d+)*)\x00",
      rb"\x00(20\d\d\.\d+\.\d+)\x00")),
    ("cray-mpich", b"CRAY MPICH",
     (rb"CRAY MPICH version " + _V,)),
    ("mvapich", b"MVAPICH",
     (rb"MVAPICH2? Version:?[ \t]*" + _V, rb"MVAPICH2?[ -]" + _V)),
    ("openmpi", b"Open MPI",
     (rb"Open MPI v" + _V, rb"\x00v(\d+\.\d+\.\d+[a-z0-9]*)\x00Open MPI\x00")),
    ("mpich", b"MPICH",
     (rb"MPICH Version:[ \t]*" + _V,
      rb"\x00[A-Z][a-z]{2} [A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d [A-Z]+ \d{4}\x00" + _V + rb"\x00",
      rb"/mpich-(\d+\.\d+(?:\.\d+)?)[/=]")),
)


def _markers(path: str) -> tuple[str, str]:
    """(name, version) from the strings inside the library file."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        for name, marker, patterns in _MARKERS:
            if data.find(marker) < 0:
                continue
            for pattern in patterns:
                m = re.search(pattern, data)
                if m:
                    return name, m.group(1).decode("ascii", "replace")
            return name, "unknown"
    return "unknown", "unknown"


def _root_of(libdir: str) -> str | None:
    """Install prefix of a library directory (None for the system's own directories)."""
    parts = Path(libdir).parts
    while parts and parts[-1] in ("release", "release_mt", "debug", "debug_mt"):
        parts = parts[:-1]                       # Intel MPI: lib/release/libmpi.so.12
    if parts and parts[-1] == MULTIARCH:
        return None                              # /usr/lib/x86_64-linux-gnu
    if parts and parts[-1] in ("lib", "lib64"):
        parts = parts[:-1]
    root = str(Path(*parts)) if parts else None
    return None if root in (None, "/", "/usr", "/usr/local") else root


def identify_libmpi(path: str | os.PathLike) -> HostMpi:
    """Which MPI a libmpi file is. ValueError if it is not ELF or not recognisably MPI."""
    path = os.path.abspath(os.fspath(path))
    real = os.path.realpath(path)
    info = elf.read_elf(real)
    soname = info.soname or os.path.basename(path)
    name, version = _markers(real)
    if soname.startswith("libmpi_abi.so"):
        family = "mpiabi"
    elif name == "openmpi":
        family = "openmpi"
    elif name != "unknown":
        family = "mpich"
    elif soname in _FAMILY_OF_SONAME:
        family = _FAMILY_OF_SONAME[soname]
        name = "openmpi" if family == "openmpi" else "unknown"
    else:
        raise ValueError(f"{path}: not a known MPI library (soname {soname}, no MPI "
                         "version string inside)")
    libdir = os.path.dirname(path)
    return HostMpi(family=family, name=name, version=version, libmpi=real, soname=soname,
                   libdir=libdir, root=_root_of(libdir), how=f"identified from {path}")


# --- finding the host MPI ------------------------------------------------------------------

_MPI_ENV_VARS = ("MPI_HOME", "MPI_ROOT", "MPICH_HOME", "OPENMPI_ROOT", "OMPI_HOME",
                 "EBROOTOPENMPI", "EBROOTIMPI", "EBROOTMPICH", "CRAY_MPICH_DIR")


def _launcher_family(launcher: str) -> str | None:
    base = os.path.basename(os.path.realpath(launcher)).lower()
    if any(k in base for k in ("orterun", "prterun", "openmpi", "ompi")):
        return "openmpi"
    if any(k in base for k in ("hydra", "mpich")):
        return "mpich"
    return None


def _candidate_dirs(env: dict[str, str], launcher: str | None) -> list[tuple[str, str]]:
    """(directory, how) in search order."""
    out: list[tuple[str, str]] = []
    if launcher:
        real = Path(os.path.realpath(launcher))
        prefix = real.parent.parent
        for d in (prefix / "lib", prefix / "lib64", prefix / "lib" / MULTIARCH):
            out.append((str(d), f"next to the launcher {launcher} ({real})"))
    if env.get("I_MPI_ROOT"):
        root = Path(env["I_MPI_ROOT"])
        for sub in ("lib", "lib/release", "lib64", "intel64/lib", "intel64/lib/release"):
            out.append((str(root / sub), f"$I_MPI_ROOT/{sub}"))
    for var in _MPI_ENV_VARS:
        if env.get(var):
            root = Path(env[var])
            subs = ["lib", "lib64"]
            if var == "EBROOTIMPI":
                subs += ["mpi/latest/lib", "mpi/latest/lib/release", "intel64/lib",
                         "intel64/lib/release"]
            for sub in subs:
                out.append((str(root / sub), f"${var}/{sub}"))
    for d in env.get("LD_LIBRARY_PATH", "").split(":"):
        if d:
            out.append((d, "$LD_LIBRARY_PATH"))
    return out


def _names_for(directory: str, prefer: str | None) -> list[str]:
    names = list(LIBMPI_NAMES)
    names += sorted(os.path.basename(p) for p in glob.glob(os.path.join(directory,
                                                                        "libmpi_abi.so.*")))
    if prefer:
        names.sort(key=lambda n: _FAMILY_OF_SONAME.get(n, "mpiabi") != prefer)
    return names


def _first_libmpi(directory: str, prefer: str | None) -> HostMpi | None:
    if not os.path.isdir(directory):
        return None
    for name in _names_for(directory, prefer):
        candidate = os.path.join(directory, name)
        if os.path.isfile(candidate):
            try:
                return identify_libmpi(candidate)
            except (ValueError, OSError):
                continue
    return None


def parse_ldconfig(output: str) -> dict[str, str]:
    """``ldconfig -p`` output as {name: first path} (64-bit entries on 64-bit hosts)."""
    found: dict[str, str] = {}
    for line in output.splitlines():
        m = re.match(r"\s+(\S+)\s+\(([^)]*)\)\s+=>\s+(\S+)", line)
        if not m:
            continue
        name, tags, path = m.groups()
        if platform.machine() in ("x86_64", "aarch64") and "64" not in tags:
            continue
        found.setdefault(name, path)
    return found


def run_ldconfig(env: dict[str, str] | None = None) -> str:
    """``ldconfig -p`` output ('' when ldconfig is missing or fails)."""
    env = os.environ if env is None else env
    path = env.get("PATH", os.defpath) + ":/sbin:/usr/sbin"
    binary = shutil.which("ldconfig", path=path)
    if not binary:
        return ""
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
        launcher = shutil.which(launcher, path=env.get("PATH", os.defpath)) or launcher
    prefer = prefer or (_launcher_family(launcher) if launcher else None)
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
    abi = sorted(n for n in cache if n.startswith("libmpi_abi.so."))
    names = [*LIBMPI_NAMES, *abi]
    if prefer:
        names.sort(key=lambda n: _FAMILY_OF_SONAME.get(n, "mpiabi") != prefer)
    for name in names:
        if require and _FAMILY_OF_SONAME.get(name, "mpiabi") != require:
            continue
        if name in cache:
            try:
                return replace(identify_libmpi(cache[name]), how=f"ldconfig -p: {name}")
            except (ValueError, OSError):
                continue
    return None


# --- collecting ----------------------------------------------------------------------------

_ELF_CACHE: dict[tuple[str, int, int], elf.ElfInfo] = {}


def _read(path: str) -> elf.ElfInfo:
    st = os.stat(path)
    key = (path, st.st_size, st.st_mtime_ns)
    if key not in _ELF_CACHE:
        _ELF_CACHE[key] = elf.read_elf(path)
    return _ELF_CACHE[key]


def _header(path: str) -> tuple[int, int, int] | None:
    """(class, data, machine) of an ELF file, None if it is not one."""
    try:
        with open(path, "rb") as f:
            head = f.read(20)
    except OSError:
        return None
    if len(head) < 20 or head[:4] != elf.ELF_MAGIC:
        return None
    return head[4], head[5], int.from_bytes(head[18:20], "little")


def _find(name: str, dirs: list[str], like: tuple | None = None) -> str | None:
    """First ``dir/name`` that is an ELF file (of the same class and machine as ``like``)."""
    for d in dirs:
        candidate = os.path.join(d, name)
        if os.path.isfile(candidate):
            header = _header(candidate)
            if header and (like is None or header == like):
                return candidate
    return None


def _unique(items) -> list:
    out: list = []
    for item in items:
        if item and item not in out:
            out.append(item)
    return out


def _expand(entries: tuple[str, ...], origin: str) -> list[str]:
    out = []
    for entry in entries:
        entry = entry.replace("${ORIGIN}", origin).replace("$ORIGIN", origin)
        if "$" not in entry:
            out.append(os.path.normpath(entry))
    return out


class _Collector:
    def __init__(self, dirs: list[str], image_sonames: set[str]) -> None:
        self.dirs = dirs
        self.image = set(image_sonames)
        self.libs: list[LibFile] = []
        self.where: dict[str, str] = {}          # relpath -> the path it was found at
        self.claimed: set[str] = set()           # top-level names reserved (site libraries)

    def has(self, relpath: str) -> bool:
        return relpath in self.where

    def add(self, found: str, name: str, role: str, subdir: str = "") -> bool:
        lib = LibFile(os.path.realpath(found), name, role, subdir)
        if self.has(lib.relpath):
            return False
        self.libs.append(lib)
        self.where[lib.relpath] = found
        return True

    def add_plugins(self, spec: PluginSpec, lib_path: str, env: dict[str, str],
                    role: str) -> None:
        if spec.env and env.get(spec.env):
            dirs = [d for d in env[spec.env].split(":") if d]
        else:
            bases = _unique([os.path.dirname(lib_path),
                             os.path.dirname(os.path.realpath(lib_path))])
            dirs = [os.path.join(b, sub) for b in bases for sub in spec.dirs]
        for d in _unique(dirs):
            for candidate in sorted(glob.glob(os.path.join(d, spec.pattern))):
                if not os.path.isfile(candidate) or _header(candidate) is None:
                    continue
                self.add(candidate, _plugin_name(candidate), role, spec.subdir)

    def add_spec(self, spec: LibSpec, dirs: list[str], env: dict[str, str]) -> None:
        if spec.soname in self.claimed:
            return
        found = _find(spec.soname, dirs)
        if found and self.add(found, spec.soname, spec.role):
            for plugin in spec.plugins:
                self.add_plugins(plugin, found, env, spec.role)

    def close(self) -> None:
        """Add the transitive DT_NEEDED closure (breadth first, in file order)."""
        queue = deque(self.libs)
        while queue:
            lib = queue.popleft()
            found = self.where[lib.relpath]
            info = _read(lib.path)
            like = _header(lib.path)
            origins = _unique([os.path.dirname(found), os.path.dirname(lib.path)])
            search = [d for o in origins for d in _expand(info.search_path, o)] + self.dirs
            for needed in info.needed:
                if (is_glibc_family(needed) or needed in self.image or self.has(needed)
                        or "/" in needed):
                    continue
                path = _find(needed, _unique(search), like)
                if path and self.add(path, needed, "dependency"):
                    queue.append(self.libs[-1])


def _plugin_name(path: str) -> str:
    """The name a loader opens: the soname when a file of that name sits beside it
    (UCX: libuct_ib.so.0), else the file's own name (libmlx5-rdmav34.so, libpsmx2-fi.so)."""
    try:
        soname = _read(os.path.realpath(path)).soname
    except (ValueError, OSError):
        soname = None
    if soname and os.path.exists(os.path.join(os.path.dirname(path), soname)):
        return soname
    return os.path.basename(path)


def _intel_fabric_dirs(host: HostMpi, env: dict[str, str]) -> list[str]:
    if host.name != "intel" or env.get("I_MPI_OFI_LIBRARY_INTERNAL", "1").lower() in (
            "0", "no", "off", "false", "disable"):
        return []
    dirs = []
    if host.root:
        dirs += [os.path.join(host.root, "opt", "mpi", "libfabric", "lib"),
                 os.path.join(host.root, "libfabric", "lib")]
    dirs += [os.path.join(host.libdir, "libfabric"),
             os.path.join(os.path.dirname(host.libdir), "libfabric", "lib")]
    return [d for d in dirs if os.path.isdir(d)]


def search_path(host: HostMpi, search_dirs: list[str], site: SiteProfile | None = None,
                env: dict[str, str] | None = None) -> list[str]:
    """Where :func:`collect` looks: the MPI's libdir, Intel MPI's bundled libfabric, the
    site's search dirs, then ``search_dirs``."""
    return _unique([host.libdir, *_intel_fabric_dirs(host, env or {}),
                    *(site.search_dirs if site else ()), *search_dirs])


def collect(host: HostMpi, search_dirs: list[str], image_sonames: set[str],
            site: SiteProfile | None, *, env: dict[str, str] | None = None) -> list[LibFile]:
    """Every host library to bind, in a deterministic order.

    The libmpi (and a ``libmpi.so.12`` alias for Debian's ``libmpich.so.12``), Open MPI's own
    libraries and components, the fabric and accelerator libraries found on the search path
    with their plugins, the site's libraries, then the ``DT_NEEDED`` closure of all of them,
    resolved through each file's RUNPATH/RPATH and the search path. The closure leaves out
    the glibc family and every name in ``image_sonames``; the libraries named above are bound
    even when the image has its own (that is the point). ``env`` (the host's) is read for
    ``FI_PROVIDER_PATH`` and ``I_MPI_OFI_LIBRARY_INTERNAL`` only.
    """
    env = env or {}
    dirs = search_path(host, search_dirs, site, env)
    c = _Collector(dirs, image_sonames)
    site_libs = list(site.libraries) if site else []
    for path in site_libs:
        if not os.path.isfile(path):
            raise UserError(f"site profile {site.path or site.name} lists library {path}, "
                            "which does not exist on this host",
                            "fix the profile's 'libraries' list, or load the module that "
                            "provides it")
    site_named = [(p, _exposed_name(p)) for p in site_libs]
    c.claimed = {name for _, name in site_named}

    c.add(host.libmpi, host.soname, "mpi")
    if host.soname == "libmpich.so.12":
        c.add(host.libmpi, "libmpi.so.12", "mpi")    # what mpi4py and MPICH-ABI apps load
    if host.family == "openmpi":
        for name in OPENMPI_LIBS:
            found = _find(name, [host.libdir])
            if found:
                c.add(found, name, "mpi")
        c.add_plugins(OPENMPI_COMPONENTS, os.path.join(host.libdir, host.soname), env, "mpi")
    for spec in (*FABRIC_LIBS, *ACCELERATOR_LIBS):
        c.add_spec(spec, dirs, env)
    for path, name in site_named:
        c.add(path, name, "site")
    c.close()
    return c.libs


def _exposed_name(path: str) -> str:
    try:
        return _read(os.path.realpath(path)).soname or os.path.basename(path)
    except (ValueError, OSError):
        return os.path.basename(path)


def missing_dependencies(libs: list[LibFile], image_sonames: set[str]) -> list[tuple[str, str]]:
    """(library, needed name) pairs that neither the staged set nor the image provides."""
    provided = {lib.name for lib in libs if not lib.subdir} | set(image_sonames)
    out = []
    for lib in libs:
        for needed in _read(lib.path).needed:
            if not is_glibc_family(needed) and needed not in provided:
                out.append((lib.relpath, needed))
    return out


# --- staging -------------------------------------------------------------------------------

def stage_key(libs: list[LibFile]) -> str:
    """Content address of a library set: names, paths, sizes and mtimes."""
    rows = []
    for lib in libs:
        st = os.stat(lib.path)
        rows.append([lib.relpath, lib.path, st.st_size, st.st_mtime_ns])
    return hashlib.sha256(json.dumps(rows).encode()).hexdigest()[:20]


def stage_dir(libs: list[LibFile], cache_root: str | os.PathLike) -> Path:
    """Where :func:`stage` puts this library set (nothing is created)."""
    return Path(cache_root) / "hostlibs" / stage_key(libs)


def stage(libs: list[LibFile], cache_root: str | os.PathLike) -> Path:
    """The staged directory ``<cache_root>/hostlibs/<key>``; the libraries are in its
    ``lib/`` (plugins in ``lib/<subdir>/``), each under its exposed name.

    Files are read-only copies (mode 0444), never hard links: Charliecloud 0.31 has no
    read-only bind, and a hard link would let a write inside the container reach the host's
    real library. The directory is built under a temporary name and renamed into place, so
    it is either complete or absent; an existing one is reused. Bind the returned directory
    read-only at the mount point given to :func:`binding_env`.
    """
    final = stage_dir(libs, cache_root)
    base = final.parent
    if (final / "lib").is_dir():
        return final
    base.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".staging-", dir=base))
    try:
        os.chmod(tmp, 0o755)
        lib_dir = tmp / "lib"
        lib_dir.mkdir()
        for lib in libs:
            target = lib_dir / lib.relpath
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(lib.path, target)
            os.chmod(target, 0o444)
        try:
            os.rename(tmp, final)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not (final / "lib").is_dir():
                raise
            shutil.rmtree(tmp, ignore_errors=True)      # another process won the race
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


_VERBS_SUFFIX = re.compile(r"-rdmav\d+\.so$")


def binding_env(mount_point: str, libs: list[LibFile]) -> dict[str, str]:
    """Env (paths inside the container) for a staged set bound at ``mount_point``.

    ``LD_LIBRARY_PATH`` is only the staged ``lib``: the caller merges it with the rest.
    """
    lib = f"{mount_point.rstrip('/')}/lib"
    subdirs = {x.subdir for x in libs}
    env = {"LD_LIBRARY_PATH": lib}
    if "libfabric" in subdirs:
        env["FI_PROVIDER_PATH"] = f"{lib}/libfabric"
    if "ucx" in subdirs:
        env["UCX_MODULE_DIR"] = f"{lib}/ucx"
    verbs = [x.name for x in libs if x.subdir == "libibverbs" and _VERBS_SUFFIX.search(x.name)]
    if verbs:
        # rdma-core loads an absolute driver name as NAME-rdmavNN.so (its own suffix)
        env["RDMAV_DRIVERS"] = ":".join(f"{lib}/libibverbs/{_VERBS_SUFFIX.sub('', n)}"
                                        for n in verbs)
    if "openmpi" in subdirs:
        env["OMPI_MCA_mca_base_component_path"] = f"{lib}/openmpi"
    for x in libs:
        if x.role == "mpi" and not x.subdir:
            family = ("mpiabi" if x.name.startswith("libmpi_abi.so")
                      else _FAMILY_OF_SONAME.get(x.name))
            if family:
                env["MPI4PY_MPIABI"] = MPI4PY_ABI[family]
                break
    return env
