"""What the user asked ``hpcai-launch`` for, and the one way to write it back as argv.

:class:`Options` is the parsed command line. :meth:`Options.to_argv` is its only
serialiser: the per-rank wrapper of mpirun and srun, the sbatch script, the mpirun sweep
points and ``validate`` all build their ``hpcai-launch`` argv through it, so an option
cannot be dropped by one of them and kept by another (``tests/test_options.py`` parses
what it writes and compares).
"""

from __future__ import annotations

from ...core.record import fields, record, replace

from ...core.errors import UserError
from ..container.containers import DEFAULT_RUNTIME, NO_RUNTIME, RUNTIMES as RUNTIME_RECORDS
from ..mpi.abi import FLAVOURS

TYPE_CHECKING = False     # typing's constant, without importing typing
if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

LAUNCHERS = ("auto", "mpirun", "srun")
RUNTIMES = (*RUNTIME_RECORDS, NO_RUNTIME)
MPI_CHOICES = ("auto", *FLAVOURS)
GPU_DRIVER_CHOICES = ("auto", "on", "off")


@record
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
    runtime: str = DEFAULT_RUNTIME
    bind_host_mpi: bool | None = None     # None: when a host MPI is found
    host_libs: str | None = None          # staged by the outer launcher
    site: str | None = None
    binds: tuple[str, ...] = ()
    gpus: str | None = None               # synthetic GPUs or "none"; None: this machine's
    gpu_visible: str | None = None        # "per-rank" or "all"; None: the site's, else
                                          # per-rank
    share_gpus: bool = False
    gpu_driver: str = "auto"              # bind the host's NVIDIA driver: auto|on|off

    def to_argv(self) -> list[str]:
        """``[options...] -- CMD...``: every option that differs from its default, in a
        fixed order, then the command. ``--runtime`` is always written with a container."""
        return [*_option_args(self), "--", *self.command]

    def for_ranks(self, ranks_per_node: int, *, container: str | None, runtime: str,
                  host_libs: str | None) -> Options:
        """What the per-rank ``hpcai-launch`` gets from the launcher that starts it: the
        same placement and container, with the staged host libraries (``host_libs``, or no
        host MPI binding when nothing was staged), and none of the start-up options. A
        bare run of options that name a container (``--runtime none`` over
        ``HPCAI_CONTAINER``) passes ``--runtime none`` on: the ranks inherit the variable."""
        in_container = container is not None
        bare = NO_RUNTIME if self.container is not None else _DEFAULTS["runtime"]
        return replace(self, ranks_per_node=ranks_per_node, ranks_per_numa=None,
                       launcher="auto", mpirun=None, hosts=None, nodes=None,
                       container=container,
                       runtime=runtime if in_container else bare,
                       host_libs=host_libs if in_container else None,
                       bind_host_mpi=(None if host_libs or not in_container else False),
                       site=self.site if in_container else None,
                       binds=self.binds if in_container else (),
                       gpu_driver=self.gpu_driver if in_container else "auto")


# Field -> flag, in the order to_argv writes them (the per-rank wrapper's order).
_FLAGS: tuple[tuple[str, str], ...] = (
    ("ranks_per_node", "--ranks-per-node"), ("ranks_per_numa", "--ranks-per-numa"),
    ("threads_per_rank", "--threads-per-rank"), ("hyperthreads", "--hyperthreads"),
    ("oversubscribe", "--oversubscribe"), ("report_bindings", "--report-bindings"),
    ("verbose", "-v"), ("topology", "--topology"), ("mpi", "--mpi"),
    ("launcher", "--launcher"), ("mpirun", "--mpirun"), ("hosts", "--hosts"),
    ("nodes", "--nodes"), ("container", "--container"), ("runtime", "--runtime"),
    ("host_libs", "--host-libs"), ("bind_host_mpi", "--bind-host-mpi"), ("site", "--site"),
    ("binds", "--bind"), ("gpus", "--gpus"), ("gpu_visible", "--gpu-visible"),
    ("share_gpus", "--share-gpus"), ("gpu_driver", "--gpu-driver"),
)
_DEFAULTS = {f.name: f.default for f in fields(Options) if f.name != "command"}

# Field -> how a command line declares it (flags and argparse keywords), for the options that
# hpcai-launch and its ``sbatch`` and ``sweep`` share. Each parses to None when not given:
# the caller fills in :class:`Options`' default (``hpcai-launch``: or its ``HPCAI_*``
# variable, :func:`env_defaults`).
ARGUMENTS: dict[str, tuple[tuple[str, ...], dict]] = {
    "ranks_per_node": (("--ranks-per-node", "-N"), dict(
        type=int, help="MPI ranks per node (default: one per GPU where the node has GPUs, "
                       "else 1; or what the launcher started)")),
    "threads_per_rank": (("--threads-per-rank", "-t"), dict(
        type=int, help="threads per rank (default: cores of the rank's share)")),
    "oversubscribe": (("--oversubscribe",), dict(
        action="store_true", help="allow more ranks x threads than cores")),
    "mpi": (("--mpi",), dict(
        help=f"MPI: a flavour ({', '.join(MPI_CHOICES)}), an install by family@version "
             "(openmpi@5, mpich@4) or its path; see `hpcai-launch mpis`")),
    "container": (("--container",), dict(
        help="image: Charliecloud directory/SquashFS or Singularity SIF/sandbox")),
    "runtime": (("--runtime",), dict(choices=RUNTIMES, help=f"default {DEFAULT_RUNTIME}")),
    "site": (("--site",), dict(help="site profile (TOML): extra binds, env, libraries")),
    "binds": (("--bind",), dict(action="append", default=[], metavar="SRC[:DST[:ro]]",
                                help="extra bind into the container (repeatable)")),
    "gpu_driver": (("--gpu-driver",), dict(
        choices=GPU_DRIVER_CHOICES,
        help="bind the host's NVIDIA driver into the container: its compute libraries "
             "(libcuda, libnvidia-ml, ... of the kernel module's version) staged read-only "
             "with the host libraries, nvidia-smi, and the /dev/nvidia* devices where the "
             "runtime does not bind the host's /dev; refused before any rank starts when a "
             "library's version differs from the kernel module's or the image's CUDA runtime "
             "needs a newer driver (default auto: on when the host has a driver)")),
}


def add_arguments(parser, *names: str) -> None:
    """Declare the options ``names`` (fields of :data:`ARGUMENTS`) on an argparse parser or
    argument group."""
    for name in names:
        flags, keywords = ARGUMENTS[name]
        parser.add_argument(*flags, **keywords)


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


# Option -> the variable that gives its default, and what the value must be: "count" (a
# whole number >= 1), "path" (any non-empty text) or the tuple of allowed words.
ENV_DEFAULTS: tuple[tuple[str, str, str | tuple[str, ...]], ...] = (
    ("ranks_per_node", "HPCAI_RANKS_PER_NODE", "count"),
    ("threads_per_rank", "HPCAI_THREADS_PER_RANK", "count"),
    ("launcher", "HPCAI_LAUNCHER", LAUNCHERS),
    ("mpi", "HPCAI_MPI", MPI_CHOICES),
    ("mpirun", "HPCAI_MPIRUN", "path"),
    ("container", "HPCAI_CONTAINER", "path"),
    ("runtime", "HPCAI_RUNTIME", RUNTIMES),
    ("site", "HPCAI_SITE", "path"),
)


def env_defaults(env: Mapping[str, str]) -> dict[str, int | str | None]:
    """The default of every option of :data:`ENV_DEFAULTS`: its ``HPCAI_*`` variable when
    set (an empty one counts as unset), else :class:`Options`'. A malformed value is a
    :class:`UserError` naming the variable, never dropped: ``HPCAI_RANKS_PER_NODE=abc``
    stops the launch."""
    out: dict[str, int | str | None] = {}
    for name, var, kind in ENV_DEFAULTS:
        text = env.get(var, "").strip()
        if not text:
            out[name] = _DEFAULTS[name]
            continue
        flag = "--" + name.replace("_", "-")
        if kind == "count":
            if not text.isdigit() or int(text) < 1:
                raise UserError(f"{var}={text!r} is not a whole number of at least 1",
                                f"set {var} to e.g. 4, or unset it (it is the default of "
                                f"{flag})")
            out[name] = int(text)
        elif kind == "path":
            out[name] = text
        else:
            if text not in kind:
                raise UserError(f"{var}={text!r} is not one of: {', '.join(kind)}",
                                f"set {var} to one of those, or unset it (it is the default "
                                f"of {flag})")
            out[name] = text
    return out
