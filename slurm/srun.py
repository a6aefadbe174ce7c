"""The one ``srun`` line: used by ``hpcai-launch`` inside an allocation and by sbatch scripts.

One rule for both. Slurm counts a CPU as a hardware thread, so each rank asks for whole
cores: ``--cpus-per-task`` = cores per rank x hardware threads per core, and srun binds
the task to those cores (``--cpu-bind=cores``). The per-rank ``hpcai-launch`` then narrows
the binding to the CPUs it planned on the compute node's real topology (the node that
renders the line, a login node for sbatch, may not have the compute nodes' layout, so no
CPU mask is written here). When the ranks cannot have cores of their own (oversubscribed),
srun does not bind and is told to overcommit. ``--kill-on-bad-exit=1``: a rank that dies
ends the step instead of leaving the others waiting in a collective. Where the allocation
has GPUs as GRES, srun gives each task its GPUs (``--gpus-per-task``) nearest its cores
(``--gpu-bind=closest``).
"""

from __future__ import annotations

from ..core.record import record

# srun, sent SIGTERM, cancels its step at once: the tasks are killed before they can catch a
# signal. SIGUSR1 it passes on to every task and waits for them (Slurm 22.05, measured:
# tests/test_slurm.py). So hpcai-launch, when it runs srun itself, relays SIGTERM as this.
STOP_SIGNAL = "SIGUSR1"


@record
class SrunStep:
    """The shape of one srun step."""

    ranks_per_node: int
    cores_per_rank: int
    threads_per_core: int = 1        # hardware threads per core of the compute nodes
    nodes: int | None = None         # None: every node of the allocation
    pmi: str | None = None           # srun --mpi= plugin; None: the site's default
    oversubscribed: bool = False
    gpus_per_task: int | None = None  # Slurm binds GPUs (GRES): --gpu-bind=closest too

    @property
    def cpus_per_task(self) -> int:
        return self.cores_per_rank * self.threads_per_core


def srun_argv(step: SrunStep, program: list[str]) -> list[str]:
    """``srun [options] PROGRAM...`` (pure)."""
    argv = ["srun"]
    if step.pmi:
        argv.append(f"--mpi={step.pmi}")
    if step.nodes:
        argv.append(f"--nodes={step.nodes}")
    argv += [f"--ntasks-per-node={step.ranks_per_node}",
             f"--cpus-per-task={step.cpus_per_task}"]
    argv += ["--cpu-bind=none", "--overcommit"] if step.oversubscribed else ["--cpu-bind=cores"]
    if step.gpus_per_task:
        argv += [f"--gpus-per-task={step.gpus_per_task}", "--gpu-bind=closest"]
    argv.append("--kill-on-bad-exit=1")
    return [*argv, *program]


def read_srun_argv(argv: list[str] | tuple[str, ...]) -> tuple[dict[str, str], list[str]]:
    """``srun [options] PROGRAM...`` -> (srun's ``--name[=value]`` options, PROGRAM...); the
    reverse of :func:`srun_argv` (pure). Short options and an option's value given as the
    next word are not read: the program would start at that word."""
    if not argv or argv[0].rsplit("/", 1)[-1] != "srun":
        raise ValueError("not an srun line")
    options: dict[str, str] = {}
    for i, word in enumerate(argv[1:], 1):
        if not word.startswith("-"):
            return options, list(argv[i:])
        name, _, value = word.lstrip("-").partition("=")
        options[name] = value
    return options, []
