"""Shared by the benchmarks: the environment that keeps MPI on loopback."""

from __future__ import annotations

import os


def loopback_env(**extra: str) -> dict[str, str]:
    """This process's environment with Open MPI and UCX pinned to ``lo``."""
    return dict(os.environ, OMPI_MCA_btl_tcp_if_include="lo", OMPI_MCA_oob_tcp_if_include="lo",
                UCX_NET_DEVICES="lo", **extra)
