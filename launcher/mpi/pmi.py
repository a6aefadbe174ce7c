"""srun's PMI plugin: which one a job needs, whether this Slurm has it, and the PMI client
library an MPI may have to be pointed at.

Without the right ``--mpi=`` plugin srun starts N silent singletons, each "rank 0 of 1".
:func:`choose` is the one rule (an explicit choice, then the site profile, then the MPI
flavour's plugin from :mod:`.abi`); :func:`check` compares it with what
``srun --mpi=list`` offers, before any rank starts; :func:`step_mismatch` compares it with
the plugin srun really used for a rank (:func:`step_plugin`), before the program runs.

Some MPIs talk to Slurm's PMI through Slurm's own client library, named in their env
(:data:`.abi.PMI_LIBRARIES`: Intel MPI reads ``I_MPI_PMI_LIBRARY``). :func:`client` finds
that library on the host (:func:`find_library`) and says which env names it, or why none does;
a container gets a staged copy under ``lib/pmi/`` of the host library directory
(:func:`staged_env`).
"""

from __future__ import annotations

import os
import re
from ...core.record import record

from ...core.paths import which
from ...core.errors import UserError
from . import abi
from ..job.site import SiteProfile

PMI_SUBDIR = "pmi"      # staged as lib/pmi/<soname>, off the library search path


def choose(explicit: str | None, site: SiteProfile | None,
           mpi_plugin: str | None) -> str | None:
    """The plugin for srun: ``explicit``, else the site's ``pmi``, else the MPI's own
    (``Flavour.srun_mpi``, ``Family.pmi``); None leaves srun's default (``MpiDefault``)."""
    if explicit:
        return explicit
    if site is not None and site.pmi:
        return site.pmi
    return mpi_plugin


def parse_list(text: str) -> tuple[str, ...]:
    """Plugin names from ``srun --mpi=list`` (Slurm 20.x-24.x formats).

    22.05 prints ``MPI plugin types are...`` then one tab-indented name per line, then
    ``specific pmix plugin versions available: pmix_v4``; older ones prefix every line with
    ``srun: `` and list ``pmix_v3`` among the types.
    """
    names: list[str] = []
    for raw in text.splitlines():
        line = raw.strip()
        if line.startswith("srun:"):
            line = line[len("srun:"):].strip()
        if not line or "error" in line.lower():
            continue
        m = re.match(r"specific \S+ plugin versions available:\s*(.*)", line)
        if m:
            names += [n for n in re.split(r"[,\s]+", m.group(1)) if n]
            continue
        if line.lower().startswith("mpi ") and line.endswith("..."):
            continue                                  # "MPI plugin types are..."
        if re.fullmatch(r"[A-Za-z0-9_]+", line):
            names.append(line)
    return tuple(dict.fromkeys(names))


def check(needed: str, srun_mpi_list_output: str) -> None:
    """The PMI plugin the MPI needs must be among ``srun --mpi=list``'s."""
    available = parse_list(srun_mpi_list_output)
    if needed in available:
        return
    if needed == "pmix" and any(n.startswith("pmix_v") for n in available):
        return
    which = " and ".join(f.title for f in abi.FLAVOURS.values() if f.srun_mpi == needed)
    raise UserError(
        f"srun has no PMI plugin {needed!r} (srun --mpi=list offers: "
        f"{', '.join(available) or 'nothing'}); without it srun starts every rank as a "
        "separate 'rank 0 of 1'",
        f"{which or 'this MPI'} under srun needs --mpi={needed}: ask the admins for Slurm's "
        f"{needed} plugin, set pmi in the site profile to one listed, or start the ranks with "
        "mpirun/mpiexec instead of srun (--launcher mpirun)")


def srun_list(env: dict[str, str] | None = None, timeout: float = 30.0) -> str:
    """Output of ``srun --mpi=list``; UserError when srun is missing or fails."""
    env = dict(os.environ if env is None else env)
    binary = which("srun", path=env.get("PATH"))
    if not binary:
        raise UserError("srun not found on PATH",
                        "run inside a Slurm installation, or start the ranks with mpirun "
                        "(--launcher mpirun)")
    import subprocess   # here, as the other commands' runs: most launches run none
    try:
        out = subprocess.run([binary, "--mpi=list"], capture_output=True, text=True,
                             timeout=timeout, env=env, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise UserError(f"cannot run srun --mpi=list: {exc}",
                        "check the Slurm installation (SLURM_CONF)") from None
    text = out.stdout + out.stderr
    if out.returncode != 0:
        last = text.strip().splitlines()[-1] if text.strip() else "(no output)"
        raise UserError(f"srun --mpi=list failed: {last}",
                        "check the Slurm configuration: SLURM_CONF, or the slurmctld "
                        "address in slurm.conf")
    return text


def same_plugin(a: str, b: str) -> bool:
    """``pmix`` and ``pmix_v4`` are one plugin; everything else compares by name."""
    return a == b or (a.startswith("pmix") and b.startswith("pmix"))


def step_plugin(env: dict[str, str]) -> str | None:
    """The plugin srun used for this rank's step (``SLURM_MPI_TYPE``; None: none)."""
    used = env.get("SLURM_MPI_TYPE", "")
    return used if used and used != "none" else None


def step_mismatch(needed: str | None, used: str | None) -> bool:
    """A rank of an srun step was started with a plugin other than the one its MPI needs
    (``used`` None, ``--mpi=none``, is not a mismatch: the caller warns about it)."""
    return needed is not None and used is not None and not same_plugin(needed, used)


def step_error(needed: str, used: str, title: str, srun_line: str) -> UserError:
    """The error for :func:`step_mismatch`; ``srun_line`` starts the ranks right."""
    return UserError(
        f"srun started the ranks with --mpi={used}, but {title} needs --mpi={needed}: its "
        "ranks would not find each other (each a world of 1, or a failed MPI_Init)",
        f"run: {srun_line}")


def library_for(implementation: str | None, plugin: str | None) -> abi.PmiLibrary | None:
    """The PMI client library ``implementation`` loads under srun's ``plugin``, if any."""
    if implementation is None or plugin is None:
        return None
    return next((lib for lib in abi.PMI_LIBRARIES if lib.implementation == implementation
                 and same_plugin(lib.plugin, plugin)), None)


def library_dirs(env: dict[str, str], site: SiteProfile | None) -> list[str]:
    """Where :func:`find_library` looks after an explicit path: the site's search dirs,
    the lib directories beside ``srun`` (a Slurm install prefix), then the system's."""
    dirs = list(site.search_dirs) if site else []
    srun = which("srun", path=env.get("PATH", os.defpath))
    if srun:
        prefix = os.path.dirname(os.path.dirname(os.path.realpath(srun)))
        dirs += [os.path.join(prefix, sub) for sub in ("lib64", "lib", f"lib/{abi.MULTIARCH}")]
    dirs += abi.SYSTEM_LIBDIRS
    return list(dict.fromkeys(os.path.normpath(d) for d in dirs))


@record
class PmiClient:
    """A job's PMI client library, as planned: the env that names its host path, or why
    there is none (said as a warning; the MPI then uses its own PMI client)."""

    env: tuple[tuple[str, str], ...] = ()
    note: str | None = None


def client(implementation: str | None, plugin: str | None, env: dict[str, str],
           site: SiteProfile | None) -> PmiClient:
    """What ranks of ``implementation`` under srun's ``plugin`` get (impure: looks on the
    host). UserError when the env or site names a library that does not exist."""
    lib = library_for(implementation, plugin)
    if lib is None:
        return PmiClient()
    path = find_library(lib, env, site)
    if path is None:
        return PmiClient(note=not_found(lib, env, site))
    return PmiClient(env=((lib.env_var, path),))


def find_library(lib: abi.PmiLibrary, env: dict[str, str], site: SiteProfile | None,
                 ldconfig_output: str | None = None) -> str | None:
    """The host path of ``lib``: the path its env var names (in ``env``, else the site's
    env), else the first soname in :func:`library_dirs`, else in ``ldconfig -p``; None
    when nothing is found. UserError when a named path does not exist (the MPI would say
    so on every rank and fall back)."""
    given = env.get(lib.env_var) or (site.env.get(lib.env_var) if site else None)
    if given:
        if os.path.isfile(given):
            return given
        raise UserError(f"{lib.env_var}={given} does not exist on this host",
                        f"point {lib.env_var} at Slurm's {lib.sonames[-1]} (find it with "
                        f"ldconfig -p | grep {lib.sonames[-1].split('.')[0]}), or unset it "
                        "and let hpcai-launch find it")
    for directory in library_dirs(env, site):
        for name in lib.sonames:
            path = os.path.join(directory, name)
            if os.path.isfile(path):
                return path
    from . import hostmpi
    cache = hostmpi.parse_ldconfig(hostmpi.run_ldconfig(env) if ldconfig_output is None
                                   else ldconfig_output)
    for name in lib.sonames:
        if name in cache:
            return cache[name]
    return None


def not_found(lib: abi.PmiLibrary, env: dict[str, str], site: SiteProfile | None) -> str:
    """The warning when :func:`find_library` finds nothing."""
    return (f"{lib.title} under srun --mpi={lib.plugin} is pointed at Slurm's "
            f"{lib.sonames[-1]} ({lib.env_var}), and this host has none (looked in "
            f"{', '.join(library_dirs(env, site))} and ldconfig -p): it uses its own PMI-2 "
            "client instead; install Slurm's PMI-2 library (Debian/Ubuntu: libpmi2-0, RPM: "
            f"slurm-libpmi) or set {lib.env_var}")


def staged_env(lib_dir: str, staged_names: list[tuple[str, str]]) -> dict[str, str]:
    """``{env_var: path}`` for a PMI library staged in ``lib_dir``/pmi/ (container paths);
    ``staged_names``: (subdir, name) of every staged file."""
    for subdir, name in staged_names:
        if subdir != PMI_SUBDIR:
            continue
        for lib in abi.PMI_LIBRARIES:
            if name in lib.sonames:
                return {lib.env_var: f"{lib_dir.rstrip('/')}/{PMI_SUBDIR}/{name}"}
    return {}
