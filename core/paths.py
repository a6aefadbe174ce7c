"""Where hpcai keeps what it may compute again: its cache directory."""

from __future__ import annotations

import os
from typing import Mapping


def cache_root(env: Mapping[str, str]) -> str:
    """hpcai's cache: ``HPCAI_CACHE``, else ``$XDG_CACHE_HOME/hpcai``, else
    ``~/.cache/hpcai``; an empty variable counts as unset (the XDG rule)."""
    return env.get("HPCAI_CACHE") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hpcai")
