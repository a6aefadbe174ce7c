"""Files a reader sees whole or not at all: written beside their place, then renamed over it."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path`` to write; when the block ends without an error,
    rename it over ``path``. The temporary file never outlives the block, so a write that
    fails leaves ``path`` as it was. Whatever writes it sets its permissions (``open`` gives
    the umask's, as the run's other files have; ``mkstemp`` would give 0600)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
