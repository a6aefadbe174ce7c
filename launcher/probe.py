"""A real MPI program that says who each rank is and where it runs.

``python -m hpcai.launcher.probe [--out DIR]`` initialises MPI (mpi4py), checks the world
with an allreduce, and prints (and writes ``DIR/rank-R.json``) the rank, world size, local
rank, host, CPU affinity, thread env, the MPI library version and the path of the libmpi
actually mapped into the process. It is the default demo and the test workload.
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
from .topology import format_cpulist

PROBE_SCHEMA = 1

_TRANSLATED = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "NODE_RANK",
               "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS", "OMP_PLACES", "OMP_PROC_BIND",
               "HPCAI_CPUS")


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
    libmpi: tuple[str, ...]
    libraries: dict[str, list[str]]          # kind (LIBRARY_KINDS) -> mapped paths
    bench: dict[str, float] | None = None    # bandwidth_probe(), with --bench
    schema: int = PROBE_SCHEMA

    def to_json(self) -> str:
        data = asdict(self)
        if self.bench is None:
            del data["bench"]
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str, source: str = "probe record") -> "ProbeRecord":
        data = json.loads(text)
        if data.get("schema") != PROBE_SCHEMA:
            raise UserError(f"{source} has probe schema {data.get('schema')!r}, this hpcai "
                            f"reads {PROBE_SCHEMA}",
                            "run the image's and the host's hpcai from the same version")
        data["affinity"] = tuple(data["affinity"])
        data["libmpi"] = tuple(data["libmpi"])
        return cls(**data)

    @classmethod
    def load(cls, path: Path) -> "ProbeRecord":
        return cls.from_json(path.read_text(), str(path))


def mapped_libraries(prefixes: tuple[str, ...] = ("libmpi", "libmpich")) -> list[str]:
    """Paths of shared objects mapped into this process whose file name starts with a prefix."""
    found: list[str] = []
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            if len(parts) == 6:
                path = parts[5].strip()
                if os.path.basename(path).startswith(prefixes) and path not in found:
                    found.append(path)
    return found


LIBRARY_KINDS = {"libmpi": ("libmpi.", "libmpich."), "libfabric": ("libfabric.",),
                 "libpsm2": ("libpsm2.",), "libucp": ("libucp.",), "libnccl": ("libnccl.",)}


def mapped_by_kind() -> dict[str, list[str]]:
    """The libmpi / libfabric / libpsm2 / libucp / libnccl files really mapped, by kind."""
    every = mapped_libraries(tuple(p for prefixes in LIBRARY_KINDS.values() for p in prefixes))
    return {kind: [path for path in every if os.path.basename(path).startswith(prefixes)]
            for kind, prefixes in LIBRARY_KINDS.items()}


def bandwidth_probe(comm, MPI) -> dict:
    """Ping-pong between ranks 0 and 1 (latency of 8 B, bandwidth of 4 MiB) and the
    allreduce bandwidth of 16 MiB of float32 over all ranks. Best of the repetitions: on a
    shared node the median wanders by 2x between runs, the best is what the path can do."""
    import time

    import numpy as np

    out: dict = {}
    rank, size = comm.Get_rank(), comm.Get_size()
    if size >= 2:
        for nbytes, reps, key in ((8, 200, "latency_us"), (4 << 20, 40, "bandwidth_GBps")):
            times = []
            for trial in range(reps):
                if trial % 10 == 0:   # fresh buffers: one allocation's placement is luck
                    buf = np.zeros(nbytes, dtype=np.uint8)
                comm.Barrier()
                t0 = time.perf_counter()
                if rank == 0:
                    comm.Send(buf, dest=1)
                    comm.Recv(buf, source=1)
                elif rank == 1:
                    comm.Recv(buf, source=0)
                    comm.Send(buf, dest=0)
                times.append((time.perf_counter() - t0) / 2)
            half = min(times)
            value = half * 1e6 if key == "latency_us" else nbytes / half / 1e9
            out[key] = comm.bcast(value, root=0)
    times = []
    for trial in range(15):
        if trial % 5 == 0:
            data = np.ones(4 << 20, dtype=np.float32)
        comm.Barrier()
        t0 = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, data, op=MPI.SUM)
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    out["allreduce_GBps"] = data.nbytes / min(times) / 1e9
    return out


def main(argv: list[str] | None = None) -> int:
    return run_main(_probe, argv)


def _probe(argv: list[str]) -> int:
    parser = Parser(prog="python -m hpcai.launcher.probe")
    parser.add_argument("--out", help="directory for rank-R.json files")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--bench", action="store_true",
                        help="also measure ping-pong and allreduce bandwidth")
    args = parser.parse_args(argv)

    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    total = comm.allreduce(rank, op=MPI.SUM)
    affinity = os.sched_getaffinity(0)
    record = ProbeRecord(
        rank=rank, size=size, allreduce_ok=total == size * (size - 1) // 2,
        host=socket.gethostname(), pid=os.getpid(), affinity=tuple(sorted(affinity)),
        affinity_list=format_cpulist(affinity),
        env={k: os.environ.get(k) for k in _TRANSLATED},
        mpi_library_version=MPI.Get_library_version().strip().splitlines()[0],
        libmpi=tuple(mapped_libraries()), libraries=mapped_by_kind(),
        bench=bandwidth_probe(comm, MPI) if args.bench else None)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / f".rank-{rank}.json.tmp"
        tmp.write_text(record.to_json())
        tmp.replace(out / f"rank-{rank}.json")
    if not args.quiet:
        line = (f"rank {rank}/{size} local {record.env['LOCAL_RANK']} on {record.host} "
                f"cpus {record.affinity_list} threads {record.env['OMP_NUM_THREADS']} "
                f"{record.mpi_library_version[:40]} "
                f"libmpi {','.join(record.libmpi) or '?'}\n")
        os.write(sys.stdout.fileno(), line.encode())  # one write: lines never interleave
    comm.Barrier()
    return 0 if record.allreduce_ok else 1


if __name__ == "__main__":
    sys.exit(main())
