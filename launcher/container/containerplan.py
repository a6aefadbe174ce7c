"""Containers in the launch plan: gather the facts once (impure), then pure functions.

``gather`` runs the pre-flight checks in order - runtime installed, image and its mount point
present, host MPI found, ABI families equal, every bound library's glibc needs met by the
image, the PMI plugin available in srun - then stages the host libraries (read-only copies
in a content-addressed cache directory, bound read-only at ``/opt/hpcai/host``). The outer
hpcai-launch does this once and hands the staged directory to the ranks (``--host-libs``).
``spec`` refuses a read-only bind that the runtime cannot make read-only (Charliecloud with
an image that lacks the helper of :mod:`.readonly`).

The host's NVIDIA driver (``--gpu-driver auto|on|off``; auto: when :func:`.nvdriver.gather`
finds one) is checked by :func:`.preflight.check_gpu_driver` and staged with the other host
libraries (:func:`.hostlibs.driver_files`), also when no host MPI is bound; ``spec`` binds
its ``/dev/nvidia*`` nodes where the runtime does not bind the host's ``/dev``. The driver is
read under ``driver_root`` (``/``; ``HPCAI_DRIVER_ROOT`` in the tests' fake driver trees).
"""

from __future__ import annotations

import os
import pwd
from dataclasses import dataclass, field
from pathlib import Path

from ..mpi import abi, hostmpi, mpis
from . import consumers, containers, hostlibs, matrix, nvdriver, preflight
from .containers import CACHE_MOUNT, FLOPS_MOUNT, HOST_MOUNT, WORK_MOUNT, Bind, ContainerSpec
from ...core.errors import UserError
from ..job.site import SiteProfile
from ..mpi import pmi


@dataclass(frozen=True)
class ContainerFacts:
    runtime: str
    binary: str
    image: str
    image_info: object | None
    host_mpi: object | None              # hostmpi.HostMpi
    staged: str | None                   # host directory bound at HOST_MOUNT
    libs: tuple = ()                     # hostlibs.LibFile, for the plan's display
    site: SiteProfile | None = None
    checks: tuple[str, ...] = field(default=())
    has_command: bool = True             # the command exists in the image (or cannot tell)
    has_helper: bool = True              # the runtime's read-only helper too (or cannot tell)
    copied: bool = True                  # False: --dry-run, ``staged`` not made
    runtime_env: tuple[tuple[str, str], ...] = ()   # what the runtime needs and the job's
                                                    # environment lacks (USER, from the uid)
    driver: nvdriver.Driver | None = None   # the host's NVIDIA driver, when it is bound
    driver_root: str = "/"                  # where ``driver``'s files are on this host
    driver_why: str = ""                    # why it is bound (or why not, with a driver)
    flop_cache: str | None = None           # host directory bound read-write at FLOPS_MOUNT

    def device_binds(self) -> tuple[Bind, ...]:
        """The driver's /dev/nvidia* nodes, where the runtime does not bind the host's /dev
        (read-write: a GPU is opened for writing)."""
        if self.driver is None or containers.get_runtime(self.runtime).binds_host_dev:
            return ()
        root = Path(self.driver_root)
        return tuple(Bind(str(root / dev.lstrip("/")), dev, read_only=False)
                     for dev in self.driver.devices)

    def to_dict(self) -> dict:
        host = self.host_mpi
        out = {
            "runtime": self.runtime, "binary": self.binary, "image": self.image,
            "host_mpi": None if host is None else {
                "family": host.family, "name": host.name, "version": host.version,
                "libmpi": host.libmpi},
            "staged_host_libs": self.staged,
            "bound_libraries": [f"{lib.name} <- {lib.path}" for lib in self.libs],
            "checks": list(self.checks),
            "flop_cache": self.flop_cache,
        }
        if self.driver is not None:
            out["gpu_driver"] = {**self.driver.to_dict(), "why": self.driver_why,
                                 "device_binds": [f"{b.source}:{b.target}"
                                                  for b in self.device_binds()]}
        return out


_FROM_THE_UID = {"USER": lambda: pwd.getpwuid(os.getuid()).pw_name}


def runtime_env(runtime: str, env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    """The variables ``runtime`` needs and ``env`` lacks (a job without ``USER``, which
    ch-run refuses), taken from the uid."""
    return tuple((name, _FROM_THE_UID[name]())
                 for name in containers.get_runtime(runtime).needs_env if not env.get(name))


def gather(*, runtime: str, image: str, bind_host_mpi: bool | None, host_libs: str | None,
           site: SiteProfile | None, env: dict[str, str], launcher: str | None,
           srun_pmi: str | None, cache_dir: str, in_rank: bool,
           family: str | None = None, command: str | None = None,
           stage: bool = True, argv: tuple[str, ...] = (), gpu_driver: str = "auto",
           driver_root: str = "/") -> ContainerFacts:
    """All container facts, checked. Raises UserError on the first problem. ``stage``:
    copy the host libraries into the cache (False for ``--dry-run``: only name the place).
    ``argv`` (the command) says which of the image's MPI consumers it uses (:mod:`.matrix`).
    ``gpu_driver``/``driver_root``: whether and from where the NVIDIA driver is bound."""
    checks: list[str] = []
    needs = runtime_env(runtime, env)
    binary = containers.find_binary(containers.get_runtime(runtime), env.get("PATH"))
    checks.append(f"runtime {runtime}: {binary}")
    preflight.check_image(image, HOST_MOUNT)
    info = preflight.read_image(image)
    checks.append(f"image {image}: {info.kind}, MPI {info.mpi_family or 'none'} "
                  f"({info.mpi_soname or '-'}), glibc {preflight.format_version(info.glibc)}")
    found = image_has_command(image, command) if command else True
    helper = containers.get_runtime(runtime).read_only_helper
    has_helper = image_has_module(image, helper) if helper else False
    flops = flop_cache(image, info.kind, cache_dir, stage)
    checks.append(f"FLOP counts: host {flops} bound at {FLOPS_MOUNT}" if flops else
                  f"FLOP counts: counted at every start (no mount point {FLOPS_MOUNT} "
                  f"known in the {info.kind} image)")
    if host_libs:                       # the outer hpcai-launch staged them already
        if not Path(host_libs).is_dir():
            raise UserError(f"--host-libs {host_libs} does not exist",
                            "let hpcai-launch start the ranks, or leave --host-libs out")
        driver, why = choose_driver(gpu_driver, driver_root)
        return ContainerFacts(runtime, binary, image, info, None, host_libs,
                              tuple(staged_libs(Path(host_libs))), site, tuple(checks),
                              has_command=found, has_helper=has_helper, runtime_env=needs,
                              driver=driver, driver_root=driver_root, driver_why=why,
                              flop_cache=flops)
    driver, why = choose_driver(gpu_driver, driver_root)
    driver_libs: list | None = [] if gpu_driver != "off" else None
    if driver is not None:
        checks.append(f"GPU driver: {why}")
        checks.extend(f"GPU driver: {note}" for note in
                      preflight.check_gpu_driver(driver, image))
        driver_libs, left_out = hostlibs.driver_files(driver)
        checks.extend(f"GPU driver: {note}" for note in left_out)
    gpu = dict(driver=driver, driver_root=driver_root, driver_why=why)
    if family is None and launcher is None:   # a rank started by srun: its PMI tells
        implied = abi.family_for_pmi(env.get("SLURM_MPI_TYPE", ""))
        family = implied.name if implied else None
    host = hostmpi.find_host_mpi(env, launcher, require=family)
    if bind_host_mpi is False or (bind_host_mpi is None and host is None):
        checks.append("host MPI not bound" + ("" if host else ": none found"))
        staged, libs = None, []
        if driver is not None:        # the driver (and the site's NCCL) alone
            libs = hostlibs.collect(None, _search_dirs(env), set(info.sonames), site,
                                    driver=driver_libs)
            if info.glibc:
                preflight.check_glibc(libs, info.glibc)
            cache = Path(cache_dir).expanduser()
            staged = str(hostlibs.stage(libs, cache) if stage
                         else hostlibs.stage_dir(libs, cache))
        return ContainerFacts(runtime, binary, image, info, host, staged,
                              tuple(libs), site, tuple(checks), has_command=found,
                              has_helper=has_helper, copied=stage, runtime_env=needs,
                              flop_cache=flops, **gpu)
    if host is None:
        raise UserError("--bind-host-mpi, but no host MPI was found",
                        "load the MPI module, set MPI_HOME or I_MPI_ROOT, or pass --mpirun")
    checks.append(f"host MPI: {host.name} {host.version} ({host.libmpi}, {host.how})")
    needed = matrix.required(consumers.inspect(image) or [], argv)
    if needed:
        host = _decide(host, needed, image, env, site, checks)
    elif host.family in info.abis:
        checks.append(f"ABI: host {host.family} is one the image's programs use "
                      f"({', '.join(info.abis)})")
    else:
        preflight.check_abi(host, info.mpi_family, info.mpi_soname)
        checks.append(f"ABI: host {host.family} = image {info.mpi_family or 'none'}")
    search = _search_dirs(env)
    libs = hostlibs.collect(host, search, set(info.sonames), site, driver=driver_libs)
    plugin = srun_pmi or (pmi.step_plugin(env) if in_rank else None)
    libs += _pmi_library(host.name, plugin, env, site, checks)
    if info.glibc:
        preflight.check_glibc(libs, info.glibc)
        checks.append(f"glibc: {len(libs)} bound libraries need at most the image's "
                      f"{preflight.format_version(info.glibc)}")
    if srun_pmi and not in_rank:
        pmi.check(srun_pmi, pmi.srun_list(env))
        checks.append(f"srun --mpi={srun_pmi} available")
    cache = Path(cache_dir).expanduser()
    staged = str(hostlibs.stage(libs, cache) if stage else hostlibs.stage_dir(libs, cache))
    return ContainerFacts(runtime, binary, image, info, host, staged, tuple(libs), site,
                          tuple(checks), has_command=found, has_helper=has_helper,
                          copied=stage, runtime_env=needs, flop_cache=flops, **gpu)


def flop_cache(image: str, kind: str, cache_dir: str, make: bool) -> str | None:
    """The host directory of FLOP counts (``<cache>/flops``, made when ``make``) to bind at
    ``FLOPS_MOUNT``, so that ranks in the container count a model once, as bare ranks do;
    None where the image cannot take the bind (a directory image without the mount point;
    a SquashFS image, which cannot be looked into cheaply). Apptainer makes the mount point."""
    if kind == "squash" or (kind == "dir"
                            and not (Path(image) / FLOPS_MOUNT.lstrip("/")).is_dir()):
        return None
    path = Path(cache_dir).expanduser() / "flops"
    if make:
        path.mkdir(parents=True, exist_ok=True)
    return str(path)


def choose_driver(gpu_driver: str, root: str) -> tuple[nvdriver.Driver | None, str]:
    """The driver to bind (None: none) and why. ``on`` without a driver is a UserError."""
    if gpu_driver == "off":
        return None, "--gpu-driver off"
    driver = nvdriver.gather(root)
    where = "" if root == "/" else f" under {root}"
    if not driver.present:
        if gpu_driver == "on":
            raise UserError(f"--gpu-driver on, but this host has no NVIDIA driver{where} (no "
                            "/proc/driver/nvidia/version, no libcuda.so.<version> in "
                            f"{', '.join('/' + d for d in nvdriver.LIB_DIRS[:3])})",
                            "run on a GPU node, load the driver, or leave out --gpu-driver")
        return None, ""
    how = "--gpu-driver on" if gpu_driver == "on" else "--gpu-driver auto: the host has one"
    module = driver.module_version or "not loaded"
    return driver, (f"{how}{where}; kernel module {module}, {len(driver.libs)} compute "
                    f"libraries, {len(driver.devices)} device node(s)")


def _decide(host, needed: list, image: str, env: dict[str, str], site: SiteProfile | None,
            checks: list[str]):
    """The ABI matrix's cells for the consumers the command uses, on the host install; the
    host library to bind (the install's library of the ABI the consumers need: MPICH 5's
    ``libmpi_abi.so`` for a standard-ABI mpi4py). UserError, naming the host MPIs that
    would work, when one is refused."""
    install = mpis.install_of(host, env)
    try:
        cells = matrix.check(install, needed, image, [install])
    except UserError:
        others = mpis.discover(env, site.mpi_prefixes if site else ())
        matrix.check(install, needed, image, others)
        raise
    for cell in cells:
        checks.append(f"ABI: host {cell.lib.family} runs the image's {cell.consumer}: "
                      f"{cell.text}")
    return next((c.lib for c in cells if c.lib.family != host.family), host)


def _pmi_library(implementation: str, plugin: str | None, env: dict[str, str],
                 site: SiteProfile | None, checks: list[str]) -> list:
    """Slurm's PMI client library, when the host MPI loads one under ``plugin`` (Intel MPI
    under pmi2): staged in ``lib/pmi/`` with the rest, read-only."""
    lib = pmi.library_for(implementation, plugin)
    if lib is None:
        return []
    path = pmi.find_library(lib, env, site)
    if path is None:
        checks.append(f"PMI: {pmi.not_found(lib, env, site)}")
        return []
    checks.append(f"PMI: {lib.title} under srun --mpi={plugin} loads {path} "
                  f"({lib.env_var})")
    return [hostlibs.LibFile(os.path.realpath(path), lib.sonames[0], "pmi", pmi.PMI_SUBDIR)]


def _search_dirs(env: dict[str, str]) -> list[str]:
    """Beyond what ``hostlibs.collect`` adds itself (the MPI's libdir, the site's dirs)."""
    return [*(d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d), *abi.SYSTEM_LIBDIRS]


def spec(facts: ContainerFacts, extra_binds: tuple[str, ...], cwd: str,
         env: dict[str, str]) -> ContainerSpec:
    """The container for every rank (pure). UserError if a read-only bind cannot be made
    read-only (see :func:`check_read_only`)."""
    binds: list[Bind] = []
    if facts.staged:
        binds.append(Bind(facts.staged, HOST_MOUNT, read_only=True))
    binds.append(Bind(cwd, WORK_MOUNT, read_only=False))
    if facts.flop_cache:
        binds.append(Bind(facts.flop_cache, FLOPS_MOUNT, read_only=False))
    binds.extend(facts.device_binds())
    for text in facts.site.binds if facts.site else ():
        binds.append(parse_bind(text, read_only_default=True))    # site: host trees
    for text in extra_binds:
        binds.append(parse_bind(text, read_only_default=False))   # user: data, output
    check_read_only(facts, binds)
    return ContainerSpec(runtime=facts.runtime, binary=facts.binary, image=facts.image,
                         binds=tuple(binds), workdir=WORK_MOUNT,
                         env=tuple(sorted(container_env(facts, env).items())))


def check_read_only(facts: ContainerFacts, binds: list[Bind]) -> None:
    """Refuse read-only binds that the runtime cannot make read-only (no ``:ro`` of its
    own, and its helper is not in the image): never drop ``:ro`` silently."""
    read_only = [b.target for b in binds if b.read_only]
    rt = containers.get_runtime(facts.runtime)
    if not read_only or rt.read_only_suffix or facts.has_helper:
        return
    what = (f"image {facts.image} has no python3 with {rt.read_only_helper}"
            if rt.read_only_helper else "it has no read-only bind")
    raise UserError(f"{rt.name} binds read-write, and {what} to make {', '.join(read_only)} "
                    "read-only",
                    "rebuild the image with charliecloud/build-image.sh (it installs hpcai), "
                    "or bind them read-write: SRC:DST:rw in --bind and the site profile, "
                    "--no-bind-host-mpi for the host libraries" + (
                        " and --gpu-driver off for the GPU driver" if facts.driver else ""))


def parse_bind(text: str, read_only_default: bool) -> Bind:
    """``SRC[:DST[:ro|rw]]`` -> Bind (DST defaults to SRC)."""
    parts = text.split(":")
    mode = parts.pop() if len(parts) > 1 and parts[-1] in ("ro", "rw") else None
    if not parts[0] or len(parts) > 2:
        raise UserError(f"bad bind {text!r}", "write SRC, SRC:DST or SRC:DST:ro")
    source = parts[0]
    target = parts[1] if len(parts) == 2 and parts[1] else source
    read_only = read_only_default if mode is None else mode == "ro"
    return Bind(source, target, read_only)


def container_env(facts: ContainerFacts, env: dict[str, str]) -> dict[str, str]:
    """Env that points the ranks at the bound host libraries (paths inside the container),
    with the site's and what the runtime needs (``ContainerFacts.runtime_env``)."""
    out: dict[str, str] = dict(facts.runtime_env)
    if facts.flop_cache:
        out["HPCAI_CACHE"] = CACHE_MOUNT   # of which only flops/ is bound (read-write)
    if facts.site:
        out.update(facts.site.env)
    if not facts.staged:
        return out
    bound = hostlibs.binding_env(HOST_MOUNT, list(facts.libs))
    bound.update(pmi.staged_env(f"{HOST_MOUNT}/lib", [(x.subdir, x.name) for x in facts.libs]))
    current = env.get("LD_LIBRARY_PATH", "")
    if current:
        bound["LD_LIBRARY_PATH"] = f"{bound['LD_LIBRARY_PATH']}:{current}"
    out.update(bound)
    return out


def staged_libs(staged: Path) -> list:
    """The LibFiles of a directory staged by the outer launcher (``--host-libs``)."""
    lib = staged / "lib"
    found = []
    for path in sorted(lib.rglob("*")):
        if path.is_file() and not path.is_symlink():      # links: a driver's sonames
            rel = path.relative_to(lib)
            subdir = str(rel.parent) if str(rel.parent) != "." else ""
            role = "mpi" if not subdir and abi.family_of_soname(path.name) else "dependency"
            found.append(hostlibs.LibFile(str(path), path.name, role, subdir))
    return found


def image_has_module(image: str, module: str) -> bool:
    """For directory images: has the image a ``python3`` and ``module`` in one of its
    system Python directories?"""
    root = Path(image)
    if not root.is_dir():
        return True   # SquashFS/SIF: cannot look inside cheaply; the helper will say
    rel = module.replace(".", "/") + ".py"
    return image_has_command(image, "python3") and any(
        any(root.glob(f"{lib}/python3*/*-packages/{rel}")) for lib in ("usr/lib", "usr/local/lib"))


def image_has_command(image: str, command: str) -> bool:
    """For directory images: is ``command`` on the image's default PATH (or a file)?"""
    root = Path(image)
    if not root.is_dir():
        return True   # SquashFS/SIF: cannot look inside cheaply; the runtime will say
    if command.startswith("/"):
        return (root / command.lstrip("/")).exists()
    return any(os.access(root / d.lstrip("/") / command, os.X_OK)
               for d in ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin",
                         "/sbin", "/bin"))
