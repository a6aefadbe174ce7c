"""The outer hpcai-launch plans its ranks too, where mpirun starts them all on its host.

Without this, rank 0 of an mpirun launch plans again (:mod:`.job.jobplan`): a second Python
start-up with the planner's imports and facts, while the other ranks wait for its file. When
the launch is mpirun or mpiexec on this host alone (no ``--hosts``), the outer launcher has
the same facts: it plans rank 0's part as that rank would
(:func:`.planning.plan.rank_template_with_warnings`, for the wrapper's own options, in the
environment mpirun gives the ranks), writes it to the job directory keyed ``launch:TOKEN``,
exports ``HPCAI_PLAN`` and ``HPCAI_PLAN_LAUNCH`` to the ranks, which read it at once and exec,
and says the warnings rank 0 would say. The ranks check the key as they do for
``plan-step``'s plans: another command line, world size, directory or changed MPI is an
error, another environment or CPU count makes a rank plan by itself. Where the job directory
cannot be written, or the plan would cover other hosts, nothing changes: rank 0 plans.
``--dry-run`` writes nothing and shows the plan without these two variables.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from .job import jobplan
from .job.rankenv import RankInfo, job_nodes
from .planning.facts import Facts, gather_facts
from .planning.options import Options
from .planning.plan import LaunchPlan, build_plan, key_files, rank_template_with_warnings, wrapper_argv

STARTED_BY = {"openmpi": "openmpi", "mpich": "hydra"}   # MPI family -> RankInfo.started_by


def prepare(options: Options, facts: Facts, plan: LaunchPlan,
            parse: Callable) -> tuple[LaunchPlan, str | None]:
    """(the plan to carry out, the path of the ranks' plan written for it, or None when
    the ranks plan as before). ``parse``: hpcai-launch's option parser, for the wrapper's
    options."""
    if plan.mode != "mpirun" or options.hosts or facts.mpi is None:
        return plan, None
    started_by = STARTED_BY.get(facts.mpi.flavour.family)
    site = ("--site", options.site) if options.site else ()
    where, _ = jobplan.job_dir(facts.env, site)
    if started_by is None or not jobplan.writable(where):
        return plan, None
    token = os.urandom(8).hex()
    path = os.path.join(where, f"plan-launch_{token}.json")
    ready = build_plan(options, facts, prepared=(path, token))
    rpn = ready.placement.ranks_per_node
    wrapper = tuple(wrapper_argv(options, rpn, facts.container))
    rank_options, _ = parse(list(wrapper))
    info = RankInfo(rank=0, size=rpn, local_rank=0, local_size=rpn, node_rank=0,
                    started_by=started_by, job_key=jobplan.outer_key(token),
                    nodes=job_nodes(facts.env))
    rank_facts = gather_facts(rank_options, {**facts.env, **ready.env_dict()}, rank=info)
    role = jobplan.JobRole(info, path, True, wrapper, loud=True,
                           launch=jobplan.outer_launch(token), prepared=jobplan.outer_key(token))
    key = jobplan.make_key(role, rank_facts.env, rank_facts.cwd, key_files(rank_facts))
    template, warnings = rank_template_with_warnings(rank_options, rank_facts)
    try:
        os.makedirs(where, exist_ok=True)
        jobplan.write(path, key, template)
    except OSError:
        return plan, None
    for warning in warnings:   # rank 0 would say them; it no longer plans
        os.write(sys.stderr.fileno(), f"warning: {warning}\n".encode())
    return ready, path
