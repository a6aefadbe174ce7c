"""srun's PMI plugin: which one a job needs, and whether this Slurm has it.

Without the right ``--mpi=`` plugin srun starts N silent singletons, each "rank 0 of 1".
:func:`choose` is the one rule (an explicit choice, then the site profile, then the MPI
flavour's plugin from :mod:`hpcai.launcher.abi`); :func:`check` compares it with what
``srun --mpi=list`` offers, before any rank starts.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess

from ..core.errors import UserError
from ..launcher import abi
from ..launcher.site import SiteProfile


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
    binary = shutil.which("srun", path=env.get("PATH"))
    if not binary:
        raise UserError("srun not found on PATH",
                        "run inside a Slurm installation, or start the ranks with mpirun "
                        "(--launcher mpirun)")
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
