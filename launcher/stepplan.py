"""hpcai-launch plan-step -- srun [srun options] [...] hpcai-launch [options] -- CMD

Plans the srun step given after ``--`` once, here, as its rank 0 would plan it, before srun
starts: the job scripts of ``hpcai-launch sbatch`` run it on the batch host. It writes the
plan into the job directory (:func:`.job.jobplan.prepared_path`), says the plan's warnings,
and prints the file's path; the script sets ``HPCAI_PLAN`` to it for that step alone, and
every rank of the step starts from it (:func:`.job.jobplan.role`) without planning. An error is ``error:`` and
``hint:``, exit 2, and nothing is written. Where the job directory is node-local (the
site profile's ``job_dir_scope = "node"``) or cannot be written, it prints an empty line
and the ranks plan as they do without it.

Rank 0 of the step: the node list of the allocation (``--nodes=N``: its first N), srun's
``--ntasks-per-node=R`` ranks on each, started with srun's ``--mpi=`` plugin
(``SLURM_MPI_TYPE``) and its ``--kill-on-bad-exit``; the CPUs, MPI and libraries are those
of this node, the allocation's first, where rank 0 runs.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

from ..core.cli import Parser, split_command
from ..core.errors import UserError
from ..slurm.nodelist import expand_hostlist
from ..slurm.srun import read_srun_argv
from ..slurm.step import flag_in_argv
from .job import jobplan
from .job.rankenv import RankInfo, in_slurm_step

USAGE_HINT = "e.g. hpcai-launch plan-step -- srun --ntasks-per-node=2 hpcai-launch -- CMD"


def main(argv: list[str], parse: Callable) -> int:
    """``parse``: hpcai-launch's own option parser (:func:`.cli.parse`), for the wrapper."""
    head, step = split_command(argv)
    Parser(prog="hpcai-launch plan-step", description=__doc__, hint=USAGE_HINT).parse_args(head)
    env = dict(os.environ)
    if not env.get("SLURM_JOB_ID") or in_slurm_step(env):
        raise UserError("plan-step plans the srun step of a batch job, but this is "
                        + ("inside an srun step" if env.get("SLURM_JOB_ID")
                           else "not inside a Slurm allocation (no SLURM_JOB_ID)"),
                        "run it in the job script, before srun (hpcai-launch sbatch writes "
                        "such a script)")
    try:
        srun, program = read_srun_argv(step or [])
    except ValueError:
        raise UserError("plan-step needs the srun line after '--'", USAGE_HINT) from None
    at = next((i for i, w in enumerate(program)
               if os.path.basename(w) == "hpcai-launch"), None)
    if at is None:
        raise UserError("the srun line does not run hpcai-launch: there is no rank plan to "
                        "write", USAGE_HINT)
    wrapper = program[at + 1:]
    options, ns = parse(wrapper)
    if ns.dry_run:
        raise UserError("the step's hpcai-launch has --dry-run: its ranks do not plan from a "
                        "plan file", "leave out --dry-run, or plan-step")
    info = _rank0(env, srun)
    if srun.get("mpi"):
        env["SLURM_MPI_TYPE"] = srun["mpi"]    # what srun sets in the ranks' environment
    where, scope = jobplan.job_dir(env, split_command(wrapper)[0])
    if scope == jobplan.NODE or not jobplan.writable(where):
        print()
        return 0
    from .planning.facts import gather_facts
    from .planning.plan import build_plan, key_files, rank_template

    facts = gather_facts(options, env, rank=info,
                         srun_kills=flag_in_argv(step or [], program))
    plan = build_plan(options, facts)
    for warning in plan.warnings:
        os.write(sys.stderr.fileno(), f"warning: {warning}\n".encode())
    job_id = env["SLURM_JOB_ID"]
    path = jobplan.prepared_path(env, split_command(wrapper)[0])
    role = jobplan.JobRole(info, path, True, tuple(wrapper), loud=True,
                           launch=jobplan.prepared_launch(job_id),
                           prepared=jobplan.prepared_key(job_id))
    key = jobplan.make_key(role, facts.env, facts.cwd, key_files(facts))
    jobplan.write(path, key, rank_template(options, facts))
    print(path)
    return 0


def _rank0(env: dict[str, str], srun: dict[str, str]) -> RankInfo:
    """Rank 0 of the step that ``srun``'s options start in this allocation."""
    per_node = srun.get("ntasks-per-node", "")
    if not per_node.isdigit() or int(per_node) < 1:
        raise UserError("the srun line has no --ntasks-per-node=R: plan-step cannot tell "
                        "the step's ranks", "give srun --ntasks-per-node=R")
    try:
        nodes = expand_hostlist(env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", "")))
    except ValueError:
        nodes = ()
    count = srun.get("nodes", "")
    if count.isdigit():
        nodes = nodes[:int(count)]
    if not nodes:
        raise UserError("the allocation's node list (SLURM_JOB_NODELIST) is empty or "
                        "unreadable", "run plan-step in a batch job script, before srun")
    rpn = int(per_node)
    return RankInfo(rank=0, size=rpn * len(nodes), local_rank=0, local_size=rpn, node_rank=0,
                    started_by="slurm", job_key=jobplan.prepared_key(env["SLURM_JOB_ID"]),
                    nodes=tuple(nodes))

