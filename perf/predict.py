"""hpcai-launch predict: time per step, samples/s and weak-scaling efficiency before the job.

    hpcai-launch predict --tune tune.json --nodes 1,2,4,...,1024
                         [--ranks-per-node R --threads-per-rank T]   (default: tune's best)
                         [--site FILE | --latency-us A --bandwidth-gbit-s B | --tune-network]
                         [--topology fat-tree|shared-host] [--epoch-samples E]
                         [--sweep RESULTS] [--out DIR]

The compute model and the shared-memory link come from ``tune``'s measurements; the network
from the site profile's ``[network]`` table, the command line, or (``--tune-network``) the
TCP link tune measured on this host. ``shared-host``: the nodes are fake nodes of this one
host (tests/localcluster.py); each places its ranks on the host's real topology, so rank k
of every node is bound to the same cores (n nodes: n times the compute per core), and every
rank, even within a node, talks through the network transport (that cluster sets
``OMPI_MCA_btl=self,tcp``).

Writes ``prediction.{md,csv,json,png}`` into ``--out`` (default ``.``): the table and plot
of ``hpcai-launch report`` (weak scaling: per-rank batch fixed, epoch fixed), plus per node
count the step's compute and allreduce seconds and the allreduce algorithm. With
``--sweep RESULTS`` the measured rows of that sweep are drawn beside the predicted ones and
a comparison table gives predicted against measured samples/s and efficiency; the epoch of
each measured row (its samples/s x time per epoch) is used for the predicted time per epoch.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from ..core.cli import Parser, run_main
from ..core.errors import UserError
from ..launcher.job.site import TOPOLOGIES, NetworkSpec, SiteProfile
from ..launcher.batch import report
from ..launcher.batch.sweep import parse_counts
from .model import LinkCost, StepPrediction, oversubscription, predict_step
from .result import TuneResult
from .tune import rank_layouts


@dataclass(frozen=True)
class Comparison:
    nodes: int
    predicted_samples_per_s: float
    measured_samples_per_s: float
    predicted_efficiency: float     # step(n0) / step(n)
    measured_efficiency: float      # samples/s(n) n0 / (samples/s(n0) n)

    @property
    def error(self) -> float:
        return self.predicted_samples_per_s / self.measured_samples_per_s - 1


def _parser() -> Parser:
    p = Parser(prog="hpcai-launch predict",
               description="Predict scaling from tune's measurements and a network.")
    p.add_argument("--tune", required=True, metavar="FILE", help="tune's JSON")
    p.add_argument("--nodes", required=True, help="node counts, e.g. 1,2,4,8")
    p.add_argument("--ranks-per-node", "-N", type=int, help="default: tune's first choice")
    p.add_argument("--threads-per-rank", "-t", type=int, help="default: tune's first choice")
    p.add_argument("--site", help="site profile with a [network] table")
    p.add_argument("--latency-us", type=float, help="network latency (alpha), microseconds")
    p.add_argument("--bandwidth-gbit-s", type=float, help="network bandwidth, Gbit/s")
    p.add_argument("--tune-network", action="store_true",
                   help="use the TCP link tune measured on this host as the network")
    p.add_argument("--topology", choices=TOPOLOGIES, help="default fat-tree (or the site's)")
    p.add_argument("--epoch-samples", type=int, help="samples per epoch (default: tune's)")
    p.add_argument("--sweep", metavar="RESULTS", help="a sweep's results to overlay")
    p.add_argument("--out", default=".", help="where prediction.* go (default .)")
    return p


def network(ns, tune: TuneResult) -> tuple[LinkCost, str, str]:
    """(link, topology, where it came from) from exactly one source."""
    given = [name for name, on in (("--site", ns.site), ("--tune-network", ns.tune_network),
                                   ("--latency-us/--bandwidth-gbit-s",
                                    ns.latency_us is not None or ns.bandwidth_gbit_s is not None))
             if on]
    hint = ("give one of: --site FILE (with a [network] table), --latency-us A "
            "--bandwidth-gbit-s B, or --tune-network (tune's measured TCP link)")
    if len(given) != 1:
        raise UserError("no network description" if not given else
                        f"two network descriptions: {' and '.join(given)}", hint)
    if ns.site:
        site = SiteProfile.load(ns.site)
        if site.network is None:
            raise UserError(f"site profile {ns.site} has no [network] table", hint)
        spec = site.network
        source = f"site profile {site.name}"
    elif ns.tune_network:
        if tune.net is None:
            raise UserError(f"{ns.tune} has no measured network link (tune ran with --no-net)",
                            "rerun tune without --no-net, or describe the network")
        return tune.net.cost, ns.topology or "fat-tree", "measured by tune (TCP)"
    else:
        if ns.latency_us is None or ns.bandwidth_gbit_s is None:
            raise UserError("--latency-us and --bandwidth-gbit-s go together", hint)
        if not (ns.latency_us >= 0 and ns.bandwidth_gbit_s > 0):
            raise UserError("--latency-us must be 0 or more and --bandwidth-gbit-s positive",
                            "e.g. --latency-us 1.0 --bandwidth-gbit-s 100")
        spec = NetworkSpec(ns.latency_us, ns.bandwidth_gbit_s, ns.topology or "fat-tree")
        source = "command line"
    link = LinkCost.from_spec(spec.latency_us * 1e-6, spec.bandwidth_gbit_s * 1e9 / 8)
    return link, ns.topology or spec.topology, source


def predict(tune: TuneResult, nodes: list[int], ranks: int, threads: int, net: LinkCost,
            topology: str) -> list[StepPrediction]:
    fit = tune.compute_fit()
    shared = topology == "shared-host"
    steps = []
    for n in nodes:
        per_sample = fit.s_per_sample(threads, ranks)
        if shared:   # every fake node binds its ranks to the same cores of the one host
            per_sample *= n * oversubscription(ranks * threads, tune.cores)
        steps.append(predict_step(per_sample, tune.batch_per_rank, tune.buckets, n, ranks,
                                  threads, net if shared else tune.shm.cost, net))
    return steps


def rows(tune: TuneResult, steps: list[StepPrediction],
         epoch_of: dict[int, float]) -> list[report.Row]:
    """Report rows for the predicted steps; ``epoch_of[nodes]``: samples per epoch."""
    out = []
    for s in steps:
        rate = s.nodes * s.ranks_per_node * tune.batch_per_rank / s.step_s
        time_s = epoch_of[s.nodes] / rate
        out.append(report.Row(
            nodes=s.nodes, ranks_per_node=s.ranks_per_node, threads_per_rank=s.threads_per_rank,
            scaling="weak", runs=0, epochs=0, time_s=time_s, time_min_s=time_s,
            linear_s=math.nan, efficiency=math.nan, samples_per_s=rate,
            pflops=rate * tune.flops_per_sample / 1e15, pct_of_peak=math.nan,
            points=[], notes=[f"predicted: step {s.step_s:.4g} s = compute {s.compute_s:.4g} "
                              f"+ allreduce {s.comm_s:.3g} ({s.algorithm})"]))
    base = out[0]
    for row in out:
        row.linear_s = base.time_s * base.nodes / row.nodes
        row.efficiency = row.linear_s / row.time_s
    return out


def compare(steps: list[StepPrediction], measured: list[report.Row], batch: int,
            ranks: int, threads: int) -> list[Comparison]:
    mine = sorted((r for r in measured if (r.ranks_per_node, r.threads_per_rank, r.scaling)
                   == (ranks, threads, "weak")), key=lambda r: r.nodes)
    by_nodes = {s.nodes: s for s in steps}
    mine = [r for r in mine if r.nodes in by_nodes]
    if not mine:
        return []
    base_m, base_p = mine[0], by_nodes[mine[0].nodes]
    out = []
    for r in mine:
        s = by_nodes[r.nodes]
        out.append(Comparison(
            r.nodes, r.nodes * ranks * batch / s.step_s, r.samples_per_s,
            base_p.step_s / s.step_s,
            r.samples_per_s * base_m.nodes / (base_m.samples_per_s * r.nodes)))
    return out


def render(steps: list[StepPrediction], table: str, comparisons: list[Comparison],
           source: str, topology: str, net: LinkCost) -> str:
    lines = [table.replace("# Scaling report", "# Predicted scaling", 1).rstrip(), "",
             f"Network: {source}, {topology}, alpha {net.alpha_s * 1e6:.3g} us, "
             f"bandwidth {net.bandwidth_bytes_s * 8 / 1e9:.3g} Gbit/s.", "",
             "| nodes | step (s) | compute (s) | allreduce (s) | algorithm | bound |",
             "|---:|---:|---:|---:|---|---|"]
    for s in steps:
        lines.append(f"| {s.nodes} | {s.step_s:.4g} | {s.compute_s:.4g} | {s.comm_s:.3g} | "
                     f"{s.algorithm} | {s.bound} |")
    if comparisons:
        lines += ["", "## Predicted against measured", "",
                  "| nodes | predicted samples/s | measured samples/s | difference | "
                  "predicted efficiency | measured efficiency |",
                  "|---:|---:|---:|---:|---:|---:|"]
        for c in comparisons:
            lines.append(f"| {c.nodes} | {c.predicted_samples_per_s:.4g} | "
                         f"{c.measured_samples_per_s:.4g} | {100 * c.error:+.1f} % | "
                         f"{100 * c.predicted_efficiency:.1f} % | "
                         f"{100 * c.measured_efficiency:.1f} % |")
    return "\n".join(lines) + "\n"


def run(argv: list[str]) -> int:
    ns = _parser().parse_args(argv)
    nodes = parse_counts(ns.nodes, "--nodes")
    if ns.epoch_samples is not None and ns.epoch_samples < 1:
        raise UserError("--epoch-samples must be at least 1", "e.g. --epoch-samples 2000")
    tune = TuneResult.load(ns.tune)
    link, topology, source = network(ns, tune)
    if (ns.ranks_per_node is None) != (ns.threads_per_rank is None):
        raise UserError("--ranks-per-node and --threads-per-rank go together",
                        "give both, or neither for tune's first choice")
    if ns.ranks_per_node is None:
        best = rank_layouts(tune, tune.cores)[0]
        ranks, threads = best.ranks, best.threads
    else:
        ranks, threads = ns.ranks_per_node, ns.threads_per_rank
        if ranks < 1 or threads < 1:
            raise UserError("--ranks-per-node and --threads-per-rank must be at least 1",
                            "e.g. --ranks-per-node 4 --threads-per-rank 12")
    site_memory = SiteProfile.load(ns.site).memory_per_node_gb if ns.site else None
    memory = site_memory * 1e9 if site_memory else tune.memory_bytes
    if tune.mem_bytes_per_rank() * ranks > memory:
        raise UserError(f"{ranks} ranks x {tune.mem_bytes_per_rank() / 2**30:.2f} GiB do not "
                        f"fit in {memory / 2**30:.1f} GiB per node",
                        "use fewer --ranks-per-node")
    measured: list[report.Row] = []
    if ns.sweep:
        measured, problems = report.collect(ns.sweep)
        for problem in problems:
            print(f"warning: {problem}", file=sys.stderr)
    steps = predict(tune, nodes, ranks, threads, link, topology)
    epoch_of = {r.nodes: r.samples_per_s * r.time_s for r in measured
                if (r.ranks_per_node, r.threads_per_rank) == (ranks, threads)}
    default = ns.epoch_samples or tune.epoch_samples
    missing = [n for n in nodes if n not in epoch_of and default is None]
    if missing:
        raise UserError(f"no epoch size for {len(missing)} node count(s) "
                        f"({', '.join(map(str, missing))})",
                        "give --epoch-samples E (samples per epoch, all ranks together)")
    epoch_of = {n: epoch_of.get(n, default) for n in nodes}
    table_rows = rows(tune, steps, epoch_of)
    comparisons = compare(steps, measured, tune.batch_per_rank, ranks, threads)
    text = render(steps, report.render_markdown(table_rows, []), comparisons, source,
                  topology, link)
    out = Path(ns.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / "prediction.md").write_text(text, encoding="utf-8")
        report.write_csv(table_rows, out / "prediction.csv")
        doc = {"network": {"source": source, "topology": topology, **asdict(link)},
               "steps": [{**asdict(s), "step_s": s.step_s, "bound": s.bound} for s in steps],
               "rows": [asdict(r) for r in table_rows],
               "comparison": [{**asdict(c), "error": c.error} for c in comparisons],
               "tune": str(ns.tune), "tune_provenance": tune.provenance}
        (out / "prediction.json").write_text(json.dumps(doc, indent=1) + "\n",
                                             encoding="utf-8")
        report.plot(table_rows, out / "prediction.png", measured=measured or None)
    except OSError as exc:
        raise UserError(f"cannot write into {out}: {exc.strerror or exc}",
                        "give a writable --out DIR") from exc
    print(text, end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_main(run, argv)
