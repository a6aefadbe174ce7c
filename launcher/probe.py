"""A real MPI program that says who each rank is, where it runs and which MPI it really uses.

``python -m hpcai.launcher.probe [--out DIR] [--bench]`` initialises MPI (mpi4py), checks the
world with an allreduce, and prints (and writes ``DIR/rank-R.json``) the rank, world size,
host, PID, CPU affinity, thread env, the MPI library version, the file that really defines
``MPI_Init`` and the fabric libraries the MPI loaded (both by ``dladdr``, see
:mod:`.libmpi`). A rank whose file already exists (two processes with the same rank: a
singleton world, or a reused directory) writes ``rank-R.pid-P.json`` instead, so duplicates
show. ``--bench`` adds a ping-pong at :data:`PINGPONG_SIZES` between rank 0 and a partner
(the first rank on another host, else rank 1), each size for at most
:data:`PINGPONG_BUDGET_S` at the warm-up's pace, so a slow path (an oversubscribed node: a
round trip of milliseconds) bounds the launch instead of taking minutes. It is the default
demo and the test workload.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..core.cli import Parser, run_main
from ..core.errors import UserError
from .mpi.libmpi import defining_library, libmpi_path
from .node.topology import format_cpulist

PROBE_SCHEMA = 3     # 3: PingPong.samples

_TRANSLATED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND",
               "HPCAI_CPUS")

# Fabric library kind -> a function only that library defines (looked up with dladdr).
FABRIC_SYMBOLS = {"libfabric": "fi_getinfo", "libpsm2": "psm2_init",
                  "libucp": "ucp_init_version", "libibverbs": "ibv_get_device_list",
                  "libnccl": "ncclGetVersion"}

# Message size -> (round trips per sample, samples at most) of one ping-pong trial.
PINGPONG_SIZES = {8: (50, 60), 64 << 10: (5, 60), 4 << 20: (1, 60)}
# Per size, the samples that fit this many seconds at the warm-up sample's pace, but at
# least PINGPONG_MIN_SAMPLES: idle, every size takes well under it and runs all its samples.
PINGPONG_BUDGET_S = 2.0
PINGPONG_MIN_SAMPLES = 10


@dataclass(frozen=True)
class PingPong:
    """One trial's ping-pong at one message size: half round-trip times over its samples."""

    nbytes: int
    median_us: float
    best_us: float
    samples: int


@dataclass(frozen=True)
class ProbeRecord:
    """What one rank of the probe reports (``DIR/rank-R.json``), schema ``PROBE_SCHEMA``."""

    rank: int
    size: int
    allreduce_ok: bool
    host: str
    pid: int
    affinity: tuple[int, ...]
    affinity_list: str
    env: dict[str, str | None]
    mpi_library_version: str
    libmpi: tuple[str, ...]                  # the file that defines MPI_Init (one; none: ())
    fabric: dict[str, str]                   # kind (FABRIC_SYMBOLS) -> file, those loaded
    pingpong: tuple[PingPong, ...] | None = None   # rank 0 with --bench
    partner: int | None = None               # the rank rank 0 ping-ponged with
    schema: int = PROBE_SCHEMA

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str, source: str = "probe record") -> "ProbeRecord":
        data = json.loads(text)
        if data.get("schema") != PROBE_SCHEMA:
            raise UserError(f"{source} has probe schema {data.get('schema')!r}, this hpcai "
                            f"reads {PROBE_SCHEMA}",
                            "run the image's and the host's hpcai from the same version")
        data["affinity"] = tuple(data["affinity"])
        data["libmpi"] = tuple(data["libmpi"])
        if data.get("pingpong") is not None:
            data["pingpong"] = tuple(PingPong(**p) for p in data["pingpong"])
        return cls(**data)

    @classmethod
    def load(cls, path: Path) -> "ProbeRecord":
        return cls.from_json(path.read_text(), str(path))


def loaded_fabric() -> dict[str, str]:
    """The fabric libraries this process loaded, by kind: the files defining their symbols."""
    found = {kind: defining_library(symbol) for kind, symbol in FABRIC_SYMBOLS.items()}
    return {kind: path for kind, path in found.items() if path}


def sample_count(warm_s: float, most: int, budget_s: float = PINGPONG_BUDGET_S) -> int:
    """How many samples of one size to time: as many as fit ``budget_s`` at the pace of the
    warm-up sample (``warm_s`` seconds), at least :data:`PINGPONG_MIN_SAMPLES`, at most
    ``most``."""
    fit = int(budget_s / warm_s) if warm_s > 0 else most
    return max(min(fit, most), min(PINGPONG_MIN_SAMPLES, most))


def pingpong(comm, partner: int, budget_s: float = PINGPONG_BUDGET_S) -> tuple[PingPong, ...]:
    """Rank 0 and ``partner`` bounce a message; each sample times a batch of round trips
    (one timer call per batch: at 8 B a round trip is well under a microsecond here). Per
    size a first sample warms the path up; rank 0 derives the number of samples from its
    time (:func:`sample_count`) and tells the partner before the timed ones. Rank 0 returns
    the results; the other ranks return ``()``."""
    import time

    import numpy as np

    rank = comm.Get_rank()
    results = []
    for nbytes, (batch, most) in PINGPONG_SIZES.items():
        buf = np.zeros(nbytes, dtype=np.uint8)
        comm.Barrier()
        if rank not in (0, partner):
            continue

        def sample() -> float:
            t0 = time.perf_counter()
            for _ in range(batch):
                if rank == 0:
                    comm.Send(buf, dest=partner)
                    comm.Recv(buf, source=partner)
                else:
                    comm.Recv(buf, source=0)
                    comm.Send(buf, dest=0)
            return time.perf_counter() - t0

        warm = sample()
        if rank == 0:
            samples = sample_count(warm, most, budget_s)
            comm.send(samples, dest=partner)
        else:
            samples = comm.recv(source=0)
        halves = [sample() / (2 * batch) * 1e6 for _ in range(samples)]
        if rank == 0:
            results.append(PingPong(nbytes, float(np.median(halves)), min(halves), samples))
    return tuple(results)


def _write(out: Path, record: ProbeRecord) -> None:
    """``rank-R.json``, or ``rank-R.pid-P.json`` when that exists (never overwritten)."""
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".rank-{record.rank}.{record.pid}.tmp"
    tmp.write_text(record.to_json())
    try:
        os.link(tmp, out / f"rank-{record.rank}.json")
        tmp.unlink()
    except FileExistsError:
        tmp.replace(out / f"rank-{record.rank}.pid-{record.pid}.json")


def main(argv: list[str] | None = None) -> int:
    return run_main(_probe, argv)


def _probe(argv: list[str]) -> int:
    parser = Parser(prog="python -m hpcai.launcher.probe")
    parser.add_argument("--out", help="directory for rank-R.json files")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--bench", action="store_true",
                        help="also measure ping-pong latency and bandwidth")
    args = parser.parse_args(argv)

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    total = comm.allreduce(rank, op=MPI.SUM)
    hosts = comm.allgather(socket.gethostname())
    partner = next((r for r, h in enumerate(hosts) if h != hosts[0]), 1)
    bench = pingpong(comm, partner) if args.bench and size > 1 else None
    affinity = os.sched_getaffinity(0)
    libmpi = libmpi_path()
    record = ProbeRecord(
        rank=rank, size=size, allreduce_ok=total == size * (size - 1) // 2,
        host=hosts[rank], pid=os.getpid(), affinity=tuple(sorted(affinity)),
        affinity_list=format_cpulist(affinity),
        env={k: os.environ.get(k) for k in _TRANSLATED},
        mpi_library_version=MPI.Get_library_version().replace("\x00", "").strip()
        .splitlines()[0],
        libmpi=(libmpi,) if libmpi else (), fabric=loaded_fabric(),
        pingpong=bench if rank == 0 else None,
        partner=partner if bench is not None else None)
    if args.out:
        _write(Path(args.out), record)
    if not args.quiet:
        line = (f"rank {rank}/{size} local {record.env['LOCAL_RANK']} on {record.host} "
                f"cpus {record.affinity_list} threads {record.env['OMP_NUM_THREADS']} "
                f"{record.mpi_library_version[:40]} libmpi {libmpi or '?'}\n")
        os.write(sys.stdout.fileno(), line.encode())  # one write: lines never interleave
    comm.Barrier()
    return 0 if record.allreduce_ok else 1


if __name__ == "__main__":
    sys.exit(main())
