"""Rank 0 sleeps 1 s, then every rank meets in ``training.waits.idle_barrier``: each rank
prints how many times it tested the barrier, the seconds it waited and the CPU seconds it
used meanwhile. ``--spin``: the same barrier tested without sleeping (the control)."""

import sys
import time

from mpi4py import MPI

from hpcai.training.waits import idle_barrier

comm = MPI.COMM_WORLD
comm.Barrier()
if comm.rank == 0:
    time.sleep(1.0)
wall, cpu = time.perf_counter(), time.process_time()
tests = idle_barrier(comm, 0.0, 0.0) if "--spin" in sys.argv else idle_barrier(comm)
print(f"rank {comm.rank} tests {tests} wait {time.perf_counter() - wall:.3f} "
      f"cpu {time.process_time() - cpu:.3f}", flush=True)
