"""Who am I? Read a rank's identity from whatever started it, and translate it.

Sources, in order: Open MPI (``OMPI_COMM_WORLD_*``), Hydra (MPICH, Intel MPI:
``PMI_RANK`` + ``MPI_LOCALRANKID``), a Slurm step (``SLURM_PROCID`` ...), and bare PMIx
or PMI (``PMIX_RANK``, ``PMI_RANK``/``PMI_SIZE`` with Slurm's node layout). The result is
turned into the variables ``torch.distributed``'s ``env://`` and Horovod read.
"""

from __future__ import annotations

import zlib

from ...core.record import named_tuple

TYPE_CHECKING = False     # typing's constant, without importing typing
if TYPE_CHECKING:
    from collections.abc import Mapping

PORT_BASE = 20000    # the rendezvous ports stay below Linux's ephemeral range (32768-60999)
PORT_SPAN = 12763    # a prime: every step multiplier below it permutes the ports
STEP_STRIDE = 7888   # round(PORT_SPAN / golden ratio): steps of nearby jobs land far apart


@named_tuple
class Starter:
    """What a launcher that starts ranks does when one of them fails before MPI starts."""

    ends_job: bool          # it ends the other ranks itself (mpirun; srun only with
                            # --kill-on-bad-exit, which plan.py warns about)
    abort_fd_var: str = ""  # else: the variable naming the PMI-1 socket through which a
                            # rank's wrapper can ask it to end the job (:mod:`.rankwatch`)


# RankInfo.started_by -> its launcher's behaviour, measured by tests/test_rankwatch.py: Open
# MPI's mpirun ends a job when a rank exits non-zero (4.1; 5.0.11's prterun too, but with a
# peer in MPI_Init it may crash or hang doing so); Hydra (MPICH 4.0, MPICH 5, Intel MPI 2021)
# does not, MPICH's ends it for a rank killed by a signal, Intel MPI's not even then; every
# Hydra ends it on a PMI abort.
STARTERS: dict[str, Starter] = {"openmpi": Starter(ends_job=True),
                                "hydra": Starter(ends_job=False, abort_fd_var="PMI_FD"),
                                "slurm": Starter(ends_job=False)}


@named_tuple
class RankInfo:
    rank: int
    size: int
    local_rank: int
    local_size: int
    node_rank: int
    started_by: str            # "openmpi", "hydra", "slurm"
    job_key: str               # unique per job (or step), for the rendezvous port
    nodes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"rank": self.rank, "size": self.size, "local_rank": self.local_rank,
                "local_size": self.local_size, "node_rank": self.node_rank,
                "started_by": self.started_by}


def _int(env: dict[str, str], *names: str) -> int | None:
    for name in names:
        value = env.get(name, "")
        if value.strip().lstrip("-").isdigit():
            return int(value)
    return None


def in_slurm_step(env: dict[str, str]) -> bool:
    """True inside an ``srun`` step (not merely inside an allocation or batch script)."""
    step = env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return step is not None and step.isdigit() and int(step) < 0xFFFFFFF0 \
        and "SLURM_PROCID" in env


def from_environ(env: dict[str, str], ppid: int = 0) -> RankInfo | None:
    """The rank's identity, or None when no MPI launcher or srun started this process.

    ``ppid`` (the Hydra proxy) keys the rendezvous port for plain MPICH, which exports no
    job id; it is node-local, so multi-node MPICH jobs outside Slurm need MASTER_PORT set.
    Inside a Slurm job, Hydra's proxies are one srun step: its job and step id key the port.
    mpirun and mpiexec inside a Slurm job put rank 0 on the job's first node, so the job's
    node list gives the rendezvous node as it does for srun.
    """
    if "OMPI_COMM_WORLD_RANK" in env:
        rank = _int(env, "OMPI_COMM_WORLD_RANK") or 0
        local_size = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE") or 1
        size = _int(env, "OMPI_COMM_WORLD_SIZE") or 1
        return RankInfo(rank=rank, size=size,
                        local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK") or 0,
                        local_size=local_size,
                        node_rank=_node_rank_blocked(rank, local_size),
                        started_by="openmpi",
                        job_key="ompi:" + env.get("OMPI_MCA_ess_base_jobid",
                                                  env.get("PMIX_NAMESPACE", "")),
                        nodes=job_nodes(env))
    if "PMI_RANK" in env and "MPI_LOCALRANKID" in env:
        rank = _int(env, "PMI_RANK") or 0
        local_size = _int(env, "MPI_LOCALNRANKS") or 1
        key = env.get("I_MPI_HYDRA_UUID") or _slurm_step_key(env) or f"hydra-ppid:{ppid}"
        return RankInfo(rank=rank, size=_int(env, "PMI_SIZE") or 1,
                        local_rank=_int(env, "MPI_LOCALRANKID") or 0, local_size=local_size,
                        node_rank=_node_rank_blocked(rank, local_size), started_by="hydra",
                        job_key=key, nodes=job_nodes(env))
    if in_slurm_step(env):
        node = _int(env, "SLURM_NODEID") or 0
        from ...slurm.nodelist import expand_hostlist, parse_tasks_per_node   # Slurm only
        per_node = parse_tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE",
                                                env.get("SLURM_TASKS_PER_NODE", "1")))
        nodes = expand_hostlist(env.get("SLURM_STEP_NODELIST", env.get("SLURM_NODELIST", "")))
        return RankInfo(rank=_int(env, "SLURM_PROCID") or 0,
                        size=_int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS") or 1,
                        local_rank=_int(env, "SLURM_LOCALID") or 0,
                        local_size=per_node[node] if node < len(per_node) else per_node[-1],
                        node_rank=node, started_by="slurm",
                        job_key=f"slurm:{env.get('SLURM_JOB_ID', '0')}."
                                f"{env.get('SLURM_STEP_ID', env.get('SLURM_STEPID', '0'))}",
                        nodes=nodes)
    return None


def abort_fd(info: RankInfo, env: Mapping[str, str]) -> int | None:
    """The PMI-1 socket through which this rank's wrapper aborts the job if the rank fails,
    where its launcher would not end the job itself (None: the wrapper execs the command)."""
    starter = STARTERS[info.started_by]
    text = env.get(starter.abort_fd_var, "") if not starter.ends_job else ""
    return int(text) if text.isdigit() and info.size > 1 else None


def _slurm_step_key(env: dict[str, str]) -> str | None:
    """``slurm:JOB.STEP`` when this process belongs to a Slurm step (else None)."""
    job, step = env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID", env.get("SLURM_STEPID"))
    return f"slurm:{job}.{step}" if job and step and step.isdigit() else None


def job_nodes(env: dict[str, str]) -> tuple[str, ...]:
    """The nodes of the Slurm job this process runs in (empty outside Slurm)."""
    text = env.get("SLURM_JOB_NODELIST", env.get("SLURM_NODELIST", ""))
    if not text:
        return ()
    from ...slurm.nodelist import expand_hostlist
    try:
        return expand_hostlist(text)
    except ValueError:
        return ()


def _node_rank_blocked(rank: int, local_size: int) -> int:
    """Node index for block mapping with equal ranks per node (what hpcai-launch plans)."""
    return rank // max(local_size, 1)


def rendezvous_port(job_key: str) -> int:
    """A port derived from the job identity: equal on all ranks, distinct between steps and
    between jobs as far as a range of 12763 ports allows.

    A Slurm step ``job.step`` gets ``20000 + (job + 7888 * step) mod 12763`` (20000-32762):

    - all steps of one job get distinct ports (12763 is prime, so ``step -> 7888 * step``
      is a permutation): no step ever reuses another's port, however many a job has;
    - the same step of two jobs collides only when their ids differ by a multiple of 12763;
    - steps of nearby jobs: two steps below 8 collide only for jobs at least 1151 ids
      apart, below 16 at least 440, below 64 at least 102 (7888 is the golden-ratio point
      of 12763, which keeps every ``k * 7888 mod 12763`` for small k far from 0).

    ``tests/test_rankenv.py`` checks these bounds exhaustively. Other launchers hash their
    job id into the same range (crc32; distinct jobs collide with probability 1/12763).
    """
    if job_key.startswith("slurm:"):
        job, _, step = job_key[6:].partition(".")
        if job.isdigit() and (step or "0").isdigit():
            return PORT_BASE + (int(job) + STEP_STRIDE * int(step or 0)) % PORT_SPAN
    return PORT_BASE + zlib.crc32(job_key.encode()) % PORT_SPAN


def torch_env(info: RankInfo, env: dict[str, str]) -> dict[str, str]:
    """``RANK``/``WORLD_SIZE``/... for torch.distributed env:// and friends.

    ``MASTER_ADDR``/``MASTER_PORT`` already in the environment win (hpcai-launch sets them
    when it starts mpirun itself); otherwise the first node of a Slurm step, or loopback
    when the whole job is on this node.
    """
    out = {
        "RANK": str(info.rank),
        "WORLD_SIZE": str(info.size),
        "LOCAL_RANK": str(info.local_rank),
        "LOCAL_WORLD_SIZE": str(info.local_size),
        "NODE_RANK": str(info.node_rank),
        "GROUP_RANK": str(info.node_rank),
    }
    addr = env.get("MASTER_ADDR")
    if not addr:
        if info.local_size == info.size:
            addr = "127.0.0.1"
        elif info.nodes:
            addr = info.nodes[0]
    if addr:
        out["MASTER_ADDR"] = addr
    out["MASTER_PORT"] = env.get("MASTER_PORT") or str(rendezvous_port(info.job_key))
    return out
