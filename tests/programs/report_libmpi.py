"""Run a Python script unchanged (as ``__main__``), then say which libmpi this process uses.

    python3 report_libmpi.py SCRIPT [ARGS...]

For tests of unmodified user scripts: the script is not edited, and afterwards one line
``libmpi-mapped rank=R path=P`` tells where the MPI library really came from: the file
that defines ``MPI_Init`` (``hpcai.launcher.mpi.libmpi``, by ``dladdr``), e.g. the host's,
bound into a container.
"""

import os
import runpy
import sys

from hpcai.launcher.mpi.libmpi import libmpi_path

script = sys.argv[1]
sys.argv = sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
finally:
    rank = next((os.environ[k] for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "RANK")
                 if k in os.environ), "?")
    sys.stdout.flush()
    # one write(2) for the whole line: mpirun forwards output in chunks as they come, and a
    # separate newline let two ranks' lines run together
    line = f"libmpi-mapped rank={rank} path={libmpi_path() or 'none'}\n"
    os.write(sys.stdout.fileno(), line.encode())
