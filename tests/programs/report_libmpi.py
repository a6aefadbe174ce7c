"""Run a Python script unchanged (as ``__main__``), then say which libmpi this process mapped.

    python3 report_libmpi.py SCRIPT [ARGS...]

For tests of unmodified user scripts: the script is not edited, and afterwards one line
``libmpi-mapped rank=R path=P[,P...]`` tells where the MPI library really came from
(``/proc/self/maps``), e.g. the host's, bound into a container.
"""

import os
import runpy
import sys


def mapped_libmpi() -> list[str]:
    paths = set()
    with open("/proc/self/maps", encoding="utf-8") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            name = os.path.basename(path)
            if name.startswith(("libmpi.so", "libmpich.so", "libmpi_mpifh")):
                paths.add(path)
    return sorted(p for p in paths if os.path.basename(p).startswith(("libmpi.so", "libmpich")))


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
    line = f"libmpi-mapped rank={rank} path={','.join(mapped_libmpi()) or 'none'}\n"
    os.write(sys.stdout.fileno(), line.encode())
