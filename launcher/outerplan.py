"""The outer hpcai-launch plans its ranks too, where mpirun starts them all on its host.

Without this, rank 0 of an mpirun launch plans again (:mod:`.job.jobplan`): a second Python
start-up with the planner's imports and facts, while the other ranks wait for its file. When
the launch is mpirun or mpiexec on this host alone (no ``--hosts``), the outer launcher has
the same facts: it plans every local rank's part as rank 0 would
(:func:`.planning.plan.rank_template_with_warnings`, for the wrapper's own options, in the
environment mpirun gives the ranks) and says the warnings rank 0 would say. Then:

- **Open MPI, no container, no** ``--report-bindings``: no ``hpcai-launch`` runs in the ranks
  at all. mpirun gets one app context per rank (:func:`.planning.plan.direct_mpirun_plan`)
  that starts the rank's command with its variables and, where it is bound, under
  ``taskset -c CPUS``. mpirun ends the job when a rank fails, as it does after a wrapper's
  exec; ``--dry-run`` shows this line. Without ``taskset`` on PATH the next way is used.
- **Otherwise** (MPICH and Intel MPI, whose ranks' wrappers watch them; containers;
  ``--report-bindings``): the plan is written to the job directory keyed ``launch:TOKEN``,
  and ``HPCAI_PLAN`` and ``HPCAI_PLAN_LAUNCH`` tell the ranks' wrappers to read it at once
  and exec. The ranks check the key as they do for ``plan-step``'s plans: another command
  line, world size, directory or changed MPI is an error, another environment or CPU count
  makes a rank plan by itself. Where the job directory cannot be written, nothing changes:
  rank 0 plans. ``--dry-run`` writes nothing and shows the plan without these two variables.

Where the plan would cover other hosts, nothing changes either.
"""

from __future__ import annotations

import os
import sys

from ..core.paths import which
from .job import jobplan
from .job.rankenv import RankInfo, job_nodes
from .node.topology import format_cpulist
from .planning.facts import Facts, gather_facts
from .planning.options import Options
from .planning.plan import (LaunchPlan, build_plan, direct_mpirun_plan, key_files,
                            rank_template_with_warnings, wrapper_argv)

TYPE_CHECKING = False     # typing's constant, without importing typing
if TYPE_CHECKING:
    from collections.abc import Callable

STARTED_BY = {"openmpi": "openmpi", "mpich": "hydra"}   # MPI family -> RankInfo.started_by


def prepare(options: Options, facts: Facts, plan: LaunchPlan, parse: Callable,
            dry_run: bool = False) -> tuple[LaunchPlan, str | None]:
    """(the plan to carry out, the path of the ranks' plan written for it, or None when
    none was written). ``parse``: hpcai-launch's option parser, for the wrapper's options.
    ``dry_run``: write nothing and say nothing (the plan file's way then changes nothing)."""
    if plan.mode != "mpirun" or options.hosts or facts.mpi is None:
        return plan, None
    started_by = STARTED_BY.get(facts.mpi.flavour.family)
    if started_by is None:
        return plan, None
    token = os.urandom(8).hex()
    if started_by == "openmpi" and facts.container is None and not options.report_bindings:
        direct = _direct(options, facts, plan, parse, token)
        if direct is not None:
            if not dry_run:
                _say(direct.warnings)
            return direct, None
    if dry_run:
        return plan, None
    site = ("--site", options.site) if options.site else ()
    where, _ = jobplan.job_dir(facts.env, site)
    if not jobplan.writable(where):
        return plan, None
    path = os.path.join(where, f"plan-launch_{token}.json")
    ready = build_plan(options, facts, prepared=(path, token))
    role, rank_facts, template, warnings = _rank_side(options, facts, ready, parse,
                                                      started_by, token, path)
    key = jobplan.make_key(role, rank_facts.env, rank_facts.cwd, key_files(rank_facts))
    try:
        os.makedirs(where, exist_ok=True)
        jobplan.write(path, key, template)
    except OSError:
        return plan, None
    _say(warnings)      # rank 0 would say them; it no longer plans
    return ready, path


def _rank_side(options: Options, facts: Facts, plan: LaunchPlan, parse: Callable,
               started_by: str, token: str, path: str = ""):
    """(rank 0's role, its facts, the node's template, its warnings), planned here in the
    environment mpirun gives the ranks of ``plan``."""
    rpn = plan.placement.ranks_per_node
    wrapper = tuple(wrapper_argv(options, rpn, facts.container))
    rank_options, _ = parse(list(wrapper))
    info = RankInfo(rank=0, size=rpn, local_rank=0, local_size=rpn, node_rank=0,
                    started_by=started_by, job_key=jobplan.outer_key(token),
                    nodes=job_nodes(facts.env))
    rank_facts = gather_facts(rank_options, {**facts.env, **plan.env_dict()}, rank=info)
    role = jobplan.JobRole(info, path, True, wrapper, loud=True,
                           launch=jobplan.outer_launch(token), prepared=jobplan.outer_key(token))
    template, warnings = rank_template_with_warnings(rank_options, rank_facts)
    return role, rank_facts, template, warnings


def _direct(options: Options, facts: Facts, plan: LaunchPlan, parse: Callable,
            token: str) -> LaunchPlan | None:
    """The plan whose mpirun starts the ranks' commands itself, or None without
    ``taskset`` where the ranks are bound."""
    role, rank_facts, template, warnings = _rank_side(options, facts, plan, parse,
                                                      "openmpi", token)
    taskset = which("taskset", facts.env.get("PATH"))
    if taskset is None and any(r.bind_cpus is not None for r in template.ranks):
        return None
    given = rank_facts.env      # what every rank gets from mpirun's own environment
    ranks = []
    for local in range(len(template.ranks)):
        info = role.info._replace(rank=local, local_rank=local)
        argv, env, cpus = jobplan.for_rank(template, info, given)
        if cpus is not None:
            argv = (taskset, "-c", format_cpulist(cpus), *argv)
        ranks.append((argv, {k: v for k, v in env.items() if given.get(k) != v}))
    return direct_mpirun_plan(plan, facts.hostname, facts.uid == 0, tuple(ranks), warnings,
                              template.compat_links)


def _say(warnings: tuple[str, ...]) -> None:
    for warning in warnings:
        os.write(sys.stderr.fileno(), f"warning: {warning}\n".encode())
