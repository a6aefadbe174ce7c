"""The host's MPI, fabric and accelerator libraries, collected and staged for a read-only
bind into a container.

The image is never modified: the host libraries are staged as read-only copies in a
content-addressed cache directory, which the runtime binds read-only at a mount point such
as ``/opt/hpcai/host``; the ranks find them through ``LD_LIBRARY_PATH`` and the
plugin-directory variables of :func:`binding_env`. Finding the host MPI is
:mod:`.hostmpi`'s.

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
import os
import re
import shutil
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path

from ..mpi import abi, elf
from ...core.errors import UserError
from ..mpi.abi import PluginSpec
from ..mpi.hostmpi import HostMpi
from ..job.site import SiteProfile

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
class LibSpec:
    soname: str
    role: str
    plugins: tuple[PluginSpec, ...] = ()


LIBFABRIC_PROVIDERS = PluginSpec("libfabric", ("libfabric", "prov"), "lib*-fi.so",
                                 host_env="FI_PROVIDER_PATH", staged_env="FI_PROVIDER_PATH")
UCX_MODULES = PluginSpec("ucx", ("ucx",), "lib*.so*", staged_env="UCX_MODULE_DIR")
VERBS_PROVIDERS = PluginSpec("libibverbs", ("libibverbs",), "lib*-rdmav*.so")

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


# --- collecting ----------------------------------------------------------------------------

def _find(name: str, dirs: list[str], like: tuple | None = None) -> str | None:
    """First ``dir/name`` that is an ELF file (of the same class and machine as ``like``)."""
    for d in dirs:
        candidate = os.path.join(d, name)
        if os.path.isfile(candidate):
            header = elf.ident(candidate)
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
        if spec.host_env and env.get(spec.host_env):
            dirs = [d for d in env[spec.host_env].split(":") if d]
        else:
            bases = _unique([os.path.dirname(lib_path),
                             os.path.dirname(os.path.realpath(lib_path))])
            dirs = [os.path.join(b, sub) for b in bases for sub in spec.dirs]
        for d in _unique(dirs):
            for candidate in sorted(glob.glob(os.path.join(d, spec.pattern))):
                if not os.path.isfile(candidate) or elf.ident(candidate) is None:
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
        """Add the transitive DT_NEEDED closure (breadth first, in file order): what a file's
        own RUNPATH/RPATH finds, and what the image lacks from the search path."""
        queue = deque(self.libs)
        while queue:
            lib = queue.popleft()
            found = self.where[lib.relpath]
            info = elf.read_elf(lib.path)
            like = elf.ident(lib.path)
            origins = _unique([os.path.dirname(found), os.path.dirname(lib.path)])
            own = _unique([d for o in origins for d in _expand(info.search_path, o)])
            for needed in info.needed:
                if is_glibc_family(needed) or self.has(needed) or "/" in needed:
                    continue
                # the file's own RUNPATH wins even over the image's copy (Open MPI 5's
                # private libpmix.so.2 beside the image's 4.1 one)
                path = _find(needed, own, like)
                if path is None and needed not in self.image:
                    path = _find(needed, _unique(own + self.dirs), like)
                if path and self.add(path, needed, "dependency"):
                    queue.append(self.libs[-1])


def _plugin_name(path: str) -> str:
    """The name a loader opens: the soname when a file of that name sits beside it
    (UCX: libuct_ib.so.0), else the file's own name (libmlx5-rdmav34.so, libpsmx2-fi.so)."""
    try:
        soname = elf.read_elf(os.path.realpath(path)).soname
    except (ValueError, OSError):
        soname = None
    if soname and os.path.exists(os.path.join(os.path.dirname(path), soname)):
        return soname
    return os.path.basename(path)


def _bundled_dirs(host: HostMpi, env: dict[str, str]) -> list[str]:
    """Fabric library directories the host's MPI ships (Intel MPI's libfabric), unless its
    switch in the host env says no."""
    impl = abi.implementation(host.name)
    if impl is None or not impl.bundled_dirs or env.get(impl.bundled_switch, "1").lower() in (
            "0", "no", "off", "false", "disable"):
        return []
    dirs = [os.path.normpath(d.format(root=host.root, libdir=host.libdir))
            for d in impl.bundled_dirs if host.root or "{root}" not in d]
    return [d for d in dirs if os.path.isdir(d)]


def search_path(host: HostMpi, search_dirs: list[str], site: SiteProfile | None = None,
                env: dict[str, str] | None = None) -> list[str]:
    """Where :func:`collect` looks: the MPI's libdir, the libmpi's own RUNPATH/RPATH (the
    libfabric and UCX that MPICH and Open MPI wheels load from ``$ORIGIN/mpich``), the
    fabric libraries it bundles (Intel MPI's libfabric), the site's search dirs, then
    ``search_dirs``."""
    try:
        own = _expand(elf.read_elf(host.libmpi).search_path, os.path.dirname(host.libmpi))
    except (ValueError, OSError):
        own = []
    return _unique([host.libdir, *own, *_bundled_dirs(host, env or {}),
                    *(site.search_dirs if site else ()), *search_dirs])


def collect(host: HostMpi, search_dirs: list[str], image_sonames: set[str],
            site: SiteProfile | None, *, env: dict[str, str] | None = None) -> list[LibFile]:
    """Every host library to bind, in a deterministic order.

    The libmpi (and its family's compat names: ``libmpi.so.12`` for Debian's
    ``libmpich.so.12``), the family's own libraries and components (Open MPI's), the fabric
    and accelerator libraries found on the search path with their plugins, the site's
    libraries, then the ``DT_NEEDED`` closure of all of them,
    resolved through each file's RUNPATH/RPATH and the search path. The closure leaves out
    the glibc family and every name in ``image_sonames``; the libraries named above are bound
    even when the image has its own (that is the point). ``env`` (the host's) is read for
    ``FI_PROVIDER_PATH`` and the bundled-fabric switch (``I_MPI_OFI_LIBRARY_INTERNAL``) only.
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

    family = abi.FAMILIES[host.family]
    c.add(host.libmpi, host.soname, "mpi")
    for link in family.compat:       # the name mpi4py and the family's programs load
        if host.soname == link.target:
            c.add(host.libmpi, link.name, "mpi")
    for name in family.own_libs:
        found = _find(name, [host.libdir])
        if found:
            c.add(found, name, "mpi")
    for spec in family.components:
        c.add_plugins(spec, os.path.join(host.libdir, host.soname), env, "mpi")
    for spec in (*FABRIC_LIBS, *ACCELERATOR_LIBS):
        c.add_spec(spec, dirs, env)
    for path, name in site_named:
        c.add(path, name, "site")
    c.close()
    return c.libs


def _exposed_name(path: str) -> str:
    try:
        return elf.read_elf(os.path.realpath(path)).soname or os.path.basename(path)
    except (ValueError, OSError):
        return os.path.basename(path)


def missing_dependencies(libs: list[LibFile], image_sonames: set[str]) -> list[tuple[str, str]]:
    """(library, needed name) pairs that neither the staged set nor the image provides."""
    provided = {lib.name for lib in libs if not lib.subdir} | set(image_sonames)
    out = []
    for lib in libs:
        for needed in elf.read_elf(lib.path).needed:
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

    Files are copies (mode 0444), never hard links: a hard link would share its inode with
    the host's real library, so a write to the cache would reach it. The directory is built
    under a temporary name and renamed into place, so it is either complete or absent; an
    existing one is reused. Bind the returned directory read-only at the mount point given
    to :func:`binding_env` (mode 0444 does not stop the owner, who may chmod, nor root: the
    bind itself must be read-only, see :mod:`.containers`).
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
    specs = [*(p for s in (*FABRIC_LIBS, *ACCELERATOR_LIBS) for p in s.plugins),
             *(c for f in abi.FAMILIES.values() for c in f.components)]
    for spec in specs:
        if spec.staged_env and spec.subdir in subdirs:
            env[spec.staged_env] = f"{lib}/{spec.subdir}"
    verbs = [x.name for x in libs if x.subdir == "libibverbs" and _VERBS_SUFFIX.search(x.name)]
    if verbs:
        # rdma-core loads an absolute driver name as NAME-rdmavNN.so (its own suffix)
        env["RDMAV_DRIVERS"] = ":".join(f"{lib}/libibverbs/{_VERBS_SUFFIX.sub('', n)}"
                                        for n in verbs)
    for x in libs:
        family = abi.family_of_soname(x.name) if x.role == "mpi" and not x.subdir else None
        if family:
            env["MPI4PY_MPIABI"] = family.mpi4py_abi
            break
    return env
