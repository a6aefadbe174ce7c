"""Read-only binds are read-only: every test here tries to write, and a control must succeed.

Charliecloud's ``ch-run -b`` binds read-write; :mod:`hpcai.launcher.readonly` remounts the
read-only binds (host libraries, site trees, ``--bind …:ro``) inside the container before the
command runs. The attacks, from inside the container: append to a file, chmod it back to
0644 and append, create a file in the bound directory, remount the bind read-write, and
remount it read-write from a fresh nested user namespace. Each must fail under a read-only
bind and succeed under a read-write bind of the same kind of file (the control: a test that
could not fail would prove nothing). The ranks of a node must end in one user namespace.
Singularity/Apptainer (``-B SRC:DST:ro``) is not installed here; its argv is covered by
tests/test_container_plan.py.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from conftest import run
from hpcai.launcher.container.containers import Bind, ContainerSpec, wrap
from test_containers import _fake_image
from test_image import image, image_env, pytestmark  # noqa: F401 - fixture and marks

HOST_LIBMPI = Path("/usr/lib/x86_64-linux-gnu/libmpi.so.40")
ATTACKS = ("append", "chmod+append", "create", "remount rw", "nested remount rw")

# Runs inside the container: argv is FILE DIR pairs, DIR being the bind's mount point.
ATTACK = r'''
import ctypes, errno, json, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                       ctypes.c_void_p)
MS_REMOUNT, MS_BIND, CLONE_NEWUSER, CLONE_NEWNS = 0x20, 0x1000, 0x10000000, 0x20000

def check(call):
    if call() != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))

def append(path):
    with open(path, "ab") as f:
        f.write(b"written from the container\n")

def chmod_append(path):
    os.chmod(path, 0o644)
    append(path)

def create(folder):
    with open(os.path.join(folder, "created-in-container"), "w") as f:
        f.write("x")

def remount_rw(folder):
    """Keep the other flags (the kernel locks them too): only read-only is asked off."""
    flags = os.statvfs(folder).f_flag
    kept = (flags & (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC | os.ST_NOATIME
                     | os.ST_NODIRATIME)) | (0x200000 if flags & os.ST_RELATIME else 0)
    check(lambda: libc.mount(None, folder.encode(), None, MS_REMOUNT | MS_BIND | kept, None))

def nested_remount_rw(folder):
    """In a child: a fresh user+mount namespace gives every capability there."""
    pid = os.fork()
    if pid == 0:
        uid, gid = os.geteuid(), os.getegid()
        try:
            check(lambda: libc.unshare(CLONE_NEWUSER | CLONE_NEWNS))
            for name, text in (("uid_map", f"{uid} {uid} 1"), ("setgroups", "deny"),
                               ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
            remount_rw(folder)
        except OSError as exc:
            os._exit(exc.errno)
        os._exit(0)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])

def attempt(call, *args):
    try:
        code = call(*args)
    except OSError as exc:
        code = exc.errno
    return errno.errorcode[code] if code else "ok"

result = {}
for path, folder in zip(sys.argv[1::2], sys.argv[2::2]):
    result[folder] = {"append": attempt(append, path),
                      "chmod+append": attempt(chmod_append, path),
                      "create": attempt(create, folder),
                      "remount rw": attempt(remount_rw, folder),
                      "nested remount rw": attempt(nested_remount_rw, folder)}
rank, size = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1"))
with open(f"/opt/hpcai/work/.attack-{rank}", "w") as f:
    json.dump({"uid": os.geteuid(), "user_ns": os.stat("/proc/self/ns/user").st_ino,
               "result": result}, f)
os.rename(f"/opt/hpcai/work/.attack-{rank}", f"/opt/hpcai/work/attack-{rank}.json")
for _ in range(600):   # every rank lives until all have joined the node's container
    if all(os.path.exists(f"/opt/hpcai/work/attack-{r}.json") for r in range(size)):
        break
    time.sleep(0.1)
'''


def _control(root: Path) -> Path:
    """A read-write bind's source: a library copy (0444, like the staged ones) and a file."""
    root.mkdir(parents=True)
    shutil.copyfile(HOST_LIBMPI, root / "libmpi.so.40")
    (root / "libmpi.so.40").chmod(0o444)
    (root / "f").write_text("control\n")
    return root


def _data(root: Path) -> Path:
    root.mkdir(parents=True)
    (root / "f").write_text("data\n")
    (root / "f").chmod(0o444)
    return root


def _assert_read_only(attacks: dict, where: str) -> None:
    assert attacks["append"] in ("EROFS", "EACCES"), (where, attacks)   # EACCES: 0444, not root
    assert attacks["chmod+append"] == "EROFS", (where, attacks)
    assert attacks["create"] == "EROFS", (where, attacks)
    assert attacks["remount rw"] == "EPERM", (where, attacks)           # locked, even for root
    assert attacks["nested remount rw"] == "EPERM", (where, attacks)


def _assert_control(attacks: dict, uid: int, where: str) -> None:
    assert attacks["chmod+append"] == "ok" and attacks["create"] == "ok", (where, attacks)
    assert attacks["nested remount rw"] == "ok", (where, attacks)
    if uid == 0:   # root in the container: the 0444 mode and the remount do not stop it
        assert attacks["append"] == "ok" and attacks["remount rw"] == "ok", (where, attacks)


def test_dry_run_says_how_binds_are_made_read_only(image, tmp_path):
    result = run(["hpcai-launch", "-N", "2", "--container", str(image), "--dry-run",
                  "--bind", f"{tmp_path}:/opt/hpcai/data:ro", "--", "true"],
                 image_env(HPCAI_CACHE=str(tmp_path / "cache")), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert ("read-only binds: ch-run -b binds read-write, so python3 -m "
            "hpcai.launcher.readonly runs in the image before the command and remounts them "
            "read-only") in result.stdout, result.stdout
    assert "bound read-only at /opt/hpcai/host:" in result.stdout
    assert "this runtime has no read-only bind" not in result.stdout


@pytest.mark.skipif(not HOST_LIBMPI.is_file(), reason="host Open MPI (libmpi.so.40) not here")
def test_writes_under_read_only_binds_fail_and_the_control_succeeds(image, tmp_path):
    """Two ranks of one joined container, started by hpcai-launch as a user would: the
    staged host libraries and a --bind …:ro resist every attack, a read-write bind not."""
    data, control = _data(tmp_path / "data"), _control(tmp_path / "control")
    (tmp_path / "attack.py").write_text(ATTACK)
    cache = tmp_path / "cache"
    result = run(["hpcai-launch", "-N", "2", "--container", str(image),
                  "--bind", f"{data}:/opt/hpcai/data:ro", "--bind", f"{control}:/opt/hpcai/out",
                  "--", "python3", "/opt/hpcai/work/attack.py",
                  "/opt/hpcai/host/lib/libmpi.so.40", "/opt/hpcai/host",
                  "/opt/hpcai/data/f", "/opt/hpcai/data",
                  "/opt/hpcai/out/libmpi.so.40", "/opt/hpcai/out"],
                 image_env(HPCAI_CACHE=str(cache)), cwd=tmp_path, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    reports = [json.loads((tmp_path / f"attack-{rank}.json").read_text()) for rank in (0, 1)]
    for rank, report in enumerate(reports):
        attacks, uid = report["result"], report["uid"]
        _assert_read_only(attacks["/opt/hpcai/host"], f"rank {rank}: host libraries")
        _assert_read_only(attacks["/opt/hpcai/data"], f"rank {rank}: --bind :ro")
        _assert_control(attacks["/opt/hpcai/out"], uid, f"rank {rank}: read-write control")
    # one user namespace for the ranks of a node (cross-memory attach needs it)
    assert reports[0]["user_ns"] == reports[1]["user_ns"], reports
    # seen from the host: nothing changed under the read-only binds, the control did
    staged = next(cache.glob("hostlibs/*/lib/libmpi.so.40"))
    assert staged.read_bytes() == HOST_LIBMPI.read_bytes()
    assert staged.stat().st_mode & 0o777 == 0o444
    assert (data / "f").read_text() == "data\n" and sorted(os.listdir(data)) == ["f"]
    assert (control / "created-in-container").exists()
    assert (control / "libmpi.so.40").read_bytes() != HOST_LIBMPI.read_bytes()


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to become another user (the other tests "
                    "already run as this non-root user)")
def test_read_only_holds_for_a_user_who_is_not_root(image):
    """As a site user would run it (uid 65534, no privilege): two ranks of one joined
    container, with the argv hpcai builds for each rank."""
    top = Path(tempfile.mkdtemp(prefix="hpcai-ro-"))
    try:
        # the image must be reachable by that user: a hard-linked copy outside root's home
        shared = top / "image"
        subprocess.run(["cp", "-al", str(image), str(shared)], check=True, timeout=600)
        image = shared
        data, control = _data(top / "data"), _control(top / "control")
        (top / "attack.py").write_text(ATTACK)
        for path in (top, data, control, *data.rglob("*"), *control.rglob("*"),
                     top / "attack.py"):
            os.chown(path, 65534, 65534, follow_symlinks=False)
        top.chmod(0o755)
        spec = ContainerSpec("charliecloud", shutil.which("ch-run"), str(image),
                             (Bind(str(data), "/opt/hpcai/data", read_only=True),
                              Bind(str(control), "/opt/hpcai/out", read_only=False),
                              Bind(str(top), "/opt/hpcai/work", read_only=False)),
                             "/opt/hpcai/work")
        argv = wrap(spec, ("python3", "/opt/hpcai/work/attack.py",
                           "/opt/hpcai/data/f", "/opt/hpcai/data",
                           "/opt/hpcai/out/libmpi.so.40", "/opt/hpcai/out"),
                    join_ct=2, join_tag=top.name)
        assert "hpcai.launcher.readonly" in argv and "--join-ct" in argv
        ranks = [subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534",
                                   "--clear-groups", *argv],
                                  env={**image_env(HOME=str(top), RANK=str(rank),
                                                   WORLD_SIZE="2"), "USER": "nobody"},
                                  cwd=top, stderr=subprocess.PIPE, text=True)
                 for rank in (0, 1)]
        errors = [p.communicate(timeout=120)[1] for p in ranks]
        assert [p.returncode for p in ranks] == [0, 0], errors
        reports = [json.loads((top / f"attack-{rank}.json").read_text()) for rank in (0, 1)]
        for rank, report in enumerate(reports):
            assert report["uid"] == 65534
            _assert_read_only(report["result"]["/opt/hpcai/data"], f"rank {rank}: --bind :ro")
            _assert_control(report["result"]["/opt/hpcai/out"], 65534, f"rank {rank}: control")
        assert reports[0]["user_ns"] == reports[1]["user_ns"], reports
        assert (data / "f").read_text() == "data\n"
        assert not list(Path("/dev/shm").glob(f"hpcai-readonly-{top.name}*"))
    finally:
        shutil.rmtree(top)


def test_image_without_the_helper_refuses_read_only_before_any_rank(tmp_path):
    """No silent :ro drop: exit 2 with error and hint, nothing started; :rw is accepted."""
    fake = _fake_image(tmp_path / "img", "openmpi", "libmpi.so.40")
    args = ["hpcai-launch", "-N", "2", "--container", str(fake), "--no-bind-host-mpi"]
    command = ["--", "python3", "-c", "open('started', 'w')"]
    refused = run([*args, "--bind", f"{tmp_path}:/data:ro", *command], image_env(),
                  cwd=tmp_path)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert refused.stderr.startswith("error: charliecloud binds read-write, and image ")
    assert "hpcai.launcher.readonly to make /data read-only" in refused.stderr
    assert "\nhint: rebuild the image" in refused.stderr
    assert not (tmp_path / "started").exists()
    accepted = run([*args, "--bind", f"{tmp_path}:/data:rw", "--dry-run", *command],
                   image_env(), cwd=tmp_path)
    assert accepted.returncode == 0, accepted.stderr
