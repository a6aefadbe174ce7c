"""Made-up container images: a root tree with the manifest hpcai reads, enough for the
pre-flight checks, with no MPI or Python inside (nothing in them runs)."""

from __future__ import annotations

import json
from pathlib import Path


def fake_image(root: Path, family: str, soname: str) -> Path:
    """An image whose manifest names MPI ``family`` with library ``soname``."""
    (root / "opt" / "hpcai" / "host").mkdir(parents=True)
    (root / "usr" / "bin").mkdir(parents=True)
    (root / "usr" / "bin" / "python3").write_text("")
    (root / "usr" / "bin" / "python3").chmod(0o755)
    (root / "opt" / "hpcai" / "manifest.json").write_text(json.dumps(
        {"glibc": "2.36", "mpi": {"family": family, "soname": soname, "abis": [family]}}))
    return root


def startup_image(root: Path) -> Path:
    """An Open MPI image that passes every pre-flight check (ch-run is faked: the trace
    ends where the wrapper execs it)."""
    image = fake_image(root, "openmpi", "libmpi.so.40")
    helper = image / "usr/lib/python3/dist-packages/hpcai/launcher/readonly.py"
    helper.parent.mkdir(parents=True)
    helper.write_text("")
    return image
