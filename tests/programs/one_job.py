"""Several test programs run one after the other in this one MPI job (one start-up of the
ranks, and one import of torch per rank, for all of them).

usage: one_job.py SPEC.json, SPEC a list of ``[NAME, PROGRAM, ARGS...]``: PROGRAM (a file in
tests/programs/) runs as ``__main__`` with ``sys.argv = [PROGRAM, ARGS...]``, in order. Every
line a part writes to stdout (``print`` or ``os.write(1, ...)``) is printed after the part
ends as ``NAME| LINE``, each with one write, then ``NAME| exit N``: N the status the program
would have exited with on its own (0, or its SystemExit's code). Stderr is left as it is.
The job exits 0 once every part has run.
"""

import json
import os
import runpy
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent


def part(name: str, program: str, args: list[str]) -> None:
    """Run one program with fd 1 redirected to a file; print its lines with ``NAME| ``."""
    sys.stdout.flush()
    saved = os.dup(1)
    with tempfile.TemporaryFile() as captured:
        os.dup2(captured.fileno(), 1)
        code = 0
        try:
            sys.argv = [str(HERE / program), *args]
            runpy.run_path(str(HERE / program), run_name="__main__")
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
        captured.seek(0)
        lines = captured.read().decode(errors="replace").splitlines()
    for line in [*lines, f"exit {code}"]:
        os.write(1, f"{name}| {line}\n".encode())


if __name__ == "__main__":
    for name, program, *args in json.loads(Path(sys.argv[1]).read_text()):
        part(name, program, args)
