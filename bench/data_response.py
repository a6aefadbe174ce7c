"""The energy response of 3DGAN training files themselves, per energy bin (issue 17).

Before a generated bin's sampling fraction is blamed on the generator, the real showers of that
bin must be right. For each HDF5 file (``train 3dgan --generate`` writes them; CERN's files have
the same layout) and each energy bin of the physics validation
(``training.physics.ENERGY_BINS_GEV``), this prints and writes:

- ``n``: events in the bin;
- ``response``: the mean of Σcells ÷ f(E'), the cell sum over what the generator of the files
  aims at (``training.showers.deposit_scale``; f(E') is docs/3dgan.md's sampling-fraction
  polynomial), minus 1, with its standard error;
- ``spread``: the per-event standard deviation of Σcells ÷ f(E') over its mean.

``ratio_to`` (default 200-300 GeV, the bin seed 3's dip was measured against) divides each bin's
mean by that bin's: the same ratio the README takes of the generated over real response. For
generated files every response is 0 within its error, so a dip found in a generator's bins is
not in its data. ``--scale-bin LO:HI:FACTOR`` multiplies one bin's cells by FACTOR before the
sums (the test's control: a bin scaled by 0.8 shows -20 %).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from common import provenance

from hpcai.models.gan3d_spec import ENERGY_SCALE_GEV
from hpcai.training.physics import ENERGY_BINS_GEV, bin_masks
from hpcai.training.showers import deposit_scale

EDGES = list(zip(ENERGY_BINS_GEV, ENERGY_BINS_GEV[1:]))   # (lo, hi) GeV of each validation bin


def file_response(path: Path, scale: tuple[float, float, float] | None = None,
                  ratio_to: tuple[float, float] = (200.0, 300.0)) -> dict:
    """One file's rows, one per energy bin (see the module doc)."""
    import h5py
    with h5py.File(path, "r") as f:
        energy = np.asarray(f["target"][:, 1], dtype=np.float64)    # GeV
        sums = np.asarray(f["ECAL"][:], dtype=np.float64).sum(axis=(1, 2, 3))
    masks = bin_masks(energy)         # the validation's own binning, bin by bin as EDGES
    if scale is not None:
        lo, hi, factor = scale
        sums = np.where(masks[EDGES.index((lo, hi))], sums * factor, sums)
    response = sums / deposit_scale(energy / ENERGY_SCALE_GEV)
    rows = []
    for (lo, hi), mask in zip(EDGES, masks):
        r = response[mask]
        rows.append({"bin_gev": [lo, hi], "n": int(r.size),
                     "response": float(r.mean() - 1) if r.size else None,
                     "response_se": float(r.std(ddof=1) / np.sqrt(r.size)) if r.size > 1
                     else None,
                     "spread": float(r.std(ddof=1) / r.mean()) if r.size > 1 else None,
                     "mean": float(r.mean()) if r.size else None})
    [ref] = [row["mean"] for row in rows if tuple(row["bin_gev"]) == ratio_to] or [None]
    for row in rows:
        row["ratio_to_reference"] = (row["mean"] / ref - 1 if ref and row["mean"] is not None
                                     else None)
        del row["mean"]
    return {"file": path.name, "events": int(energy.size), "bins": rows}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", type=Path,
                        help="HDF5 files, or directories whose *.h5 files are read")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--ratio-to", default="200:300", metavar="LO:HI",
                        help="the bin the others are divided by (GeV, a validation bin)")
    parser.add_argument("--scale-bin", metavar="LO:HI:FACTOR",
                        help="multiply the cells of the events in the validation bin LO-HI GeV "
                             "by FACTOR")
    args = parser.parse_args()
    try:
        ratio_to = tuple(float(x) for x in args.ratio_to.split(":"))
        if ratio_to not in EDGES:
            raise ValueError
    except ValueError:
        parser.error(f"--ratio-to {args.ratio_to}: not a validation bin; use one of "
                     + ", ".join(f"{lo:g}:{hi:g}" for lo, hi in EDGES))
    scale = None
    if args.scale_bin:
        try:
            lo, hi, factor = (float(x) for x in args.scale_bin.split(":"))
        except ValueError:
            parser.error(f"--scale-bin {args.scale_bin}: give LO:HI:FACTOR, e.g. 100:200:0.8")
        if (lo, hi) not in EDGES:
            parser.error(f"--scale-bin {args.scale_bin}: {lo:g}-{hi:g} GeV is not a validation "
                         "bin; use one of " + ", ".join(f"{a:g}:{b:g}" for a, b in EDGES))
        scale = (lo, hi, factor)
    files = sorted(p for path in args.paths
                   for p in (path.glob("*.h5") if path.is_dir() else [path]))
    missing = [str(p) for p in files if not p.is_file()] or ([] if files else
                                                              [str(p) for p in args.paths])
    if missing:
        parser.error(f"no HDF5 file at {', '.join(missing)}")
    info = provenance()
    results = [file_response(p, scale, ratio_to) for p in files]
    for res in results:
        print(f"{res['file']}: {res['events']} events")
        for row in res["bins"]:
            lo, hi = row["bin_gev"]
            if row["response"] is None:
                print(f"  {lo:4g}-{hi:<4g} GeV: no events")
                continue
            ratio = row["ratio_to_reference"]
            print(f"  {lo:4g}-{hi:<4g} GeV: n {row['n']:4d}  response {row['response']:+.4f}"
                  f" ± {row['response_se'] or 0:.4f}  spread {row['spread'] or 0:.4f}"
                  f"  over {ratio_to[0]:g}-{ratio_to[1]:g} GeV {ratio:+.4f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "benchmark": "data_response", "provenance": info,
            "settings": {"paths": [str(p) for p in args.paths], "ratio_to_gev": list(ratio_to),
                         "scale_bin": list(scale) if scale else None},
            "files": results}, indent=1) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
