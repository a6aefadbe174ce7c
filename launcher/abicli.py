"""``hpcai-launch mpis`` (the host's MPI installs) and ``hpcai-launch abi --container IMG``
(the ABI matrix: every host MPI x every MPI consumer in the image)."""

from __future__ import annotations

import json
import os

from ..core.cli import Parser
from ..core.errors import UserError
from .container import consumers, matrix, preflight
from .mpi import mpis
from .job.site import SiteProfile


def _installs(ns) -> list[mpis.HostInstall]:
    env = dict(os.environ)
    site = SiteProfile.chosen(ns.site, env)
    extra = tuple(ns.mpi or ())
    return mpis.discover(env, site.mpi_prefixes if site else (), extra)


def _parser(prog: str, description: str) -> Parser:
    p = Parser(prog=prog, description=description)
    p.add_argument("--site", help="site profile (TOML); its mpi_prefixes are searched too")
    p.add_argument("--mpi", action="append", metavar="PATH",
                   help="an MPI install (prefix, libdir, libmpi or launcher) to add")
    p.add_argument("--json", action="store_true", help="print JSON")
    return p


def mpis_main(argv: list[str]) -> int:
    ns = _parser("hpcai-launch mpis", "List every MPI install on this host.").parse_args(argv)
    found = _installs(ns)
    if ns.json:
        print(json.dumps([i.to_dict() for i in found], indent=2))
    else:
        print(mpis.render(found), end="")
    return 0


def abi_main(argv: list[str]) -> int:
    p = _parser("hpcai-launch abi", "Which host MPI runs which MPI program of the image.")
    p.add_argument("--container", required=True, help="image (a Charliecloud directory)")
    ns = p.parse_args(argv)
    preflight.read_image(ns.container)           # UserError if it is no image
    found = consumers.inspect(ns.container)
    if found is None:
        raise UserError(f"cannot look inside {ns.container}: only directory images are "
                        "inspected", "unpack it (ch-convert IMG DIR) and give the directory")
    installs = _installs(ns)
    cells = matrix.table(installs, found, ns.container)
    if ns.json:
        print(json.dumps({"image": ns.container,
                          "hosts": [i.to_dict() for i in installs],
                          "consumers": [c.to_dict() for c in found],
                          "cells": [c.to_dict() for c in cells]}, indent=2))
    else:
        print(matrix.render(cells, installs, found), end="")
    return 0
