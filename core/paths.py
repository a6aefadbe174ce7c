"""Where hpcai keeps what it may compute again (its cache directory), and where a program is."""

from __future__ import annotations

import os

TYPE_CHECKING = False     # typing's constant, without importing typing
if TYPE_CHECKING:
    from collections.abc import Mapping


def cache_root(env: Mapping[str, str]) -> str:
    """hpcai's cache: ``HPCAI_CACHE``, else ``$XDG_CACHE_HOME/hpcai``, else
    ``~/.cache/hpcai``; an empty variable counts as unset (the XDG rule)."""
    return env.get("HPCAI_CACHE") or os.path.join(
        env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hpcai")


def which(name: str, path: str | None = None) -> str | None:
    """``shutil.which(name, path=path)`` for the launcher's start-up path: the first
    executable file ``name`` on ``path`` (default ``$PATH``), or ``name`` itself when it has a
    directory part; None if none. (``shutil`` imports the compression modules: about 9 ms of
    every hpcai-launch start here.)"""
    def runnable(candidate: str) -> bool:
        return os.access(candidate, os.X_OK) and not os.path.isdir(candidate)

    if os.path.dirname(name):
        return name if runnable(name) else None
    for folder in (os.environ.get("PATH", os.defpath) if path is None else path).split(os.pathsep):
        candidate = os.path.join(folder, name)
        if runnable(candidate):
            return candidate
    return None
