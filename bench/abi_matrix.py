"""The ABI matrix of this machine, run for real, and its README table.

    python bench/abi_matrix.py run IMG [--out bench/results/abi_matrix-HOST.json]
    python bench/abi_matrix.py table bench/results/abi_matrix-HOST.json

``run`` asks ``hpcai-launch abi --container IMG --json`` for the predicted cells, then runs
every cell through ``hpcai-launch --mpi LABEL --container IMG``: the mpi4py cells with the
probe (2 ranks; each rank's libmpi from ``dladdr``), the Horovod cells with the unmodified
Horovod benchmark (tests/programs, 1 iteration). It records for each cell the prediction,
what happened (exit status, the libmpi every rank mapped, or the error line) and whether
they agree, with provenance. ``table`` renders the Markdown table of the README from it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROGRAMS = REPO / "tests" / "programs"
LOOPBACK = {"OMPI_MCA_btl_tcp_if_include": "lo", "OMPI_MCA_oob_tcp_if_include": "lo",
            "UCX_NET_DEVICES": "lo", "OMPI_MCA_btl": "self,tcp"}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMI_", "PMIX_", "SLURM_", "MPI4PY_"))
           and k not in ("LD_LIBRARY_PATH", "PYTHONPATH")}
    env.update(LOOPBACK, USER=env.get("USER", "root"))
    return env


def _run_cell(label: str, consumer: dict, image: str, work: Path) -> dict:
    cmd = ["hpcai-launch", "-N", "2", "--oversubscribe", "--mpi", label, "--container", image,
           "--"]
    if consumer["kind"] == "mpi4py":
        cmd += ["python3", "-m", "hpcai.launcher.probe", "--quiet", "--out", "out"]
    else:
        cmd += ["python3", "report_libmpi.py", "horovod_synthetic_benchmark.py",
                "--num-iters", "1", "--num-warmup-batches", "1", "--num-batches-per-iter", "1"]
    shutil.rmtree(work / "out", ignore_errors=True)
    p = subprocess.run(cmd, env=_env(), cwd=work, capture_output=True, text=True, timeout=600,
                       check=False)
    out: dict = {"exit": p.returncode}
    if p.returncode == 0 and consumer["kind"] == "mpi4py":
        out["libmpi"] = sorted({lib for f in (work / "out").glob("rank-*.json")
                                for lib in json.loads(f.read_text())["libmpi"]})
    elif p.returncode == 0:
        out["libmpi"] = sorted({line.split("path=")[1].split()[0] for line in
                                p.stdout.splitlines() if "libmpi-mapped" in line})
    else:
        errors = [x for x in p.stderr.splitlines() if x.startswith(("error:", "ImportError"))]
        out["error"] = errors[0] if errors else p.stderr.strip().splitlines()[-1:]
    return out


def run(image: str, out_path: Path | None) -> Path:
    matrix = json.loads(subprocess.run(
        ["hpcai-launch", "abi", "--container", image, "--json"], env=_env(),
        capture_output=True, text=True, check=True).stdout)
    consumers = {c["title"]: c for c in matrix["consumers"]}
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in ("report_libmpi.py", "horovod_synthetic_benchmark.py"):
            shutil.copy(PROGRAMS / name, work / name)
        for cell in matrix["cells"]:
            ran = _run_cell(cell["host"], consumers[cell["consumer"]], image, work)
            works = ran["exit"] == 0
            cells.append({**cell, "ran": ran, "agrees": works == (cell["verdict"] == "works")})
            print(f"{cell['host']:<20} {cell['consumer']:<40} predicted {cell['verdict']:<7} "
                  f"ran: exit {ran['exit']}", flush=True)
    record = {"provenance": {
        "host": socket.gethostname(), "date": datetime.datetime.now(
            datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": platform.python_version(), "image": image,
        "git": subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                              capture_output=True, text=True).stdout.strip()},
        "hosts": matrix["hosts"], "consumers": matrix["consumers"], "cells": cells}
    out_path = out_path or REPO / "bench" / "results" / f"abi_matrix-{socket.gethostname()}.json"
    out_path.write_text(json.dumps(record, indent=2) + "\n")
    return out_path


def table(path: Path) -> str:
    data = json.loads(path.read_text())
    consumers = [c["title"] for c in data["consumers"]]
    lines = ["| host MPI | ABIs | " + " | ".join(consumers) + " |",
             "|---|---|" + "---|" * len(consumers)]
    for host in data["hosts"]:
        label = f"{host['name']}@{host['version']}"
        row = [f"`{label}`", ", ".join(host["abis"])]
        for title in consumers:
            cell = next(c for c in data["cells"] if c["host"] == label and
                        c["consumer"] == title)
            mark = "works" if cell["ran"]["exit"] == 0 else "refused"
            if not cell["agrees"]:
                mark += " (**predicted " + cell["verdict"] + "**)"
            row.append(mark + ("" if cell["ran"]["exit"] == 0 else
                               f" (exit {cell['ran']['exit']})"))
        lines.append("| " + " | ".join(row) + " |")
    p = data["provenance"]
    lines.append(f"\nRun on {p['host']}, {p['date']}, git {p['git'][:10]}, with "
                 f"`bench/abi_matrix.py run`; every cell was launched.")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("image")
    r.add_argument("--out", type=Path)
    t = sub.add_parser("table")
    t.add_argument("json", type=Path)
    ns = p.parse_args(argv)
    if ns.cmd == "run":
        print(run(ns.image, ns.out))
    else:
        print(table(ns.json), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
