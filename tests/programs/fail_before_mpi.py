"""A job in which rank 1 fails before it starts MPI: it exits with status 3 at once. Every
rank first writes its PID to OUT/<rank>.pid. The other ranks wait for rank 1: with ``--mpi``
in ``MPI_Init`` and a barrier (as a training would), without it in a 600 s sleep (no MPI
library needed: what the launcher does about rank 1 is the same)."""

import os
import sys
import time

out, wait_in_mpi = sys.argv[1], "--mpi" in sys.argv[2:]
rank = int(next(os.environ[k] for k in ("RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK")
                if k in os.environ))
with open(os.path.join(out, f"{rank}.pid"), "w") as f:
    f.write(str(os.getpid()))
if rank == 1:
    print("rank 1: failing before MPI", flush=True)
    sys.exit(3)
if wait_in_mpi:
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()
else:
    time.sleep(600)
