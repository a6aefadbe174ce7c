"""Fake nodes with addresses of their own: one network namespace per node, on a bridge.

``NodeNetwork(["n1", "n2"], workdir)`` creates, without touching the machine's own network
or files:

- a *switch* namespace (network, mount and UTS; host name ``ctl``) holding the bridge and
  the controller's address ``.254``: slurmctld and every client command run there;
- one namespace per node (network and UTS; host name = node name) with one end of a veth
  pair on the bridge and the address ``.1``, ``.2``, ...: its slurmd and everything the
  node starts run there;
- a hosts file naming the controller and every node, bind-mounted over ``/etc/hosts`` in the
  switch's private mount namespace, which all daemons and clients share. Node names resolve
  as on a real cluster, the machine's ``/etc/hosts`` is never written, and the bind vanishes
  with the namespace.

Every namespace is held by a ``sleep`` started through ``unshare`` (no ``ip netns add``:
nothing is named system-wide), killed by :meth:`stop` or when the process that created it
dies. Addresses exist only inside these namespaces; nothing is routed out of them.
:meth:`prefix` is the ``nsenter`` argv that runs a command on a node or on the switch.
"""

from __future__ import annotations

import ctypes
import ipaddress
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

SUBNET = ipaddress.ip_network("10.211.0.0/24")
CONTROLLER = "ctl"
BRIDGE = "br0"
NODE_IF = "eth0"                   # the node's end of its veth pair
_PR_SET_PDEATHSIG = 1
TOOLS = ("unshare", "nsenter", "ip")


class NetnsError(RuntimeError):
    """The namespaces could not be made (the message is one line: the reason)."""


def missing() -> str | None:
    """Why no NodeNetwork can be made here (None: it can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    absent = [t for t in TOOLS if which(t) is None]
    return f"not installed: {', '.join(absent)} (apt-get install util-linux iproute2)" \
        if absent else None


def which(name: str) -> str | None:
    """``name`` on PATH or in the sbin directories."""
    return shutil.which(name, path=os.environ.get("PATH", os.defpath) + ":/usr/sbin:/sbin")


def _die_with_parent() -> None:
    """preexec_fn: the holder is killed when the process that started it dies."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


class NodeNetwork:
    """A bridge and one namespace per node (see the module docstring)."""

    def __init__(self, nodes: list[str], workdir: Path) -> None:
        self.nodes = list(nodes)
        self.workdir = workdir
        hosts = list(SUBNET.hosts())
        self.addresses = {name: str(hosts[i]) for i, name in enumerate(self.nodes)}
        self.controller_address = str(hosts[-1])
        self.hosts_file = workdir / "hosts"
        self._holders: dict[str, subprocess.Popen] = {}   # CONTROLLER or node -> holder

    @property
    def subnet(self) -> str:
        return str(SUBNET)

    def start(self) -> "NodeNetwork":
        reason = missing()
        if reason:
            raise NetnsError(reason)
        try:
            self._hold(CONTROLLER, ["--net", "--mount", "--uts", "--propagation", "private"])
            for name in self.nodes:
                self._hold(name, ["--net", "--uts"])
            self._wire()
        except BaseException:
            self.stop()
            raise
        return self

    def prefix(self, where: str = CONTROLLER, cwd: str | os.PathLike | None = None) -> list[str]:
        """``nsenter`` argv that runs a command on node ``where`` (or on the switch) in
        ``cwd`` (default: this process's), with the shared mount namespace (its /etc/hosts).
        Entering a mount namespace resets the directory, hence the explicit ``--wd``."""
        holder = self._holders[where].pid
        mount = self._holders[CONTROLLER].pid
        return [which("nsenter") or "nsenter", f"--net=/proc/{holder}/ns/net",
                f"--uts=/proc/{holder}/ns/uts", f"--mount=/proc/{mount}/ns/mnt",
                f"--wd={os.fspath(cwd) if cwd else os.getcwd()}", "--"]

    def stop(self) -> None:
        """Kill the holders; the namespaces, links, addresses and the bind go with the last
        process inside them."""
        for proc in self._holders.values():
            if proc.poll() is None:
                proc.kill()
        for proc in self._holders.values():
            proc.wait(timeout=10)
        self._holders.clear()

    # --- making it -------------------------------------------------------------------------

    def _hold(self, name: str, flags: list[str]) -> None:
        proc = subprocess.Popen([which("unshare") or "unshare", *flags, "sleep", "infinity"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
        self._holders[name] = proc
        # unshare execs sleep once the namespaces exist: wait for that exec.
        own = os.readlink(f"/proc/{os.getpid()}/ns/net")
        for _ in range(200):
            if proc.poll() is not None:
                raise NetnsError(f"unshare {' '.join(flags)} failed: "
                                 f"{proc.stderr.read().decode().strip()}")
            try:
                if os.readlink(f"/proc/{proc.pid}/ns/net") != own and \
                        Path(f"/proc/{proc.pid}/comm").read_text().strip() == "sleep":
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise NetnsError(f"unshare {' '.join(flags)} did not start in 10 s")

    def _in(self, where: str, *argv: str) -> None:
        pid = self._holders[where].pid
        cmd = [which("nsenter") or "nsenter", f"--net=/proc/{pid}/ns/net",
               f"--uts=/proc/{pid}/ns/uts", *argv]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=False)
        if result.returncode != 0:
            raise NetnsError(f"{' '.join(argv)} in namespace {where}: "
                             f"{(result.stderr or result.stdout).strip()}")

    def _wire(self) -> None:
        ip = which("ip") or "ip"
        prefixlen = SUBNET.prefixlen
        self._in(CONTROLLER, "hostname", CONTROLLER)
        self._in(CONTROLLER, ip, "link", "set", "lo", "up")
        self._in(CONTROLLER, ip, "link", "add", BRIDGE, "type", "bridge")
        self._in(CONTROLLER, ip, "addr", "add", f"{self.controller_address}/{prefixlen}",
                 "dev", BRIDGE)
        self._in(CONTROLLER, ip, "link", "set", BRIDGE, "up")
        for name in self.nodes:
            # Made inside the switch namespace, the node's end moved straight into the node's:
            # no interface ever exists in the machine's own namespace.
            self._in(CONTROLLER, ip, "link", "add", name, "type", "veth", "peer", "name",
                     NODE_IF, "netns", str(self._holders[name].pid))
            self._in(CONTROLLER, ip, "link", "set", name, "master", BRIDGE, "up")
            self._in(name, "hostname", name)
            self._in(name, ip, "link", "set", "lo", "up")
            self._in(name, ip, "addr", "add", f"{self.addresses[name]}/{prefixlen}", "dev",
                     NODE_IF)
            self._in(name, ip, "link", "set", NODE_IF, "up")
        lines = ["# written by testbed/netns.py, bound over /etc/hosts inside the test's "
                 "namespaces only", "127.0.0.1 localhost", "::1 localhost ip6-localhost",
                 f"{self.controller_address} {CONTROLLER}",
                 *(f"{addr} {name}" for name, addr in self.addresses.items())]
        self.hosts_file.write_text("\n".join(lines) + "\n")
        self.hosts_file.chmod(0o644)
        mount = self._holders[CONTROLLER].pid
        result = subprocess.run([which("nsenter") or "nsenter", f"--mount=/proc/{mount}/ns/mnt",
                                 "mount", "--bind", str(self.hosts_file), "/etc/hosts"],
                                capture_output=True, text=True, timeout=30, check=False)
        if result.returncode != 0:
            raise NetnsError(f"bind of {self.hosts_file} over /etc/hosts in the private mount "
                             f"namespace failed: {result.stderr.strip()}")
