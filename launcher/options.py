"""What the user asked ``hpcai-launch`` for, and the one way to write it back as argv.

:class:`Options` is the parsed command line. :meth:`Options.to_argv` is its only
serialiser: the per-rank wrapper of mpirun and srun, the sbatch script, the mpirun sweep
points and ``validate`` all build their ``hpcai-launch`` argv through it, so an option
cannot be dropped by one of them and kept by another (``tests/test_options.py`` parses
what it writes and compares).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Iterator

LAUNCHERS = ("auto", "mpirun", "srun")
RUNTIMES = ("charliecloud", "singularity", "none")


@dataclass(frozen=True)
class Options:
    """The parsed ``hpcai-launch [options] -- CMD`` (defaults as ``hpcai-launch`` has them)."""

    command: tuple[str, ...]
    ranks_per_node: int | None = None
    ranks_per_numa: int | None = None
    threads_per_rank: int | None = None
    hyperthreads: bool = False
    oversubscribe: bool = False
    launcher: str = "auto"
    mpi: str = "auto"
    mpirun: str | None = None
    hosts: str | None = None
    nodes: int | None = None
    topology: str | None = None
    report_bindings: bool = False
    verbose: bool = False
    container: str | None = None
    runtime: str = "charliecloud"
    bind_host_mpi: bool | None = None     # None: when a host MPI is found
    host_libs: str | None = None          # staged by the outer launcher
    site: str | None = None
    binds: tuple[str, ...] = ()

    def to_argv(self) -> list[str]:
        """``[options...] -- CMD...``: every option that differs from its default, in a
        fixed order, then the command. ``--runtime`` is always written with a container."""
        return [*_option_args(self), "--", *self.command]

    def for_ranks(self, ranks_per_node: int, *, container: str | None, runtime: str,
                  host_libs: str | None) -> Options:
        """What the per-rank ``hpcai-launch`` gets from the launcher that starts it: the
        same placement and container, with the staged host libraries (``host_libs``, or no
        host MPI binding when nothing was staged), and none of the start-up options."""
        in_container = container is not None
        return replace(self, ranks_per_node=ranks_per_node, ranks_per_numa=None,
                       launcher="auto", mpirun=None, hosts=None, nodes=None,
                       container=container,
                       runtime=runtime if in_container else _DEFAULTS["runtime"],
                       host_libs=host_libs if in_container else None,
                       bind_host_mpi=(None if host_libs or not in_container else False),
                       site=self.site if in_container else None,
                       binds=self.binds if in_container else ())


# Field -> flag, in the order to_argv writes them (the per-rank wrapper's order).
_FLAGS: tuple[tuple[str, str], ...] = (
    ("ranks_per_node", "--ranks-per-node"), ("ranks_per_numa", "--ranks-per-numa"),
    ("threads_per_rank", "--threads-per-rank"), ("hyperthreads", "--hyperthreads"),
    ("oversubscribe", "--oversubscribe"), ("report_bindings", "--report-bindings"),
    ("verbose", "-v"), ("topology", "--topology"), ("mpi", "--mpi"),
    ("launcher", "--launcher"), ("mpirun", "--mpirun"), ("hosts", "--hosts"),
    ("nodes", "--nodes"), ("container", "--container"), ("runtime", "--runtime"),
    ("host_libs", "--host-libs"), ("bind_host_mpi", "--bind-host-mpi"), ("site", "--site"),
    ("binds", "--bind"),
)
_DEFAULTS = {f.name: f.default for f in fields(Options) if f.name != "command"}


def _option_args(options: Options) -> Iterator[str]:
    for name, flag in _FLAGS:
        value = getattr(options, name)
        if name == "runtime" and options.container is not None:
            yield from (flag, value)
        elif value == _DEFAULTS[name]:
            continue
        elif name == "binds":
            for bind in value:
                yield from (flag, bind)
        elif name == "bind_host_mpi":
            yield "--bind-host-mpi" if value else "--no-bind-host-mpi"
        elif isinstance(value, bool):
            yield flag
        else:
            yield from (flag, str(value))
