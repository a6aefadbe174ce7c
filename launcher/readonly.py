"""Read-only binds where the runtime has none: run inside the container before the command.

``python3 -m hpcai.launcher.readonly [--join-tag TAG --join-ct N] [--rw DST]... DST... --
CMD...`` makes every mount at or under each ``DST`` read-only, then executes ``CMD``.
Charliecloud's ``ch-run -b`` binds read-write (0.31 here; the source up to 0.39~pre has no
read-only bind), so :mod:`.containers` puts this helper between ``ch-run … IMG --`` and the
rank's command. ``--rw DST`` names a read-write bind; where it lies under a read-only one, it
and its submounts are left alone.

How, with no privilege beyond what ch-run already uses (an unprivileged user namespace):

1. ``unshare(CLONE_NEWUSER | CLONE_NEWNS)`` with the same uid and gid mapped: this process
   owns a new mount namespace, a copy of the container's;
2. ``mount(MS_REMOUNT | MS_BIND | MS_RDONLY)`` on each mount, keeping the flags the kernel
   locked (nosuid, nodev, noexec, atime);
3. a second ``unshare(CLONE_NEWUSER | CLONE_NEWNS)``: copying mounts into a namespace of a
   less privileged user namespace locks their read-only flag and locks them onto their mount
   points, so the command cannot remount them read-write or unmount them, even as uid 0
   (the mapped root of a container that root started);
4. ``statvfs`` checks that every one is read-only, and ``execvp(CMD)``: this process becomes
   the command, in the locked namespace.

Ranks of one node must share one user namespace: cross-memory attach and UCX's shared
memory (``/proc/PID/fd``) need it (ch-run's ``--join`` is there for the same reason). With
``--join-tag``/``--join-ct`` (ch-run's own), the first rank of the node does steps 1-3 and
records its PID in ``/dev/shm/hpcai-readonly-TAG`` (the host's ``/dev``, which ch-run binds)
under ``flock``; the others ``setns`` into its namespaces; the last one removes the file. A
record whose process is gone is stale (a crashed job) and is replaced. The namespaces live
as long as the ranks; nothing else is left to clean up. Any failure is an
``error:``/``hint:`` and exit 2: the command never runs with a read-only bind left writable.
Standard library only (``ctypes``): Python 3.11 has no ``os.unshare`` or ``os.setns``.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import re
from dataclasses import dataclass
from typing import NoReturn

from ..core.cli import Parser, run_main, split_command
from ..core.errors import UserError

CLONE_NEWNS = 0x00020000
CLONE_NEWUSER = 0x10000000
MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_RELATIME = 0x200000
# statvfs f_flag bits that are also mount(2) flags, kept on remount (locked in a user
# namespace: leaving one out is EPERM). ST_RELATIME (0x1000) differs from MS_RELATIME.
KEPT_FLAGS = (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC | os.ST_NOATIME | os.ST_NODIRATIME)

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p)
_libc.unshare.argtypes = (ctypes.c_int,)
_libc.setns.argtypes = (ctypes.c_int, ctypes.c_int)
SHARED = "/dev/shm"            # one per node: ch-run binds the host's /dev

HINT = ("read-only binds need nested unprivileged user namespaces (sysctl "
        "user.max_user_namespaces > 0; Ubuntu: kernel.apparmor_restrict_unprivileged_userns); "
        "else use Singularity/Apptainer (-B SRC:DST:ro) or bind read-write (SRC:DST:rw)")


def _fail(what: str) -> UserError:
    err = ctypes.get_errno()
    return UserError(f"read-only binds: {what}: {os.strerror(err)} (errno {err})", HINT)


def new_namespace() -> None:
    """Enter a new user and mount namespace with this process's uid and gid mapped to
    themselves."""
    uid, gid = os.geteuid(), os.getegid()
    if _libc.unshare(CLONE_NEWUSER | CLONE_NEWNS) != 0:
        raise _fail("unshare(CLONE_NEWUSER|CLONE_NEWNS)")
    for name, text in (("uid_map", f"{uid} {uid} 1\n"), ("setgroups", "deny\n"),
                       ("gid_map", f"{gid} {gid} 1\n")):
        with open(f"/proc/self/{name}", "w", encoding="ascii") as f:
            f.write(text)


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as ``\\ooo``."""
    return (field.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n")
            .replace("\\134", "\\"))


def mount_points() -> list[str]:
    """Every mount point of this mount namespace, in mount order."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        return [_unescape(line.split()[4]) for line in f]


def _under(path: str, top: str) -> bool:
    return path == top or path.startswith(top.rstrip("/") + "/")


def to_remount(targets: list[str], keep: list[str], points: list[str]) -> list[str]:
    """Mount points to make read-only: those at or under a target, minus those at or under
    a ``keep`` that lies strictly under that target (pure)."""
    out: list[str] = []
    for target in targets:
        inner = [k for k in keep if _under(k, target) and k != target]
        for point in points:
            if (_under(point, target) and not any(_under(point, k) for k in inner)
                    and point not in out):
                out.append(point)
    return out


def remount_read_only(point: str) -> None:
    flags = os.statvfs(point).f_flag
    kept = (flags & KEPT_FLAGS) | (MS_RELATIME if flags & os.ST_RELATIME else 0)
    if _libc.mount(None, point.encode(), None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept,
                   None) != 0:
        raise _fail(f"cannot remount {point} read-only")


def make_read_only(targets: list[str], keep: list[str]) -> None:
    """Steps 1-3 of the module docstring, in this process."""
    new_namespace()
    for point in to_remount(targets, keep, mount_points()):
        remount_read_only(point)
    new_namespace()                      # locks the read-only flags


@dataclass(frozen=True)
class Record:
    """The first rank of a node: its PID and namespaces, and how many ranks are in."""

    pid: int
    user_ns: int
    mnt_ns: int
    joined: int

    def text(self) -> str:
        return f"{self.pid} {self.user_ns} {self.mnt_ns} {self.joined}\n"


def _ns(pid: int | str, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def _live(text: str) -> Record | None:
    """The record in ``text`` if its process still is in the namespace it recorded."""
    try:
        rec = Record(*map(int, text.split()))
    except (TypeError, ValueError):
        return None
    return rec if _ns(rec.pid, "user") == rec.user_ns else None


def join(rec: Record) -> None:
    """Enter the user and mount namespaces of ``rec``'s process (same uid: allowed)."""
    cwd = os.getcwd()
    fds = [os.open(f"/proc/{rec.pid}/ns/{kind}", os.O_RDONLY) for kind in ("user", "mnt")]
    try:
        for fd, flag in zip(fds, (CLONE_NEWUSER, CLONE_NEWNS)):
            if _libc.setns(fd, flag) != 0:
                raise _fail(f"setns into the namespaces of rank process {rec.pid}")
    finally:
        for fd in fds:
            os.close(fd)
    os.chdir(cwd)                        # setns(CLONE_NEWNS) moves to the root
    if (_ns("self", "user"), _ns("self", "mnt")) != (rec.user_ns, rec.mnt_ns):
        raise UserError(f"read-only binds: rank process {rec.pid} left its namespaces while "
                        "this rank joined them", HINT)


def make_read_only_on_node(targets: list[str], keep: list[str], tag: str, count: int) -> None:
    """One locked namespace for the ``count`` ranks of this node (see the docstring)."""
    path = os.path.join(SHARED, "hpcai-readonly-" + re.sub(r"[^A-Za-z0-9._-]", "_", tag))
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise UserError(f"read-only binds: cannot open {path}: {exc.strerror}",
                        f"{SHARED} must be writable inside the container; remove a {path} "
                        "left by another user") from exc
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        rec = _live(os.pread(fd, 200, 0).decode("ascii", "replace"))
        if rec is None:
            make_read_only(targets, keep)
            rec = Record(os.getpid(), _ns("self", "user") or 0, _ns("self", "mnt") or 0, 0)
        elif _ns("self", "user") != rec.user_ns:   # else ch-run joined this one already
            join(rec)
        rec = Record(rec.pid, rec.user_ns, rec.mnt_ns, rec.joined + 1)
        if rec.joined >= count:
            os.unlink(path)
        else:
            os.ftruncate(fd, 0)
            os.pwrite(fd, rec.text().encode("ascii"), 0)
    finally:
        os.close(fd)                     # and the lock with it


def verify_read_only(targets: list[str], keep: list[str]) -> None:
    for point in to_remount(targets, keep, mount_points()):
        if not os.statvfs(point).f_flag & os.ST_RDONLY:
            raise UserError(f"read-only binds: {point} is still writable", HINT)


def main(argv: list[str] | None = None) -> int:
    return run_main(_main, argv)


def _main(argv: list[str]) -> NoReturn:
    head, command = split_command(argv)
    parser = Parser(prog="python3 -m hpcai.launcher.readonly",
                    hint="python3 -m hpcai.launcher.readonly [--join-tag TAG --join-ct N] "
                         "[--rw DST]... DST... -- CMD...")
    parser.add_argument("--join-tag", help="ch-run's tag of the ranks of this node")
    parser.add_argument("--join-ct", type=int, default=1, help="how many ranks join")
    parser.add_argument("--rw", action="append", default=[], metavar="DST")
    parser.add_argument("targets", nargs="+", metavar="DST")
    ns = parser.parse_args(head)
    if not command:
        parser.error("no command after '--'")
    targets = [os.path.realpath(t) for t in ns.targets]
    keep = [os.path.realpath(k) for k in ns.rw]
    missing = [t for t in targets if not os.path.exists(t)]
    if missing:
        raise UserError(f"read-only binds: {', '.join(missing)} not found in the container",
                        "check the bind's destination")
    if ns.join_tag and ns.join_ct > 1:
        make_read_only_on_node(targets, keep, ns.join_tag, ns.join_ct)
    else:
        make_read_only(targets, keep)
    verify_read_only(targets, keep)
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        raise UserError(f"cannot start {command[0]}: {exc.strerror}",
                        "check the command inside the image") from exc


if __name__ == "__main__":
    raise SystemExit(main())
