"""The GPUs ``hpcai-launch`` finds on this machine, as JSON on stdout.

Reads what :func:`hpcai.launcher.node.gpus.from_host` reads (``/sys/bus/pci/devices``,
``/proc/driver/nvidia/gpus``, ``/sys/class/net`` and ``/sys/class/infiniband``) and prints
each GPU's index, PCI address, UUID, NUMA node, model and NICs on its PCI root, plus which of
those trees exist here. A machine without GPUs prints an empty list and exits 0.

    python bench/gpu_discovery.py [--sys /sys] [--proc /proc]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]     # the checkout is the package hpcai


def _this_checkout() -> None:
    """Import ``hpcai`` from the checkout this script is in, whatever its folder's name."""
    spec = importlib.util.spec_from_file_location(
        "hpcai", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["hpcai"] = module
    spec.loader.exec_module(module)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sys", default="/sys", help="sysfs root (default /sys)")
    parser.add_argument("--proc", default="/proc", help="procfs root (default /proc)")
    args = parser.parse_args(argv)
    _this_checkout()
    from hpcai.launcher.node.gpus import from_host
    found = from_host(args.sys, args.proc)
    trees = {path: os.path.isdir(path) for path in (
        os.path.join(args.sys, "bus", "pci", "devices"),
        os.path.join(args.proc, "driver", "nvidia", "gpus"),
        os.path.join(args.sys, "class", "net"),
        os.path.join(args.sys, "class", "infiniband"))}
    print(json.dumps({"describe": found.describe(), "gpus": [g.to_dict() for g in found.gpus],
                      "trees": trees}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
