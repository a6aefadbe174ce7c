"""Synthetic 3DGAN calorimeter showers, written in exactly the layout of the real files.

The real CERN files (``EleEscan_1_1.h5`` ..., 10,000 events each) cannot be downloaded here,
so this module writes stand-ins that the data pipeline (``hpcai.training.shower_data``) reads
unchanged:

- ``ECAL``   float32 (N, 25, 25, 25): cell energies in GeV; the last axis is depth (layers).
- ``target`` float32 (N, 2): column 0 = particle id (11, electron), column 1 = primary energy
  in GeV.
- ``HCAL``   float32 (N, 5, 5, 60): present but unused (zeros with a little sparse noise).

Files are named ``Ele_{seed}_{i}.h5`` (so ``Ele*_*.h5`` matches both these and the real
``EleEscan_1_1.h5``), written atomically (temporary file in the same folder, then
``os.replace``), chunked one event per chunk and compressed (gzip level 1 + shuffle).

Units of the deposited energy (the interpretation this module implements)
--------------------------------------------------------------------------
docs/3dgan.md defines ``E' = E / 100 GeV`` and ``f(E') = E'(0.0018E'^4 - 0.023E'^3 +
0.11E'^2 - 0.28E' + 2.21)`` (about 2 % of the energy), and the 3DGAN trains the
discriminator's ``ecal`` head with ``MAPE(f(E'), sum(x_hat))`` where ``sum(x_hat)`` is the raw
sum of the generated cells and the real cells are stored in GeV. For that target to be
consistent with real data, the raw ECAL sum in GeV must equal ``f(E')`` numerically:

    sum(ECAL cells) [GeV]  ~=  f(E')        e.g. E = 100 GeV -> E' = 1 -> f = 2.02 GeV (2 %)
                                              E = 500 GeV -> E' = 5 -> f = 9.05 GeV (1.8 %)

i.e. ``f(E')/E'`` is the sampling fraction in percent, and the deposit is
``f(E')/E' % x E = f(E') GeV``. The original task specification's wording "sum ~= f(E') x
100 GeV" would put 200 GeV into the active layers of a 100 GeV electron (more than its
energy), so we read it as this percent/GeV scale slip (see "Data" in docs/3dgan.md).
``deposit_scale`` below states the convention in code: the expected raw sum for an event is
``deposit_scale(E')`` GeV.

Shower model (deterministic for a given seed; numpy ``Generator``)
------------------------------------------------------------------
- Primary energy ``E ~ U(e_min, e_max)`` GeV (10-500 by default).
- Total deposit ``S = f(E') (1 + sigma N(0,1))`` with a calorimeter-like resolution
  ``sigma = sqrt((0.10/sqrt(E))^2 + 0.01^2)`` (3.3 % at 10 GeV, 1.1 % at 500 GeV).
- Longitudinal (last axis): gamma profile ``t^(a-1) exp(-b t)`` in layer units with its
  maximum at ``t_max = 2.0 + 1.3 ln(E/GeV)`` (+ 0.4 layer jitter): layer ~5 at 10 GeV, ~10 at
  500 GeV.
- Lateral (first two axes): a Gaussian core (sigma 0.8 -> 1.4 cells from front to back,
  Moliere-like) plus a weak exponential halo (8 % -> 20 % of the layer's energy, decay length
  1.8 -> 3.3 cells), centred on (12, 12) with a 0.35-cell per-event jitter of the impact point.
- Fluctuations: the expected cell fractions are Poisson-sampled into energy quanta (about 1500
  per GeV deposited) and each hit cell gets a Gamma(4, 1/4) weight, then the event is rescaled
  to exactly ``S``. Cells without quanta are exactly zero; every non-zero cell is far above the
  1e-6 GeV preprocessing threshold.

Events are produced in fixed blocks of ``BLOCK`` events, each from its own
``default_rng([seed, file_index, block])``, so event j of a file depends only on
(seed, file index, j) and not on ``events_per_file``.

CLI::

    python -m hpcai.training.showers generate --out DIR --files 2 --events 1000 --seed 0
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import numpy as np

from ..core.cli import Parser, run_main
from ..core.errors import UserError
from ..models import gan3d_spec
from ..models.gan3d_spec import ENERGY_SCALE_GEV, GRID

HCAL_SHAPE = (5, 5, 60)   # present in the real files, unused by 3DGAN
PARTICLE_ID = 11          # electron
BLOCK = 100               # events per RNG block (fixed: part of the determinism contract)
HELD_OUT_SEED_OFFSET = 1_000_000   # train --generate: the held-out files' seed is seed + this
QUANTA_PER_GEV = 1500.0   # Poisson quanta per GeV of deposited energy


def deposit_scale(ep: np.ndarray | float) -> np.ndarray:
    """Expected sum of the stored ECAL cells (GeV) for E'; equals f(E') (see module doc)."""
    return gan3d_spec.sampling_fraction(np.asarray(ep, dtype=np.float64))


def _showers(rng: np.random.Generator, n: int, e_min: float, e_max: float
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """n events: (ECAL float32 (n,25,25,25), target float32 (n,2), HCAL float32 (n,5,5,60))."""
    energy = rng.uniform(e_min, e_max, size=n)                       # GeV
    ep = energy / ENERGY_SCALE_GEV
    resolution = np.sqrt((0.10 / np.sqrt(energy)) ** 2 + 0.01**2)
    total = deposit_scale(ep) * (1.0 + resolution * rng.standard_normal(n))
    total = np.maximum(total, 0.05 * deposit_scale(ep))

    # Longitudinal: gamma profile in depth t (layer centres at k + 0.5).
    t_max = 2.0 + 1.3 * np.log(energy) + 0.4 * rng.standard_normal(n)
    t_max = np.clip(t_max, 1.0, GRID - 3.0)
    b = 0.55 * rng.uniform(0.9, 1.1, size=n)
    a = 1.0 + b * (t_max + 0.5)
    t = np.arange(GRID) + 0.5
    log_long = (a[:, None] - 1.0) * np.log(t[None, :]) - b[:, None] * t[None, :]
    long = np.exp(log_long - log_long.max(axis=1, keepdims=True))
    long /= long.sum(axis=1, keepdims=True)                          # (n, 25)

    # Lateral: Gaussian core + exponential halo, both widening with depth.
    depth = np.arange(GRID) / (GRID - 1.0)
    sigma = (0.8 + 0.6 * depth)[None, None, None, :] * rng.uniform(0.9, 1.1, (n, 1, 1, 1))
    lam = (1.8 + 1.5 * depth)[None, None, None, :]
    halo_frac = (0.08 + 0.12 * depth)[None, None, None, :]
    centre = GRID // 2 + 0.35 * rng.standard_normal((n, 2))
    cells = np.arange(GRID, dtype=np.float64)
    dx2 = (cells[None, :] - centre[:, 0:1]) ** 2                     # (n, 25)
    dy2 = (cells[None, :] - centre[:, 1:2]) ** 2
    r2 = (dx2[:, :, None] + dy2[:, None, :])[..., None]             # (n, 25, 25, 1)
    core = np.exp(-r2 / (2.0 * sigma**2))
    core /= core.sum(axis=(1, 2), keepdims=True)
    halo = np.exp(-np.sqrt(r2) / lam)
    halo /= halo.sum(axis=(1, 2), keepdims=True)
    lateral = (1.0 - halo_frac) * core + halo_frac * halo           # (n,25,25,25), per layer 1
    prob = lateral * long[:, None, None, :]                          # sums to 1 per event

    # Fluctuations: Poisson quanta, a Gamma weight per hit cell, rescale to the drawn total.
    quanta = rng.poisson(prob * (QUANTA_PER_GEV * total)[:, None, None, None])
    weight = rng.gamma(4.0, 0.25, size=prob.shape)
    ecal = quanta * weight
    sums = ecal.sum(axis=(1, 2, 3))
    empty = sums <= 0
    if np.any(empty):  # practically never: fall back to the expectation
        ecal[empty] = prob[empty]
        sums[empty] = 1.0
    ecal *= (total / sums)[:, None, None, None]

    target = np.stack([np.full(n, PARTICLE_ID, dtype=np.float64), energy], axis=1)
    hcal = np.zeros((n, *HCAL_SHAPE), dtype=np.float32)
    hit = rng.random(hcal.shape) < 0.02
    hcal[hit] = rng.exponential(1e-4, size=int(hit.sum())).astype(np.float32)
    return ecal.astype(np.float32), target.astype(np.float32), hcal


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _check_out_dir(out_dir: Path) -> None:
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"output path {out_dir} exists and is not a directory",
                        "give --out a directory (it is created if missing)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UserError(f"cannot create output directory {out_dir}: {exc.strerror or exc}",
                        "choose a writable --out directory") from exc
    try:
        with tempfile.TemporaryFile(dir=out_dir):
            pass
    except OSError as exc:
        raise UserError(f"output directory {out_dir} is not writable: {exc.strerror or exc}",
                        "choose a writable --out directory") from exc


def held_out_seed(seed: int) -> int:
    """The seed of the held-out files ``train --generate`` writes beside the training files
    of ``seed``: their own random streams, and names (``Ele_{held_out_seed}_{i}.h5``) that
    sort after the training files'."""
    return int(seed) + HELD_OUT_SEED_OFFSET


def generate(out_dir: str | os.PathLike, n_files: int = 2, events_per_file: int = 1000,
             seed: int = 0, e_min: float = 10.0, e_max: float = 500.0) -> list[Path]:
    """Write ``n_files`` files ``Ele_{seed}_{i}.h5`` of ``events_per_file`` showers each.

    Returns the paths written. Raises UserError for bad arguments or an unwritable folder.
    """
    import h5py

    if int(n_files) < 1:
        raise UserError(f"number of files must be at least 1, got {n_files}",
                        "pass --files 1 or more")
    if int(events_per_file) < 1:
        raise UserError(f"events per file must be at least 1, got {events_per_file}",
                        "pass --events 1 or more")
    if int(seed) < 0:
        raise UserError(f"seed must be non-negative, got {seed}", "pass --seed 0 or more")
    if not (0 < float(e_min) <= float(e_max)):
        raise UserError(f"bad energy range {e_min}..{e_max} GeV",
                        "need 0 < e_min <= e_max, e.g. 10 and 500")
    n_files, events_per_file, seed = int(n_files), int(events_per_file), int(seed)
    out = Path(out_dir)
    _check_out_dir(out)

    written: list[Path] = []
    for i in range(n_files):
        final = out / f"Ele_{seed}_{i}.h5"
        fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=out)
        os.close(fd)
        try:
            with h5py.File(tmp_name, "w") as h5:
                n = events_per_file
                opts = dict(compression="gzip", compression_opts=1, shuffle=True,
                            track_times=False)
                d_ecal = h5.create_dataset("ECAL", shape=(n, GRID, GRID, GRID),
                                           dtype="f4", chunks=(1, GRID, GRID, GRID), **opts)
                d_target = h5.create_dataset("target", shape=(n, 2), dtype="f4",
                                             chunks=(min(n, 4096), 2), **opts)
                d_hcal = h5.create_dataset("HCAL", shape=(n, *HCAL_SHAPE), dtype="f4",
                                           chunks=(1, *HCAL_SHAPE), **opts)
                for block, start in enumerate(range(0, n, BLOCK)):
                    rng = np.random.default_rng([seed, i, block])
                    ecal, target, hcal = _showers(rng, BLOCK, e_min, e_max)
                    stop = min(start + BLOCK, n)
                    d_ecal[start:stop] = ecal[: stop - start]
                    d_target[start:stop] = target[: stop - start]
                    d_hcal[start:stop] = hcal[: stop - start]
                h5.attrs["generator"] = "hpcai.training.showers"
                h5.attrs["seed"] = seed
                h5.attrs["file_index"] = i
                h5.attrs["ecal_units"] = "GeV; sum(ECAL) ~= f(E'), E' = target[:,1]/100"
            os.chmod(tmp_name, 0o666 & ~_umask())  # mkstemp makes 0600; use the umask
            os.replace(tmp_name, final)
        except OSError as exc:
            raise UserError(f"cannot write {final}: {exc}",
                            "check free space and permissions of --out") from exc
        finally:
            if os.path.exists(tmp_name):
                os.unlink(tmp_name)
        written.append(final)
    return written


def _parser() -> Parser:
    hint = "see hpcai-data generate --help"
    p = Parser(prog="hpcai-data", hint=hint,
               description="Write synthetic 3DGAN calorimeter showers (real file layout).")
    sub = p.add_subparsers(dest="command", required=True, parser_class=Parser)
    g = sub.add_parser("generate", help="write Ele_{seed}_{i}.h5 files")
    g.add_argument("--out", required=True, help="output directory (created if missing)")
    g.add_argument("--files", type=int, default=2, help="number of files (default 2)")
    g.add_argument("--events", type=int, default=1000, help="events per file (default 1000)")
    g.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    g.add_argument("--e-min", type=float, default=10.0, help="lowest energy, GeV (default 10)")
    g.add_argument("--e-max", type=float, default=500.0,
                   help="highest energy, GeV (default 500)")
    return p


def main(argv: list[str] | None = None) -> int:
    return run_main(_generate_command, argv)


def _generate_command(argv: list[str]) -> int:
    ns = _parser().parse_args(argv)
    paths = generate(ns.out, n_files=ns.files, events_per_file=ns.events, seed=ns.seed,
                     e_min=ns.e_min, e_max=ns.e_max)
    total = 0
    for path in paths:
        size = path.stat().st_size
        total += size
        print(f"wrote {path} ({ns.events} events, {size / 1e6:.1f} MB)")
    print(f"{len(paths)} files, {len(paths) * ns.events} events, {total / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
