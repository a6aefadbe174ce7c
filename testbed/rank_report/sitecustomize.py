"""Test instrumentation: one line per MPI process saying what it really ran on.

Python imports this at start-up when its directory is on ``PYTHONPATH``. A process that
used mpi4py prints, when it exits, one line (one ``write``, so lines of ranks never mix)::

    rank-report rank=R host=H master=ADDR master_ip=IP libmpi=PATH[,PATH] libpmi=PATH|none

- ``host``: the node's host name; ``master``: ``MASTER_ADDR`` as the launcher set it, and
  the address it resolves to here;
- ``libmpi`` / ``libpmi``: the MPI library and the PMI client library mapped into the
  process (``/proc/self/maps``), e.g. the host's, bound into a container.

The program itself (``train 3dgan``, a torch script) runs unchanged.
"""

import atexit
import os
import socket
import sys


def _mapped(prefixes: tuple[str, ...]) -> list[str]:
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
        paths = {line.split()[-1] for line in maps if len(line.split()) >= 6}
    return sorted(p for p in paths if os.path.basename(p).startswith(prefixes))


def _report() -> None:
    if "mpi4py.MPI" not in sys.modules:
        return
    master = os.environ.get("MASTER_ADDR", "")
    try:
        master_ip = socket.gethostbyname(master) if master else "unset"
    except OSError:
        master_ip = "unresolved"
    libmpi = ",".join(_mapped(("libmpi.so", "libmpich.so"))) or "none"
    libpmi = ",".join(_mapped(("libpmi",))) or "none"
    rank = os.environ.get("RANK", os.environ.get("PMI_RANK", "?"))
    line = (f"rank-report rank={rank} host={socket.gethostname()} master={master or 'unset'} "
            f"master_ip={master_ip} libmpi={libmpi} libpmi={libpmi}\n")
    sys.stdout.flush()
    os.write(sys.stdout.fileno(), line.encode())


atexit.register(_report)
