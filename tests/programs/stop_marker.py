"""A rank that stops as the trainer does, slowly: on SIGTERM or SIGUSR1 it writes the signal,
takes 3 s (longer than Open MPI's mpirun waits before it ends a rank itself), writes
``checkpoint`` and exits 0. Each process appends to OUT/<pid>; ``ready`` once it catches."""

import os
import signal
import sys
import time

path = os.path.join(sys.argv[1], str(os.getpid()))


def note(text: str) -> None:
    with open(path, "a") as f:
        f.write(text + "\n")


def stop(signum: int, _frame: object) -> None:
    note(f"signal {signum}")
    time.sleep(3)
    note("checkpoint")
    sys.exit(0)


for sig in (signal.SIGTERM, signal.SIGUSR1):
    signal.signal(sig, stop)
note("ready")
while True:
    time.sleep(0.1)
