"""Several ``hpcai-launch export-onnx`` command lines in one process, so that torch, ONNX
Runtime and the exporter are imported once: ``export_onnx_several.py ARGS [:: ARGS ...]``
runs ``hpcai.launcher.cli.main(["export-onnx", *ARGS])`` for each group in turn and prints
one JSON line per group, ``{"rc": exit status, "stdout": what it printed}``; what they say on
stderr passes through. Exits 0 when every group did."""

from __future__ import annotations

import contextlib
import io
import json
import sys

from hpcai.launcher import cli


def main(argv: list[str]) -> int:
    groups: list[list[str]] = [[]]
    for arg in argv:
        if arg == "::":
            groups.append([])
        else:
            groups[-1].append(arg)
    worst = 0
    for args in groups:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rc = cli.main(["export-onnx", *args])
        print(json.dumps({"rc": rc, "stdout": out.getvalue()}), flush=True)
        worst = worst or rc
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
