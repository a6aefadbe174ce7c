"""Site profiles: what an HPC site's admins know about running containers there, as TOML.

``SiteProfile.load(path)`` reads one file; ``SiteProfile.from_env(env)`` reads the file named
by ``HPCAI_SITE`` (None when it is unset). Every key is optional:

```toml
name = "lrz-supermuc-ng"             # shown in plans and reports (default: the file's stem)
mpi_launcher = "srun"                # "srun" or "mpiexec": how ranks are started there
pmi = "pmi2"                         # srun --mpi= plugin the site's MPI needs
expected_libmpi = "/lrz/sys/intel/"  # validation fails unless the ranks' libmpi is under this
cores_per_node = 48                  # integer: cores (not hardware threads) per node
threads_per_core = 2                 # integer: hardware threads per core (srun counts them)
memory_per_node_gb = 96              # number: usable memory per node (hpcai-launch predict)
metadata_ops_per_s = 20000           # integer: the shared file system's metadata rate, for
                                     # bench/startup.py's start-up model (default 20000)
job_dir = "/tmp/hpcai-jobs-$USER"    # where plan-once writes each job's plan (absolute;
                                     # $VARS expanded; default ~/.cache/hpcai/jobs)
job_dir_scope = "node"               # "shared" (default: one plan per job, by rank 0) or
                                     # "node" (node-local: each node's local rank 0 plans,
                                     # and stages the host libraries under job_dir too)
binds = ["/lrz/sys/", "/hppfs/work:/work:rw"]  # extra binds, "SRC[:DST][:ro|:rw]", absolute;
                                              # read-only unless ":rw" (a writable work tree)
libraries = ["/usr/lib64/libpsm2.so.2"]      # extra host libraries to bind (staged)
search_dirs = ["/usr/lib64"]                 # where to resolve host libraries' dependencies
mpi_prefixes = ["/opt/mpich-5.0.2"]          # MPI installs beyond ldconfig and $I_MPI_ROOT...
nccl = ["/opt/nccl/lib/libnccl.so.2",        # the host's NCCL and its network plugin, bound
        "/opt/aws-ofi-nccl/lib/libnccl-net.so"]  # (staged) in place of any on the search path

[env]                                # set inside the container for every rank (strings)
FI_PROVIDER = "psm2"
I_MPI_FABRICS = "shm:ofi"

[network]                            # the fabric, for hpcai-launch predict
latency_us = 1.0                     # MPI point-to-point latency (alpha)
bandwidth_gbit_s = 100               # per-node link bandwidth (1/beta)
topology = "fat-tree"                # fat-tree (full bisection) or shared-host
```

An unknown key or a value of the wrong type is a ``UserError`` naming the key and the file,
with a valid example as the hint. ``tests/data/site-lrz.toml`` is a complete example.
"""

from __future__ import annotations

import os
from ...core.record import asdict, field, record

from ...core.errors import UserError
from .jobplan import JOB_DIR_SCOPES, SHARED


def _toml():
    """The TOML parser (imported when a profile is read: a launch without one needs none),
    or None."""
    try:
        import tomllib
    except ModuleNotFoundError:      # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:  # pragma: no cover
            return None
    return tomllib


MPI_LAUNCHERS = ("srun", "mpiexec")
# Metadata operations per second of a site's shared file system, when its profile does not say:
# a conservative figure for one busy Lustre/GPFS metadata server (bench/startup.py's model).
DEFAULT_METADATA_OPS_PER_S = 20000

# key -> (kind, example line shown in hints)
_SCHEMA: dict[str, tuple[str, str]] = {
    "name": ("str", 'name = "lrz-supermuc-ng"'),
    "binds": ("list[path]", 'binds = ["/lrz/sys/", "/hppfs/work:/work"]'),
    "env": ("dict[str]", '[env]\nFI_PROVIDER = "psm2"'),
    "libraries": ("list[path]", 'libraries = ["/usr/lib64/libpsm2.so.2"]'),
    "search_dirs": ("list[path]", 'search_dirs = ["/usr/lib64"]'),
    "mpi_prefixes": ("list[path]", 'mpi_prefixes = ["/opt/mpich-5.0.2"]'),
    "nccl": ("list[path]", 'nccl = ["/opt/nccl/lib/libnccl.so.2", '
                           '"/opt/aws-ofi-nccl/lib/libnccl-net.so"]'),
    "mpi_launcher": ("launcher", 'mpi_launcher = "srun"'),
    "pmi": ("str", 'pmi = "pmi2"'),
    "expected_libmpi": ("str", 'expected_libmpi = "/lrz/sys/intel/"'),
    "cores_per_node": ("int", "cores_per_node = 48"),
    "threads_per_core": ("int", "threads_per_core = 2"),
    "memory_per_node_gb": ("number", "memory_per_node_gb = 96"),
    "network": ("network", '[network]\nlatency_us = 1.0\nbandwidth_gbit_s = 100\n'
                           'topology = "fat-tree"'),
    "metadata_ops_per_s": ("int", "metadata_ops_per_s = 20000"),
    "job_dir": ("abspath", 'job_dir = "/tmp/hpcai-jobs-$USER"'),
    "job_dir_scope": ("scope", 'job_dir_scope = "node"'),
    "gpu_visible": ("gpu_visible", 'gpu_visible = "all"'),
}
TOPOLOGIES = ("fat-tree", "shared-host")


@record
class NetworkSpec:
    """A site's fabric as ``hpcai-launch predict`` models it."""

    latency_us: float
    bandwidth_gbit_s: float
    topology: str = "fat-tree"


@record
class SiteProfile:
    """One site's container settings (see the module docstring for the TOML schema)."""

    name: str = "site"
    binds: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict, hash=False)
    libraries: tuple[str, ...] = ()
    search_dirs: tuple[str, ...] = ()
    mpi_prefixes: tuple[str, ...] = ()
    nccl: tuple[str, ...] = ()         # the host's libnccl.so.2 and its network plugin
    mpi_launcher: str | None = None
    pmi: str | None = None
    expected_libmpi: str | None = None
    cores_per_node: int | None = None
    threads_per_core: int = 1
    memory_per_node_gb: float | None = None
    network: NetworkSpec | None = None
    metadata_ops_per_s: int = DEFAULT_METADATA_OPS_PER_S
    job_dir: str | None = None         # plan-once's job directory (:mod:`.jobplan` reads it)
    job_dir_scope: str = SHARED
    path: str | None = None            # the file it was loaded from
    gpu_visible: str | None = None     # "per-rank" or "all" (:mod:`.gpuplace`)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "SiteProfile":
        path = os.fspath(path)
        tomllib = _toml()
        if tomllib is None:  # pragma: no cover
            raise UserError(f"cannot read site profile {path}: no TOML parser",
                            "use Python >= 3.11, or pip install tomli")
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise UserError(f"site profile {path} does not exist",
                            "check --site / HPCAI_SITE (a TOML file, e.g. "
                            "tests/data/site-lrz.toml)") from None
        except OSError as exc:
            raise UserError(f"cannot read site profile {path}: {exc.strerror}",
                            "check the file's permissions") from None
        except tomllib.TOMLDecodeError as exc:
            raise UserError(f"site profile {path} is not valid TOML: {exc}",
                            "strings need quotes, lists brackets: " +
                            _SCHEMA["binds"][1]) from None
        return cls.from_dict(data, path)

    @classmethod
    def from_env(cls, env: dict[str, str]) -> "SiteProfile | None":
        """The profile named by ``HPCAI_SITE``, or None when it is unset or empty."""
        path = env.get("HPCAI_SITE")
        return cls.load(path) if path else None

    @classmethod
    def chosen(cls, given: str | os.PathLike | None, env: dict[str, str]
               ) -> "SiteProfile | None":
        """The profile a command uses: ``--site`` (``given``), else ``HPCAI_SITE``, else
        None. (A rank's job-directory lookup reads the same two in ``jobplan``, without
        importing this module.)"""
        return cls.load(given) if given else cls.from_env(env)

    @classmethod
    def from_dict(cls, data: dict, path: str = "<site profile>") -> "SiteProfile":
        values: dict[str, object] = {}
        for key, value in data.items():
            if key not in _SCHEMA:
                known = ", ".join(_SCHEMA)
                raise UserError(f"unknown key {key!r} in site profile {path}",
                                f"known keys: {known}; for example: "
                                f"{_SCHEMA['binds'][1]}")
            values[key] = _check(key, value, path)
        values.setdefault("name", os.path.splitext(os.path.basename(path))[0] if path else "site")
        return cls(**values, path=path)  # type: ignore[arg-type]

    def to_dict(self) -> dict:
        return {"name": self.name, "path": self.path, "binds": list(self.binds),
                "env": dict(self.env), "libraries": list(self.libraries),
                "search_dirs": list(self.search_dirs),
                "mpi_prefixes": list(self.mpi_prefixes), "nccl": list(self.nccl),
                "mpi_launcher": self.mpi_launcher,
                "pmi": self.pmi, "expected_libmpi": self.expected_libmpi,
                "cores_per_node": self.cores_per_node, "threads_per_core": self.threads_per_core,
                "memory_per_node_gb": self.memory_per_node_gb,
                "network": None if self.network is None else asdict(self.network),
                "metadata_ops_per_s": self.metadata_ops_per_s, "job_dir": self.job_dir,
                "job_dir_scope": self.job_dir_scope, "gpu_visible": self.gpu_visible}


def _type_name(value: object) -> str:
    return {bool: "boolean", int: "integer", float: "float", str: "string", list: "array",
            dict: "table"}.get(type(value), type(value).__name__)


def _check(key: str, value: object, path: str):
    kind, example = _SCHEMA[key]

    def wrong(what: str, got: object = value) -> UserError:
        return UserError(f"site profile {path}: {key!r} must be {what}, got "
                         f"{_type_name(got)} {got!r}", f"for example: {example}")

    if kind == "str":
        if not isinstance(value, str) or not value:
            raise wrong("a non-empty string")
        return value
    if kind == "launcher":
        if not isinstance(value, str):
            raise wrong("a string")
        if value not in MPI_LAUNCHERS:
            raise UserError(f"site profile {path}: {key!r} must be one of "
                            f"{', '.join(MPI_LAUNCHERS)}, got {value!r}",
                            f"for example: {example}")
        return value
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise wrong("an integer")
        if value <= 0:
            raise UserError(f"site profile {path}: {key!r} must be positive, got {value}",
                            f"for example: {example}")
        return value
    if kind == "number":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise wrong("a number")
        if not value > 0:
            raise UserError(f"site profile {path}: {key!r} must be positive, got {value}",
                            f"for example: {example}")
        return float(value)
    if kind == "network":
        return _check_network(value, path, example)
    if kind == "abspath":
        if not isinstance(value, str) or not os.path.expandvars(value).startswith("/"):
            raise wrong("an absolute path (a string; $VARS are expanded)")
        return value
    if kind == "gpu_visible":
        if value not in ("per-rank", "all"):
            raise wrong("'per-rank' or 'all'")
        return value
    if kind == "scope":
        if value not in JOB_DIR_SCOPES:
            raise wrong(" or ".join(repr(s) for s in JOB_DIR_SCOPES))
        return value
    if kind == "list[path]":
        if not isinstance(value, list):
            raise wrong("an array of strings")
        for item in value:
            if not isinstance(item, str) or not item:
                raise wrong("an array of strings", item)
            if key == "binds":
                _check_bind(item, path, example)
            elif not item.startswith("/"):
                raise UserError(f"site profile {path}: {key!r} entry {item!r} is not an "
                                "absolute path", f"for example: {example}")
        return tuple(value)
    if kind == "dict[str]":
        if not isinstance(value, dict):
            raise wrong("a table of strings")
        for name, item in value.items():
            if not isinstance(item, str):
                raise UserError(f"site profile {path}: env.{name} must be a string, got "
                                f"{_type_name(item)} {item!r}",
                                f'quote it: {name} = "{item}"')
        return dict(value)
    raise AssertionError(kind)  # pragma: no cover


def _check_bind(item: str, path: str, example: str) -> None:
    parts = item.split(":")
    if len(parts) > 1 and parts[-1] in ("ro", "rw"):
        parts.pop()
    if len(parts) > 2 or not all(p.startswith("/") for p in parts):
        raise UserError(f"site profile {path}: bind {item!r} is not SRC[:DST] with absolute "
                        "paths, optionally :ro or :rw", f"for example: {example}")


def _check_network(value: object, path: str, example: str) -> NetworkSpec:
    if not isinstance(value, dict):
        raise UserError(f"site profile {path}: 'network' must be a table, got "
                        f"{_type_name(value)} {value!r}", f"for example:\n{example}")
    unknown = set(value) - {"latency_us", "bandwidth_gbit_s", "topology"}
    if unknown or "latency_us" not in value or "bandwidth_gbit_s" not in value:
        what = (f"unknown key {sorted(unknown)[0]!r}" if unknown
                else "needs latency_us and bandwidth_gbit_s")
        raise UserError(f"site profile {path}: [network] {what}", f"for example:\n{example}")
    numbers = {}
    for key in ("latency_us", "bandwidth_gbit_s"):
        item = value[key]
        if isinstance(item, bool) or not isinstance(item, (int, float)) or not item > 0:
            raise UserError(f"site profile {path}: network.{key} must be a positive number, "
                            f"got {item!r}", f"for example:\n{example}")
        numbers[key] = float(item)
    topology = value.get("topology", "fat-tree")
    if topology not in TOPOLOGIES:
        raise UserError(f"site profile {path}: network.topology must be one of "
                        f"{', '.join(TOPOLOGIES)}, got {topology!r}",
                        f"for example:\n{example}")
    return NetworkSpec(numbers["latency_us"], numbers["bandwidth_gbit_s"], topology)
