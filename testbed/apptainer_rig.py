"""The Apptainer test rig (``scripts/build-apptainer-rig.sh``) as a session fixture.

Debian sid's ``apptainer`` in a debootstrapped sid root, started through ``ch-run`` by the
rig's ``singularity`` front-end. Built once (about 70 s here) under
``${HPCAI_CACHE:-~/.cache/hpcai}/apptainer-rig``, later sessions only check its stamp. Where
it cannot be built because the Debian mirror is out of reach, the tests skip and say so; any
other build failure fails them.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from rigenv import REPO

SCRIPT = REPO / "scripts" / "build-apptainer-rig.sh"
CACHE = Path(os.environ.get("HPCAI_CACHE") or Path.home() / ".cache" / "hpcai")
RIG = CACHE / "apptainer-rig"


def _which(cmd: str) -> str | None:
    return shutil.which(cmd) or shutil.which(cmd, path="/usr/sbin:/sbin")


def debian_mirror() -> str:
    """The mirror the build script uses (same rule: HPCAI_DEBIAN_MIRROR, then apt's config)."""
    if os.environ.get("HPCAI_DEBIAN_MIRROR"):
        return os.environ["HPCAI_DEBIAN_MIRROR"]
    try:
        for line in Path("/etc/apt/sources.list.d/debian.sources").read_text().splitlines():
            if line.startswith("URIs:"):
                return line.split()[1]
    except OSError:
        pass
    return "http://deb.debian.org/debian"


def mirror_unreachable(mirror: str) -> str | None:
    """Why sid's Release file cannot be fetched from ``mirror``; None when it can."""
    url = f"{mirror.rstrip('/')}/dists/sid/Release"
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="HEAD"), timeout=20):
            return None
    except OSError as exc:
        return f"{url}: {exc}"


@pytest.fixture(scope="session")
def apptainer_rig() -> Path:
    """The rig's bin directory (``singularity`` and ``apptainer``), built when missing."""
    missing = [c for c in ("ch-run", "debootstrap") if _which(c) is None]
    if missing:
        pytest.skip(f"the Apptainer rig needs {' and '.join(missing)} "
                    "(apt-get install charliecloud-runtime debootstrap; scripts/install.sh)")
    if os.geteuid() != 0 and not (RIG / ".stamp").exists():
        pytest.skip("building the Apptainer rig needs root (debootstrap, chroot) and none "
                    f"is built in {RIG}")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LD_", "PYTHON"))}
    env["USER"] = env.get("USER") or "root"
    env["PATH"] = env.get("PATH", os.defpath) + ":/usr/sbin:/sbin"
    start = time.monotonic()
    result = subprocess.run(["bash", str(SCRIPT), "--out", str(RIG)], env=env,
                            capture_output=True, text=True, timeout=20 * 60, check=False)
    seconds = time.monotonic() - start
    output = f"{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    if result.returncode != 0:
        why = mirror_unreachable(debian_mirror())
        if why:
            pytest.skip(f"the Apptainer rig cannot be built here: the Debian mirror is out "
                        f"of reach ({why})")
        pytest.fail(f"build-apptainer-rig.sh failed after {seconds:.0f} s\n{output}")
    print(f"\napptainer rig (cached or not): {seconds:.1f} s\n{result.stdout[-400:]}")
    return RIG / "bin"
