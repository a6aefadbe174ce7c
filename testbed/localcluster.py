"""A throw-away Slurm cluster on this one machine, for tests and for trying hpcai.

``LocalCluster`` creates a temporary directory, makes its own munge key there (never the
host's) and writes a ``slurm.conf``, and starts ``munged``, ``slurmctld`` and one ``slurmd``
per node, all on private ports bound to 127.0.0.1 (netns mode: to addresses inside its own
namespaces). Three shapes:

- ``LocalCluster()`` (``fake_nodes=0``): the real node, named after this host, with
  ``task/affinity`` so Slurm binds the tasks itself;
- ``LocalCluster(fake_nodes=K, cpus_per_node=C)``: nodes ``n1`` .. ``nK``, each a
  ``slurmd -N nX`` on this same machine (``task/none``: nobody but the program binds);
- ``LocalCluster(fake_nodes=K, netns=True)``: the same nodes, each in network and UTS
  namespaces of its own with its own address on a private bridge, host name = node name,
  node names resolving to those addresses (``testbed/netns.py``); slurmctld and every client
  command run in the bridge's namespace (:meth:`LocalCluster.run` enters it), MPI is pinned
  to the bridge's subnet instead of loopback.

Use it as a context manager; ``.env`` holds what to add to the environment (``SLURM_CONF``
and the MPI interface settings) and ``.run(argv)`` runs a client command with it.
On exit it stops exactly the processes it started, by PID, and removes the directory.

From a shell::

    python testbed/localcluster.py --nodes 2 [--netns]
    # prints: export SLURM_CONF=/tmp/hpcai-slurm-.../slurm.conf ; waits for Ctrl-C
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from netns import CONTROLLER, NODE_IF, NodeNetwork

DAEMONS = ("munged", "slurmctld", "slurmd")
LOOPBACK = "127.0.0.1"
_SBIN = ("/usr/sbin", "/usr/local/sbin", "/sbin")


class LocalClusterError(RuntimeError):
    """The cluster could not be started (the message carries the daemon logs' tails)."""


def find_program(name: str) -> str | None:
    """``name`` on PATH or in the sbin directories (daemons often live outside PATH)."""
    path = os.pathsep.join([os.environ.get("PATH", os.defpath), *_SBIN])
    return shutil.which(name, path=path)


def missing_programs() -> list[str]:
    """Daemons and clients a LocalCluster needs that are not installed."""
    return [name for name in (*DAEMONS, "srun", "sinfo") if find_program(name) is None]


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports that are free on 127.0.0.1 right now."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((LOOPBACK, 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _tail(path: Path, lines: int = 20) -> str:
    try:
        text = path.read_text(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    return "\n".join(text[-lines:]) or "(empty)"


def _clean_environ() -> dict[str, str]:
    """os.environ without the variables of any job or cluster we may be running inside."""
    return {k: v for k, v in os.environ.items()
            if not k.startswith(("SLURM_", "SLURMD_", "SRUN_", "SBATCH_", "SALLOC_"))}


class LocalCluster:
    """munged + slurmctld + slurmd(s) under a temporary directory, stopped on exit."""

    def __init__(self, fake_nodes: int = 0, cpus_per_node: int | None = None,
                 partition: str = "debug", start_timeout: float = 60.0,
                 base_dir: str | None = None, keep: bool = False,
                 netns: bool = False) -> None:
        if fake_nodes < 0:
            raise ValueError("fake_nodes must be >= 0")
        if netns and not fake_nodes:
            raise ValueError("netns needs fake_nodes")
        self.fake_nodes = fake_nodes
        self.cpus_per_node = cpus_per_node
        self.partition = partition
        self.start_timeout = start_timeout
        self.keep = keep
        self._base_dir = base_dir
        self.hostname = socket.gethostname().split(".")[0]
        self.dir: Path | None = None
        self.conf: Path | None = None
        self.nodes: list[str] = []
        self.start_seconds: float | None = None
        self.munge_key: Path | None = None
        self._procs: list[tuple[str, subprocess.Popen]] = []
        self._logs: dict[str, Path] = {}      # daemon -> its log file
        self.netns = netns
        self.network: NodeNetwork | None = None   # netns mode: the nodes' namespaces

    # --- public --------------------------------------------------------------------------

    @property
    def env(self) -> dict[str, str]:
        """Variables to add to a client's environment."""
        if self.conf is None:
            raise LocalClusterError("cluster not started")
        env = {
            "SLURM_CONF": str(self.conf),
            "OMPI_MCA_btl_tcp_if_include": "lo",
            "OMPI_MCA_oob_tcp_if_include": "lo",
            "UCX_NET_DEVICES": "lo",
        }
        if self.network is not None:
            # Inside the namespaces, lo is each node's own: MPI goes over the bridge.
            env.update(OMPI_MCA_btl_tcp_if_include=self.network.subnet,
                       OMPI_MCA_oob_tcp_if_include=self.network.subnet,
                       UCX_NET_DEVICES=NODE_IF)
        if self.fake_nodes:
            # The fake nodes share /dev/shm: Open MPI's shared-memory BTL would mix them up.
            env["OMPI_MCA_btl"] = "self,tcp"
        return env

    @property
    def processes(self) -> list[tuple[str, subprocess.Popen]]:
        """(name, process) of every daemon this object started and has not stopped yet."""
        return list(self._procs)

    def client_env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """os.environ + :attr:`env` + ``extra``, with any inherited job variables removed."""
        env = _clean_environ()
        env.update(self.env)
        env.update(extra or {})
        return env

    def client_argv(self, argv: list[str], cwd: str | os.PathLike | None = None,
                    where: str = CONTROLLER) -> list[str]:
        """``argv`` as run against this cluster: in netns mode entered into the namespace
        of the controller (or of node ``where``), in ``cwd``."""
        if self.network is None:
            return list(argv)
        return [*self.network.prefix(where, cwd), *argv]

    def run(self, argv: list[str], timeout: float = 120.0, env: dict[str, str] | None = None,
            cwd: str | None = None, check: bool = False,
            unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
        """Run a client command (argv list, never a shell) against this cluster.

        ``env`` is added on top of :meth:`client_env`; names in ``unset`` are removed.
        Output is captured as text. Raises ``subprocess.TimeoutExpired`` after ``timeout``
        seconds (the command is killed, and any job it left behind is cancelled).
        """
        if isinstance(argv, (str, bytes)):
            raise TypeError("argv must be a list of strings, not a shell string")
        full_env = self.client_env(env)
        for name in unset:
            full_env.pop(name, None)
        try:
            return subprocess.run(self.client_argv(argv, cwd), env=full_env, cwd=cwd,
                                  capture_output=True, text=True, timeout=timeout,
                                  check=check)
        except subprocess.TimeoutExpired:
            self.cancel_all()
            raise

    def cancel_all(self) -> None:
        """Cancel every job of this cluster (only this cluster: our SLURM_CONF)."""
        if self.conf is None or not self._alive("slurmctld"):
            return
        scancel = find_program("scancel")
        if scancel:
            subprocess.run(self.client_argv([scancel, "--full", "--quiet", "--user",
                                             str(os.getuid())]),
                           env=self.client_env(), capture_output=True, timeout=20,
                           check=False)

    def log_tails(self, lines: int = 20) -> str:
        """The last lines of every daemon log, for error messages."""
        parts = []
        for name, _ in self._procs:
            # The log file, or what the daemon wrote to stderr when it died before opening it.
            path = self._logs.get(name)
            if path is None or not path.exists() or path.stat().st_size == 0:
                path = self._stdout_path(name)
            parts.append(f"--- {name} ({path}) ---\n{_tail(path, lines)}")
        return "\n".join(parts)

    def __enter__(self) -> "LocalCluster":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- start ---------------------------------------------------------------------------

    def start(self) -> "LocalCluster":
        missing = missing_programs()
        if missing:
            raise LocalClusterError(f"not installed: {', '.join(missing)} "
                                    "(apt-get install slurm-wlm munge)")
        t0 = time.monotonic()
        self.dir = Path(tempfile.mkdtemp(prefix="hpcai-slurm-", dir=self._base_dir))
        os.chmod(self.dir, 0o755)  # munged needs search permission for all up to its socket
        try:
            if self.netns:
                self.network = NodeNetwork([f"n{i}" for i in range(1, self.fake_nodes + 1)],
                                           self.dir).start()
            self._start_munged()
            self._write_conf()
            self._start_slurm()
            self.wait_idle(self.start_timeout)
        except BaseException:
            self.stop()
            raise
        self.start_seconds = time.monotonic() - t0
        return self

    def _start_munged(self) -> None:
        assert self.dir is not None
        mdir = self.dir / "munge"
        mdir.mkdir()
        os.chmod(mdir, 0o755)  # munged refuses a socket directory of mode 0700
        key = mdir / "munge.key"
        self._make_munge_key(key)
        self.munge_key = key
        self.munge_socket = mdir / "munge.sock"
        log = mdir / "munged.log"   # munged --foreground logs to stderr instead
        self._spawn("munged", [find_program("munged") or "munged", "--foreground",
                               f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--pid-file={mdir / 'munged.pid'}", f"--log-file={log}",
                               f"--seed-file={mdir / 'munged.seed'}"])
        self._wait_for(lambda: self.munge_socket.exists(), 15, "munged socket")

    @staticmethod
    def _make_munge_key(key: Path) -> None:
        """A key of this cluster's own (never the host's ``/etc/munge/munge.key``: a test
        cluster must not be able to mint credentials the host's Slurm would accept):
        ``mungekey --create``, or 1024 random bytes where mungekey is missing (munge < 0.5.14).
        Mode 0400, as munged requires."""
        mungekey = find_program("mungekey")
        made = mungekey is not None and subprocess.run(
            [mungekey, "--create", f"--keyfile={key}"], capture_output=True, timeout=30,
            check=False).returncode == 0 and key.exists()
        if not made:
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)

    def _write_conf(self) -> None:
        assert self.dir is not None
        d = self.dir
        for sub in ("state", "spool", "log", "run", "tmp"):
            (d / sub).mkdir()
        n_ports = 1 + max(self.fake_nodes, 1)
        ctld_port, *node_ports = free_ports(n_ports)
        cpus = self.cpus_per_node or len(os.sched_getaffinity(0))
        lines = [
            "# written by testbed/localcluster.py; removed when the cluster stops",
            "ClusterName=hpcai-local",
            f"SlurmctldHost={self._controller()}",
            f"SlurmctldPort={ctld_port}",
            # Job IDs differ between clusters running at once on this host: under srun, Open
            # MPI names its shared-memory segments after the Slurm job, so two clusters'
            # "job 1" on the same host would map each other's segments and crash.
            f"FirstJobId={ctld_port * 1000}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket}",
            "ProctrackType=proctrack/linuxproc",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "MailProg=/bin/true",
            "ReturnToService=2",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=60",
            "InactiveLimit=0",
            "KillWait=5",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            f"StateSaveLocation={d / 'state'}",
            f"SlurmctldPidFile={d / 'run' / 'slurmctld.pid'}",
            f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
        ]
        if self.fake_nodes:
            k = self.fake_nodes
            self.nodes = [f"n{i}" for i in range(1, k + 1)]
            for name in self.nodes:
                (d / "spool" / name).mkdir()
                (d / "tmp" / name).mkdir()
            lines += [
                "TaskPlugin=task/none",
                "SlurmdParameters=config_overrides",
                f"SlurmdPort={node_ports[0]}",
                f"SlurmdSpoolDir={d / 'spool' / '%n'}",
                f"TmpFS={d / 'tmp' / '%n'}",
                f"SlurmdPidFile={d / 'run' / 'slurmd-%n.pid'}",
                f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
            ]
            # One line per node: each slurmd needs its own free port.
            lines += [f"NodeName={name} {self._node_address(name)} "
                      f"Port={port} CPUs={cpus} State=UNKNOWN"
                      for name, port in zip(self.nodes, node_ports)]
        else:
            self.nodes = [self.hostname]
            (d / "spool" / "slurmd").mkdir()
            lines += [
                "TaskPlugin=task/affinity",
                f"SlurmdPort={node_ports[0]}",
                f"SlurmdSpoolDir={d / 'spool' / 'slurmd'}",
                f"TmpFS={d / 'tmp'}",
                f"SlurmdPidFile={d / 'run' / 'slurmd.pid'}",
                f"SlurmdLogFile={d / 'log' / 'slurmd.log'}",
                f"NodeName={self.hostname} NodeAddr={LOOPBACK} CPUs={cpus} State=UNKNOWN",
            ]
        lines.append(f"PartitionName={self.partition} Nodes=ALL Default=YES "
                     "MaxTime=INFINITE State=UP OverSubscribe=NO")
        self.conf = d / "slurm.conf"
        self.conf.write_text("\n".join(lines) + "\n")

    def _controller(self) -> str:
        if self.network is not None:
            return f"{CONTROLLER}({self.network.controller_address})"
        return f"{self.hostname}({LOOPBACK})"

    def _node_address(self, name: str) -> str:
        if self.network is not None:
            return f"NodeHostname={name} NodeAddr={self.network.addresses[name]}"
        return f"NodeHostname={self.hostname} NodeAddr={LOOPBACK}"

    def _start_slurm(self) -> None:
        assert self.dir is not None and self.conf is not None
        log = self.dir / "log"
        self._logs["slurmctld"] = log / "slurmctld.log"
        conf = ["-f", str(self.conf)]
        self._spawn("slurmctld", self.client_argv(
            [find_program("slurmctld") or "slurmctld", "-D", "-i", *conf], self.dir))
        slurmd = find_program("slurmd") or "slurmd"
        if self.fake_nodes:
            for name in self.nodes:
                self._logs[f"slurmd {name}"] = log / f"slurmd-{name}.log"
                self._spawn(f"slurmd {name}", self.client_argv(
                    [slurmd, "-D", "-N", name, *conf], self.dir, where=name))
        else:
            self._logs["slurmd"] = log / "slurmd.log"
            self._spawn("slurmd", [slurmd, "-D", *conf])

    def _spawn(self, name: str, argv: list[str]) -> None:
        assert self.dir is not None
        out = open(self._stdout_path(name), "wb")
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                    stderr=subprocess.STDOUT, env=_clean_environ(),
                                    cwd=str(self.dir), start_new_session=True)
        finally:
            out.close()
        self._procs.append((name, proc))

    def _stdout_path(self, name: str) -> Path:
        assert self.dir is not None
        return self.dir / f"{name.replace(' ', '-')}.out"

    def _alive(self, name: str) -> bool:
        return any(n == name and p.poll() is None for n, p in self._procs)

    def _check_daemons(self) -> None:
        dead = [f"{n} (pid {p.pid}) exited with {p.returncode}"
                for n, p in self._procs if p.poll() is not None]
        if dead:
            raise LocalClusterError("daemon died: " + "; ".join(dead) + "\n"
                                    + self.log_tails())

    def _wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            self._check_daemons()
            time.sleep(0.1)
        raise LocalClusterError(f"timed out after {timeout:.0f} s waiting for {what}\n"
                                + self.log_tails())

    def node_states(self) -> dict[str, str]:
        """``{node: state}`` as sinfo reports it (empty if the controller does not answer)."""
        sinfo = find_program("sinfo") or "sinfo"
        try:
            out = subprocess.run(self.client_argv([sinfo, "-h", "-N", "-o", "%N %T"]),
                                 env=self.client_env(),
                                 capture_output=True, text=True, timeout=10, check=False)
        except subprocess.TimeoutExpired:
            return {}
        states: dict[str, str] = {}
        if out.returncode == 0:
            for line in out.stdout.splitlines():
                parts = line.split()
                if len(parts) == 2:
                    states[parts[0]] = parts[1]
        return states

    def wait_idle(self, timeout: float = 60.0) -> None:
        """Block until every node is idle; LocalClusterError with the logs otherwise."""
        last: dict[str, str] = {}

        def idle() -> bool:
            nonlocal last
            last = self.node_states()
            states = {s.rstrip("*~#$@%!^-").lower() for s in last.values()}
            broken = states & {"inval", "drain", "drained", "draining", "fail", "failing"}
            if broken:   # the node was rejected (e.g. its CPUs differ from the hardware)
                raise LocalClusterError(f"node(s) rejected by slurmctld: {last}\n"
                                        + self.log_tails())
            return set(last) == set(self.nodes) and states == {"idle"}
        try:
            self._wait_for(idle, timeout, f"nodes {','.join(self.nodes)} to be idle")
        except LocalClusterError as exc:
            raise LocalClusterError(f"{exc.args[0]}\nsinfo said: {last or '(nothing)'}") \
                from None

    # --- stop ----------------------------------------------------------------------------

    def stop(self, grace: float = 10.0) -> None:
        """Stop the daemons this object started (SIGTERM, wait, SIGKILL) and clean up."""
        if self._procs:
            try:
                self.cancel_all()
            except (OSError, subprocess.SubprocessError):
                pass
        # slurmd first, then slurmctld, then munged (reverse start order).
        for _, proc in reversed(self._procs):
            if proc.poll() is None:
                try:
                    proc.send_signal(signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + grace
        for _, proc in reversed(self._procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    proc.kill()
                except ProcessLookupError:
                    pass
                proc.wait(timeout=10)
        self._procs.clear()
        if self.network is not None:
            self.network.stop()
            self.network = None
        if self.dir is not None and not self.keep:
            shutil.rmtree(self.dir, ignore_errors=True)
        if not self.keep:
            self.dir = None
            self.conf = None

    def describe(self) -> str:
        where = "" if self.network is None else (
            " at " + ", ".join(f"{n}={a}" for n, a in self.network.addresses.items()))
        return (f"{len(self.nodes)} node(s) {','.join(self.nodes)}{where} in {self.dir}, "
                f"daemons pids " + ", ".join(f"{n}={p.pid}" for n, p in self._procs))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python testbed/localcluster.py",
        description="Start a private Slurm cluster on this machine until Ctrl-C.")
    parser.add_argument("--nodes", type=int, default=0,
                        help="fake nodes n1..nK on this machine (default 0: the real node)")
    parser.add_argument("--cpus-per-node", type=int, default=None,
                        help="CPUs per node (default: this machine's usable CPUs)")
    parser.add_argument("--timeout", type=float, default=60.0,
                        help="seconds to wait for the nodes to be idle")
    parser.add_argument("--netns", action="store_true",
                        help="each fake node in its own network namespace, with its own "
                             "address (needs root)")
    args = parser.parse_args(argv)
    cluster = LocalCluster(fake_nodes=args.nodes, cpus_per_node=args.cpus_per_node,
                           start_timeout=args.timeout, netns=args.netns)

    def _interrupt(signum, frame):
        raise KeyboardInterrupt
    # Also when started in the background of a script (SIGINT then arrives ignored).
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, _interrupt)
    try:
        cluster.start()
    except LocalClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    try:
        print(f"# Slurm is up ({cluster.start_seconds:.1f} s): {cluster.describe()}",
              flush=True)
        for key, value in cluster.env.items():
            print(f"export {key}={value}", flush=True)
        if cluster.network is not None:
            print("# run clients in the controller's namespace: "
                  + " ".join(cluster.client_argv(["srun", "..."], "DIR")), flush=True)
        elif cluster.fake_nodes:
            print("# fake node names do not resolve here: a torch rendezvous needs "
                  "MASTER_ADDR=127.0.0.1 (or --netns: nodes that resolve)", flush=True)
        print("# e.g.: srun -N {} --ntasks-per-node 2 --mpi=pmix hpcai-launch "
              "--ranks-per-node 2 -- python -m hpcai.launcher.probe".format(
                  max(args.nodes, 1)), flush=True)
        print("# Ctrl-C stops the cluster", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
        print("# stopped", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
