"""Start-up per rank: today's design (every rank plans) against plan-once-per-job, measured
side by side, then modelled for 3,072 and 24,576 ranks.

Each rank's ``hpcai-launch`` is started as ranks really start it: by ``srun`` on the
project's private Slurm (4 fake nodes x 4 ranks) and by ``mpirun`` (4 ranks), for a
container job whose planning finds, collects and stages the host MPI (the image passes every
pre-flight check; ``ch-run`` is ``/bin/true``, so each wrapper's work ends at its exec).
Per design and launcher: one run under ``strace -f -y`` counts each rank's file-system calls
by place (:mod:`startup_trace`): the wrapper's own work on paths that a site would share
(home and hpcai's cache in it, the job directory, the image, the host MPI tree), the code the
interpreter loads (hpcai's package; the Python runtime), and node-local paths; then
``--trials`` untraced runs per side, alternating which side goes first, give each rank's wall
and CPU time (``wait4`` of the wrapper, children included). "Old" is the tree at ``--old``
(the commit before plan-once), imported the same way (PYTHONPATH, compiled bytecode).

The model: all ranks start at once and their metadata operations on shared storage queue at
one metadata server of ``metadata_ops_per_s`` (the site profile's, default 20000):
old = rank wall + N x ops/rank / rate; new = planner wall + planner ops / rate + rank wall +
(N - 1) x ops/rank / rate. Arithmetic from measured per-rank figures, not a run at scale.

    python bench/startup.py [--trials 5] [--old COMMIT] [--site FILE]
    python bench/startup.py --render bench/results/startup-<hostname>.json   # tables only

writes ``bench/results/startup-<hostname>.json`` and prints the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests"))

from localcluster import LocalCluster  # noqa: E402
from startup_trace import Places, parse  # noqa: E402
from test_startup import _image  # noqa: E402

from common import alternating_order, provenance  # noqa: E402
from hpcai.launcher.job.site import DEFAULT_METADATA_OPS_PER_S, SiteProfile  # noqa: E402

OLD_COMMIT = "5583ab8"        # main before plan-once-per-job (issue 18)
TRACE = str(REPO / "tests" / "startup_trace.py")
MODEL_RANKS = (3072, 24576)
TARGETS = {"shared_calls_per_rank": 20, "wrapper_cpu_ms_per_rank": 50}
NODES, PER_NODE, MPIRUN_RANKS = 4, 4, 4
SHARED = ("job dir", "hpcai cache", "image", "host MPI tree", "home")
INSTALL = ("hpcai code", "venv")                # what hpcai's install puts on shared storage
CODE = (*INSTALL, "python runtime")
LIB = "/usr/lib/x86_64-linux-gnu/"
HOST_MPI = tuple(LIB + d for d in (
    "openmpi", "ucx", "libibverbs", "pmix", "libmpi*", "libopen-*", "libpmix*", "libucp*",
    "libucs*", "libuct*", "libucm*", "libibverbs*", "librdmacm*", "libfabric*", "libhwloc*",
    "libevent*", "libmca*")) + ("/usr/bin/mpirun*", "/usr/bin/orterun*", "/usr/bin/mpiexec*",
                                "/etc/openmpi")


def _sh(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    lines = (done.stdout.strip() or done.stderr.strip()).splitlines()
    return lines[0] if lines else ""


def _tree(ref: str, root: Path) -> Path:
    """An importable ``hpcai`` of commit ``ref`` (PYTHONPATH dir), compiled."""
    tree = root / f"tree-{ref}"
    tree.mkdir()
    archive = subprocess.run(["git", "-C", str(REPO), "archive", ref], capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(tree)], input=archive, check=True)
    return _importable(tree, root / f"pp-{ref}")


def _importable(tree: Path, pp: Path) -> Path:
    pp.mkdir()
    (pp / "hpcai").symlink_to(tree)
    subprocess.run([sys.executable, "-m", "compileall", "-q", "-x", r"/\.venv/|/\.git/",
                    str(tree)], check=True,
                   capture_output=True)
    where = subprocess.run([sys.executable, "-c", "import hpcai; print(hpcai.__file__)"],
                           env={**os.environ, "PYTHONPATH": str(pp)}, capture_output=True,
                           text=True, check=True).stdout.strip()
    if not where.startswith(str(pp)):
        raise SystemExit(f"PYTHONPATH={pp} imports hpcai from {where}, not {tree}")
    return pp


class Bench:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.image = _image(root / "img")
        fake = root / "fakebin"
        fake.mkdir()
        (fake / "ch-run").symlink_to("/bin/true")
        self.path = f"{fake}:{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"
        self.home = Path.home()

    def env(self, pp: Path, tag: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("HPCAI_", "MASTER_", "PYTHONDONTWRITEBYTECODE", "I_MPI_"))}
        env.update(PATH=self.path, PYTHONPATH=str(pp), HPCAI_CACHE=str(self.root / f"cache-{tag}"),
                   HPCAI_JOB_DIR=str(self.root / f"jobs-{tag}"), OMPI_MCA_btl_tcp_if_include="lo",
                   OMPI_MCA_oob_tcp_if_include="lo", UCX_NET_DEVICES="lo")
        return env

    def places(self, pp: Path, tag: str) -> Places:
        venv = {sys.prefix, os.path.realpath(sys.prefix)}
        prefixes = {os.path.realpath(sys.base_prefix), sys.base_prefix}
        prefixes |= {p for p in sys.path if "site-packages" in p and
                     not any(p.startswith(v + "/") for v in venv)}
        return Places((
            ("job dir", (str(self.root / f"jobs-{tag}"),)),
            ("hpcai cache", (str(self.root / f"cache-{tag}"),)),
            ("image", (str(self.image),)),
            ("venv", tuple(sorted(venv))),
            ("hpcai code", (str(pp), os.path.realpath(pp / "hpcai"))),
            ("host MPI tree", HOST_MPI),
            ("python runtime", tuple(sorted(prefixes))),
            ("home", (str(self.home),)),
            ("system library dirs", ("/usr/lib", "/lib", "/usr/lib64", "/lib64")),
        ))

    def wrapper(self, mode: str, out: Path) -> list[str]:
        return [sys.executable, TRACE, mode, str(out), "--", "hpcai-launch", "--oversubscribe",
                "--container", str(self.image), "--", "python3", "-c", "pass"]

    def run(self, launcher: str, cluster: LocalCluster, pp: Path, tag: str, mode: str,
            n: int) -> Path:
        out = Path(tempfile.mkdtemp(prefix=f"{tag}-{launcher}-{mode}-", dir=self.root))
        shutil.rmtree(self.root / f"jobs-{tag}", ignore_errors=True)
        env = self.env(pp, tag)
        if launcher == "srun":
            result = cluster.run(["srun", "-N", str(NODES), "--ntasks-per-node", str(PER_NODE),
                                  "--mpi=pmix", "--kill-on-bad-exit=1",
                                  *self.wrapper(mode, out)], timeout=600, env=env,
                                 cwd=str(self.root))
        else:
            result = subprocess.run(["mpirun.openmpi", "--allow-run-as-root", "--oversubscribe",
                                     "-n", str(n), *self.wrapper(mode, out)], env=env,
                                    cwd=str(self.root), capture_output=True, text=True,
                                    timeout=600, check=False)
        if result.returncode != 0 or len(list(out.glob("rank-*"))) != n:
            raise SystemExit(f"{tag} {launcher} {mode} failed:\n{result.stdout}\n{result.stderr}")
        return out


def _counts(out: Path, places: Places, n: int) -> dict:
    ranks = {}
    for r in range(n):
        t = parse((out / f"rank-{r}.trace").read_text(), places, "ch-run")
        if not t.reached_exec:
            raise SystemExit(f"rank {r}: the trace does not reach the exec of ch-run")
        ranks[r] = t.to_dict()
    return ranks


def _times(outs: list[Path], n: int) -> dict[int, list[dict]]:
    per: dict[int, list[dict]] = {r: [] for r in range(n)}
    for out in outs:
        for r in range(n):
            per[r].append(json.loads((out / f"rank-{r}.json").read_text()))
    return per


def _stats(values: list[float]) -> dict:
    return {"n": len(values), "median": statistics.median(values), "min": min(values),
            "max": max(values)}


def _summary(counts: dict, times: dict[int, list[dict]]) -> dict:
    """Rank 0 (the planner in the new design) and the others, separately."""
    def total(rank: dict, cats: tuple[str, ...], key: str) -> int:
        return sum(rank[key].get(c, 0) for c in cats)

    out = {}
    for who, ranks in (("rank 0", [0]), ("other ranks", [r for r in counts if r != 0])):
        out[who] = {
            "shared_calls": _stats([total(counts[r], SHARED, "calls") for r in ranks]),
            "shared_metadata": _stats([total(counts[r], SHARED, "metadata") for r in ranks]),
            "install_calls": _stats([total(counts[r], INSTALL, "calls") for r in ranks]),
            "install_metadata": _stats([total(counts[r], INSTALL, "metadata") for r in ranks]),
            "code_calls": _stats([total(counts[r], CODE, "calls") for r in ranks]),
            "code_metadata": _stats([total(counts[r], CODE, "metadata") for r in ranks]),
            "all_calls": _stats([sum(counts[r]["calls"].values()) for r in ranks]),
            "programs": sorted({p for r in ranks for p in counts[r]["programs"]}),
            "cpu_s": _stats([t["cpu_s"] for r in ranks for t in times[r]]),
            "wall_s": _stats([t["wall_s"] for r in ranks for t in times[r]]),
        }
    return out


def model(summary: dict, design: str, rate: int) -> list[dict]:
    """Shared metadata ops per job and the predicted start-up at ``rate`` ops/s: the
    wrapper's own work; with hpcai's install tree (package and venv) on shared storage too;
    and with the Python runtime as well."""
    r0, rest = summary["rank 0"], summary["other ranks"]
    rows = []
    for n in MODEL_RANKS:
        row = {"ranks": n, "design": design}
        for label, extra in (("own", ()), ("with_install", ("install_metadata",)),
                             ("with_code", ("code_metadata",))):
            def ops(who: dict) -> float:
                return who["shared_metadata"]["median"] + sum(who[k]["median"] for k in extra)
            if design == "old":
                total = n * ops(rest)
                seconds = rest["wall_s"]["median"] + total / rate
            else:
                total = ops(r0) + (n - 1) * ops(rest)
                seconds = (r0["wall_s"]["median"] + ops(r0) / rate + rest["wall_s"]["median"]
                           + (n - 1) * ops(rest) / rate)
            row[f"metadata_ops_{label}"] = round(total)
            row[f"startup_s_{label}"] = round(seconds, 2)
        rows.append(row)
    return rows


def verdicts(measured: dict, targets: dict) -> list[dict]:
    """Each target against the new design's non-planning ranks, per launcher: met when
    the worst rank (calls) or the median trial (CPU) is within it."""
    out = []
    for launcher in ("srun", "mpirun"):
        w = measured[f"{launcher}/new"]["other ranks"]
        checks = (("shared file-system calls per rank (wrapper's own work), worst rank",
                   w["shared_calls"]["max"], targets["shared_calls_per_rank"]),
                  ("wrapper CPU ms per rank, median",
                   round(1000 * w["cpu_s"]["median"], 1), targets["wrapper_cpu_ms_per_rank"]))
        for what, value, target in checks:
            out.append({"launcher": launcher, "what": what, "value": value, "target": target,
                        "verdict": "met" if value <= target else "missed"})
    return out


def render(result: dict) -> str:
    from render import render_table
    return render_table(result, "startup-<host>.json")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--old", default=OLD_COMMIT)
    p.add_argument("--site", help="site profile: its metadata_ops_per_s")
    p.add_argument("--render", metavar="JSON", help="print the tables of a result file only")
    args = p.parse_args()
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return 0
    site = SiteProfile.load(args.site) if args.site else None
    rate = site.metadata_ops_per_s if site else DEFAULT_METADATA_OPS_PER_S
    info = provenance()
    root = Path(tempfile.mkdtemp(prefix="hpcai-startup-"))
    try:
        bench = Bench(root)
        trees = {"old": _tree(args.old, root),
                 "new": _importable(REPO, root / "pp-new")}
        measured, raw = {}, {}
        with LocalCluster(fake_nodes=NODES, cpus_per_node=PER_NODE) as cluster:
            for launcher, n in (("srun", NODES * PER_NODE), ("mpirun", MPIRUN_RANKS)):
                counts = {d: _counts(bench.run(launcher, cluster, pp, d, "trace", n),
                                     bench.places(pp, d), n) for d, pp in trees.items()}
                outs: dict[str, list[Path]] = {d: [] for d in trees}
                for d in alternating_order(list(trees), args.trials):
                    outs[d].append(bench.run(launcher, cluster, trees[d], d, "time", n))
                for d in trees:
                    measured[f"{launcher}/{d}"] = _summary(counts[d], _times(outs[d], n))
                    raw[f"{launcher}/{d}"] = counts[d]
        srun = {d: measured[f"srun/{d}"] for d in trees}
        result = {
            "benchmark": "startup",
            "provenance": {
                **info,
                "old_commit": _sh("git", "-C", str(REPO), "rev-parse", args.old),
                "strace": _sh("strace", "-V"),
                "slurm": _sh("dpkg-query", "-W", "-f", "${Package} ${Version}", "slurm-wlm"),
                "load_average_at_end": os.getloadavg(),
                "workload": "charliecloud container job, host Open MPI found, collected and "
                            "staged by the planning rank(s); ch-run replaced by /bin/true",
            },
            "categories": {"shared (wrapper's own work)": SHARED, "code loading": CODE},
            "metadata_ops_per_s": rate,
            "rate_source": f"site profile {args.site}" if args.site else
                           "default (no site profile)",
            "targets": TARGETS,
            "verdicts": verdicts(measured, TARGETS),
            "settings": {"srun": f"{NODES} fake nodes x {PER_NODE} ranks",
                         "mpirun": f"{MPIRUN_RANKS} ranks, one node",
                         "timed trials per side": args.trials,
                         "order": "alternating (A B B A ...)", "old": args.old},
            "trials": {k: v["other ranks"]["cpu_s"]["n"] for k, v in measured.items()},
            "measured": measured,
            "model": [*model(srun["old"], "old", rate), *model(srun["new"], "new", rate)],
            "per_rank_counts": raw,
        }
        result["model"].sort(key=lambda row: (row["ranks"], row["design"] != "old"))
        out = REPO / "bench" / "results" / f"startup-{socket.gethostname()}.json"
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(render(result))
        print(f"\nwritten: {out} (python bench/render.py puts it into README.md)")
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
