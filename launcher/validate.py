"""hpcai-launch validate: prove, rank by rank, which MPI a containerised job really uses.

    hpcai-launch validate --container IMG [--runtime charliecloud] -N 2 [--json FILE]

Launches the real job shape - in the container with the planned bindings, then bare on
the host, alternated ``--repeat`` times (default 3; the best of each counts, since a shared
node's bandwidth wanders by 2-3x between runs) - running
``python3 -m hpcai.launcher.probe --bench``. Every rank reports its
rank and world size (catching N x "rank 0 of 1"), CPU affinity, ``MPI_Get_library_version``
and the paths of the libmpi / libfabric / libpsm2 / libucp / libnccl mapped into it (from
``/proc/self/maps``), then a ping-pong and an allreduce bandwidth probe. Prints a table,
writes a JSON report, and exits 1 if any rank loaded a libmpi other than the bound host one,
or the in-container bandwidth falls below ``--threshold`` x the host's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, replace
from pathlib import Path
from typing import Callable

from ..core.cli import Parser
from ..core.errors import UserError
from .containers import HOST_MOUNT
from .options import Options
from .probe import ProbeRecord

DEFAULT_THRESHOLD = 0.8
BENCH_KEYS = ("bandwidth_GBps", "allreduce_GBps")


def _split(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = Parser(prog="hpcai-launch validate", add_help=False, verbose_flag=False)
    parser.add_argument("--json", default="hpcai-validate.json")
    parser.add_argument("--threshold", type=float, default=DEFAULT_THRESHOLD)
    parser.add_argument("--repeat", type=int, default=3,
                        help="container and host probes, alternated; the best of each counts")
    parser.add_argument("--expect-libmpi", default=None,
                        help=f"path prefix every rank's libmpi must have (default: "
                             f"{HOST_MOUNT} when the host MPI is bound)")
    parser.add_argument("-h", "--help", action="store_true")
    ns, rest = parser.parse_known_args(argv)
    if ns.help:
        print(__doc__)
        raise SystemExit(0)
    return ns, rest


def _probe_run(options: Options, out_rel: str, python: str) -> tuple[int, str]:
    """Start the probe with these launch options; (exit code, stderr)."""
    probe = (python, "-m", "hpcai.launcher.probe", "--bench", "--quiet", "--out", out_rel)
    argv = [sys.executable, "-m", "hpcai.launcher", *replace(options, command=probe).to_argv()]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, check=False)
    return result.returncode, result.stderr


def bare(options: Options) -> Options:
    """The same launch on the host, without the container and what only it uses."""
    return replace(options, container=None, runtime="none", site=None, binds=(),
                   host_libs=None, bind_host_mpi=None)


def _best(kept: list[ProbeRecord], new: list[ProbeRecord]) -> list[ProbeRecord]:
    """Keep the run with the higher ping-pong bandwidth (its allreduce figure too: best of)."""
    if not kept:
        return new
    if not new:
        return kept
    for key in BENCH_KEYS:
        a, b = (kept[0].bench or {}).get(key), (new[0].bench or {}).get(key)
        if a is not None and b is not None and b > a:
            kept[0].bench[key] = b
    return kept


def _records(directory: Path) -> list[ProbeRecord]:
    return [ProbeRecord.load(p) for p in sorted(directory.glob("rank-*.json"))]


def evaluate(container: list[ProbeRecord], host: list[ProbeRecord], *, expect_prefix: str | None,
             threshold: float) -> tuple[list[str], dict]:
    """Problems found (empty: valid) and the bandwidth ratios."""
    problems: list[str] = []
    size = len(container)
    ranks = sorted(r.rank for r in container)
    if ranks != list(range(size)) or any(r.size != size for r in container):
        problems.append(f"ranks do not form one world: ranks {ranks}, sizes "
                        f"{sorted({r.size for r in container})}")
    if expect_prefix:
        for r in container:
            libs = r.libraries["libmpi"]
            if not libs or not all(path.startswith(expect_prefix) for path in libs):
                problems.append(f"rank {r.rank} on {r.host} loaded {libs or 'no libmpi'}, "
                                f"not the host MPI under {expect_prefix}")
    ratios = {}
    if container and host:
        for key in BENCH_KEYS:
            inside = (container[0].bench or {}).get(key)
            bare = (host[0].bench or {}).get(key)
            if inside and bare:
                ratios[key] = inside / bare
                if inside / bare < threshold:
                    problems.append(f"{key} in the container is {inside:.2f}, "
                                    f"{inside / bare:.0%} of the host's {bare:.2f} "
                                    f"(threshold {threshold:.0%})")
    return problems, ratios


def table(records: list[ProbeRecord]) -> str:
    lines = [f"{'rank':>4} {'size':>4} {'host':12} {'cpus':8} {'libmpi':50} "
             f"{'fabric/psm2/ucp/nccl':24} MPI"]
    for r in sorted(records, key=lambda r: r.rank):
        libs = r.libraries
        others = ",".join(os.path.basename(p) for k in ("libfabric", "libpsm2", "libucp",
                                                         "libnccl") for p in libs[k]) or "-"
        lines.append(f"{r.rank:>4} {r.size:>4} {r.host[:12]:12} "
                     f"{r.affinity_list[:8]:8} {','.join(libs['libmpi'])[:50]:50} "
                     f"{others[:24]:24} {r.mpi_library_version[:40]}")
    return "\n".join(lines)


def main(argv: list[str],
         parse: Callable[[list[str]], tuple[Options, argparse.Namespace]]) -> int:
    """``parse``: hpcai-launch's own option parser (the launch options pass through it)."""
    ns, launch_args = _split(argv)
    options, _ = parse(launch_args)
    if options.container is None or options.runtime == "none":
        raise UserError("validate needs --container IMG",
                        "e.g. hpcai-launch validate --container ~/.cache/hpcai/images/"
                        "hpcai-bookworm -N 2")
    expect = ns.expect_libmpi or HOST_MOUNT   # validating means: the host MPI is loaded
    work = Path(tempfile.mkdtemp(prefix=".hpcai-validate-", dir=os.getcwd()))
    container: list[ProbeRecord] = []
    host: list[ProbeRecord] = []
    try:
        for trial in range(max(ns.repeat, 1)):
            inside_dir, host_dir = work / f"container-{trial}", work / f"host-{trial}"
            code, err = _probe_run(options, os.path.relpath(inside_dir), "python3")
            records = _records(inside_dir)
            if code != 0 and not records:
                sys.stderr.write(err)
                print("error: the containerised probe did not run (see above)",
                      file=sys.stderr)
                return 1
            container = _best(container, records)
            code_h, err_h = _probe_run(bare(options), os.path.relpath(host_dir),
                                       sys.executable)
            records_h = _records(host_dir)
            if code_h != 0 and not records_h:
                sys.stderr.write(err_h)
            host = _best(host, records_h)
        problems, ratios = evaluate(container, host, expect_prefix=expect,
                                    threshold=ns.threshold)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print("in the container:")
    print(table(container))
    if container and container[0].bench:
        b = container[0].bench
        hb = (host[0].bench or {}) if host else {}
        for key in ("latency_us", *BENCH_KEYS):
            if key in b:
                extra = f" (host {hb[key]:.2f}, ratio {b[key] / hb[key]:.2f})" if key in hb else ""
                print(f"  {key}: {b[key]:.2f}{extra}")
    report = {"valid": not problems, "problems": problems, "expected_libmpi_prefix": expect,
              "threshold": ns.threshold, "ratios": ratios,
              "container": [asdict(r) for r in container], "host": [asdict(r) for r in host]}
    Path(ns.json).write_text(json.dumps(report, indent=1))
    if problems:
        for problem in problems:
            print(f"FAIL: {problem}")
        print(f"report: {ns.json}")
        return 1
    print(f"OK: {len(container)} ranks, one world, host MPI loaded by every rank; report "
          f"{ns.json}")
    return 0
