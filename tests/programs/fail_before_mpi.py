"""A job in which rank 1 fails before it starts MPI: once every rank has written its PID to
OUT/<rank>.pid, it exits with status 3 (with ``--kill``: it kills itself with SIGKILL). The
other ranks wait for rank 1: with ``--mpi`` in ``MPI_Init`` and a barrier (as a training
would), without it in a 600 s sleep (no MPI library needed: what the launcher does about
rank 1 is the same)."""

import os
import signal
import sys
import time

out, wait_in_mpi = sys.argv[1], "--mpi" in sys.argv[2:]
rank = int(next(os.environ[k] for k in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")
                if k in os.environ))
with open(os.path.join(out, f"{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
if rank == 1:                   # once every rank has started (has written its PID)
    size = int(next(os.environ[k] for k in ("WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
                    if k in os.environ))
    deadline = time.monotonic() + 60
    while len(os.listdir(out)) < size and time.monotonic() < deadline:
        time.sleep(0.05)
    print("rank 1: failing before MPI", flush=True)
    if "--kill" in sys.argv[2:]:
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(3)
if wait_in_mpi:
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
else:
    time.sleep(600)
