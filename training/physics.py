"""Shower physics of generated against real 3DGAN events, per energy bin (NumPy only).

Pipeline::

    real = summarise(x_real, e_gev, aux_real)      # per event: profiles, hits, aux
    gen  = summarise(x_gen,  e_gev, aux_gen)       # the generator at the same energies
    result = compare(real, gen, epoch=3)           # a Validation: one BinResult per bin
    result.summary()                               # flat numbers for the epoch record

Definitions (docs/3dgan.md, "Physics validation"):

- profile along axis a: the energy per slice of the 25 x 25 x 25 image along a (x, y: the
  transverse axes, z: depth); per bin the mean over events; the distance between the real
  and the generated mean profile is the relative L1 ``sum|g - r| / sum r`` (0: identical; a
  profile scaled by 1 + s has distance |s|);
- sampling fraction: ``sum of cells / E`` (both in GeV), per event, mean per bin; the
  standard error of gen/real - 1 from both sides' event-to-event spreads (first order:
  ``(g/r) sqrt(sd_g^2/(n_g g^2) + sd_r^2/(n_r r^2))``);
- first moment along a: the energy-weighted mean slice index; second moment: the
  energy-weighted standard deviation of the slice index (events with no energy are left
  out);
- the discriminator's energy regression error: ``MAPE = 100 mean(|aux - E'| / E')``,
  ``E' = E / 100 GeV``, on real and on generated showers;
- hits: cells above ``threshold`` (GeV) per event.

With ``draws`` K > 1 the generator made K showers per real event (K latent vectors), so a
bin's generated side holds K times its real events.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from ..models.gan3d_spec import ENERGY_SCALE_GEV, GRID

AXES = ("x", "y", "z")
ENERGY_BINS_GEV = (10.0, 100.0, 200.0, 300.0, 400.0, 500.0)
HIT_THRESHOLD_GEV = 1e-6   # the preprocessing threshold: real cells below it are 0


@dataclass(frozen=True)
class EventSummaries:
    """What validation keeps of n showers: energy (GeV), the three profiles, hits and the
    discriminator's regressed E'."""

    energy_gev: np.ndarray   # (n,)
    profiles: np.ndarray     # (n, 3, 25): energy per slice along x, y, z
    hits: np.ndarray         # (n,) cells above the threshold
    aux: np.ndarray          # (n,) the discriminator's E' (NaN: not evaluated)

    def __len__(self) -> int:
        return int(self.energy_gev.shape[0])

    def subset(self, mask: np.ndarray) -> "EventSummaries":
        return EventSummaries(self.energy_gev[mask], self.profiles[mask], self.hits[mask],
                              self.aux[mask])


def summarise(x: np.ndarray, energy_gev: np.ndarray, aux: np.ndarray | None = None,
              threshold: float = HIT_THRESHOLD_GEV) -> EventSummaries:
    """Per-event summaries of showers ``x`` (n, 25, 25, 25) or (n, 1, 25, 25, 25) in GeV."""
    x = np.asarray(x, dtype=np.float64).reshape(-1, GRID, GRID, GRID)
    n = x.shape[0]
    profiles = np.stack([x.sum(axis=(2, 3)), x.sum(axis=(1, 3)), x.sum(axis=(1, 2))], axis=1)
    hits = (x > threshold).reshape(n, -1).sum(axis=1).astype(np.float64)
    aux = (np.full(n, np.nan) if aux is None
           else np.asarray(aux, dtype=np.float64).reshape(n))
    return EventSummaries(np.asarray(energy_gev, dtype=np.float64).reshape(n), profiles, hits,
                          aux)


def concat(parts: list[EventSummaries]) -> EventSummaries:
    return EventSummaries(*(np.concatenate([getattr(p, name) for p in parts])
                            for name in ("energy_gev", "profiles", "hits", "aux")))


def moments(profiles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(first, second) moments of (n, 3, 25) profiles: energy-weighted mean slice index and
    standard deviation, (n, 3) each; NaN where a profile holds no energy."""
    index = np.arange(profiles.shape[-1], dtype=np.float64)
    total = profiles.sum(axis=-1)
    with np.errstate(invalid="ignore", divide="ignore"):
        first = (profiles * index).sum(axis=-1) / total
        var = (profiles * (index - first[..., None]) ** 2).sum(axis=-1) / total
    return first, np.sqrt(np.maximum(var, 0.0))


def relative_l1(real: np.ndarray, gen: np.ndarray) -> float | None:
    """sum|gen - real| / sum real of two profiles; None if the real one is empty."""
    total = float(np.sum(real))
    return float(np.sum(np.abs(np.asarray(gen) - real)) / total) if total > 0 else None


def mape(aux: np.ndarray, energy_gev: np.ndarray) -> float | None:
    """100 mean(|aux - E'| / E') over events with an aux value; None if none has one."""
    keep = np.isfinite(aux)
    if not keep.any():
        return None
    e = energy_gev[keep] / ENERGY_SCALE_GEV
    return float(100.0 * np.mean(np.abs(aux[keep] - e) / e))


def _mean(values: np.ndarray) -> float | None:
    values = values[np.isfinite(values)]
    return float(values.mean()) if values.size else None


def _ratio_minus_one(gen: float | None, real: float | None) -> float | None:
    return gen / real - 1.0 if gen is not None and real else None


Triple = tuple[float | None, float | None, float | None]


@dataclass(frozen=True)
class Side:
    """Per-bin means of one set of showers (real or generated)."""

    profiles: tuple[tuple[float, ...], ...]   # x, y, z: mean energy per slice (GeV)
    sampling_fraction: float | None           # mean sum / E
    sampling_fraction_std: float | None
    first_moment: Triple                      # x, y, z (slice index)
    second_moment: Triple
    hits: float | None
    aux_mape: float | None                    # %


def sum_over_energy(s: EventSummaries) -> np.ndarray:
    """Each event's Σcells ÷ E (GeV over GeV): the per-event sampling fraction."""
    return s.profiles[:, 0].sum(axis=1) / s.energy_gev


def bin_masks(energy_gev: np.ndarray, edges: tuple[float, ...] = ENERGY_BINS_GEV
              ) -> list[np.ndarray]:
    """Per energy bin [e_lo, e_hi) (the last one includes its upper edge), which events
    fall in it; events outside the edges fall in none."""
    which = np.digitize(energy_gev, edges[1:-1])   # 0 .. len(edges) - 2
    inside = (energy_gev >= edges[0]) & (energy_gev <= edges[-1])
    return [inside & (which == i) for i in range(len(edges) - 1)]


def _side(s: EventSummaries) -> Side:
    if not len(s):
        return Side(profiles=((), (), ()), sampling_fraction=None, sampling_fraction_std=None,
                    first_moment=(None, None, None), second_moment=(None, None, None),
                    hits=None, aux_mape=None)
    first, second = moments(s.profiles)
    fraction = sum_over_energy(s)
    return Side(profiles=tuple(tuple(float(v) for v in s.profiles[:, a].mean(axis=0))
                               for a in range(3)),
                sampling_fraction=_mean(fraction),
                sampling_fraction_std=float(fraction.std()) if fraction.size else None,
                first_moment=tuple(_mean(first[:, a]) for a in range(3)),
                second_moment=tuple(_mean(second[:, a]) for a in range(3)),
                hits=_mean(s.hits), aux_mape=mape(s.aux, s.energy_gev))


@dataclass(frozen=True)
class BinResult:
    """One energy bin [e_lo, e_hi) GeV (the last bin includes e_hi)."""

    e_lo_gev: float
    e_hi_gev: float
    events: int
    real: Side
    gen: Side
    profile_distance: Triple        # relative L1 per axis x, y, z
    sampling_fraction_rel_diff: float | None   # gen / real - 1
    hits_rel_diff: float | None
    sampling_fraction_rel_se: float | None = None   # its standard error (module doc)


@dataclass(frozen=True)
class Validation:
    """Generated against real showers, bin by bin, after ``epoch``."""

    epoch: int
    events: int
    threshold_gev: float
    bins: tuple[BinResult, ...]
    aux_mape_real: float | None
    aux_mape_gen: float | None
    outside_bins: int = 0   # events whose energy lies outside every bin
    gen_empty_fraction: float = 0.0   # generated showers without a cell above threshold
    generator: str = "raw"  # the trained weights; "standing": with standing BatchNorm
    #                         statistics (--validate-bn standing); "average": --generator-ema
    draws: int = 1          # generated showers per real event

    def summary(self) -> dict[str, float]:
        """Flat numbers for the epoch record: the event-weighted mean profile distance per
        axis, the largest |sampling fraction gen/real - 1| over the bins, the same for hits,
        the discriminator's MAPE on real and on generated showers, and the share of empty
        generated showers (a collapsed generator's sign; None values left out)."""
        out: dict[str, float | None] = {"events": float(self.events)}
        filled = [b for b in self.bins if b.events]
        for a, axis in enumerate(AXES):
            pairs = [(b.profile_distance[a], b.events) for b in filled
                     if b.profile_distance[a] is not None]
            weight = sum(n for _, n in pairs)
            out[f"profile_distance_{axis}"] = (sum(d * n for d, n in pairs) / weight
                                               if weight else None)
        for key, attr in (("sampling_fraction_worst_rel_diff", "sampling_fraction_rel_diff"),
                          ("hits_worst_rel_diff", "hits_rel_diff")):
            values = [abs(getattr(b, attr)) for b in filled if getattr(b, attr) is not None]
            out[key] = max(values) if values else None
        out["aux_mape_real"], out["aux_mape_gen"] = self.aux_mape_real, self.aux_mape_gen
        out["gen_empty_fraction"] = self.gen_empty_fraction
        return {k: round(float(v), 6) for k, v in out.items() if v is not None}

    def to_dict(self) -> dict:
        return asdict(self)


def _rel_se(rs: Side, gs: Side, n_real: int, n_gen: int) -> float | None:
    """Standard error of gen/real - 1 (module doc); None without two events a side."""
    g, r = gs.sampling_fraction, rs.sampling_fraction
    if not g or not r or n_real < 2 or n_gen < 2 or None in (gs.sampling_fraction_std,
                                                             rs.sampling_fraction_std):
        return None
    return (g / r) * float(np.sqrt((gs.sampling_fraction_std / g) ** 2 / n_gen
                                   + (rs.sampling_fraction_std / r) ** 2 / n_real))


def compare(real: EventSummaries, gen: EventSummaries, epoch: int,
            edges: tuple[float, ...] = ENERGY_BINS_GEV,
            threshold: float = HIT_THRESHOLD_GEV, generator: str = "raw") -> Validation:
    """Bin by bin comparison; ``gen`` holds the generator's showers at the energies of
    ``real``, event for event, once or K times over (K draws: ``real``'s energies repeated
    K times, draw after draw)."""
    draws = len(gen) // len(real) if len(real) else 1
    if (draws < 1 or len(gen) != draws * len(real)
            or not np.array_equal(np.tile(real.energy_gev, draws), gen.energy_gev)):
        raise ValueError("generated showers must be made at the real events' energies")
    e = real.energy_gev
    inside = (e >= edges[0]) & (e <= edges[-1])
    bins = []
    for i, mask in enumerate(bin_masks(e, edges)):
        r, g = real.subset(mask), gen.subset(np.tile(mask, draws))
        rs, gs = _side(r), _side(g)
        bins.append(BinResult(
            e_lo_gev=float(edges[i]), e_hi_gev=float(edges[i + 1]), events=int(mask.sum()),
            real=rs, gen=gs,
            profile_distance=tuple(relative_l1(np.array(rs.profiles[a]),
                                               np.array(gs.profiles[a])) if len(r) else None
                                   for a in range(3)),
            sampling_fraction_rel_diff=_ratio_minus_one(gs.sampling_fraction,
                                                        rs.sampling_fraction),
            hits_rel_diff=_ratio_minus_one(gs.hits, rs.hits),
            sampling_fraction_rel_se=_rel_se(rs, gs, len(r), len(g))))
    real_in, gen_in = real.subset(inside), gen.subset(np.tile(inside, draws))
    return Validation(epoch=epoch, events=int(inside.sum()), threshold_gev=threshold,
                      bins=tuple(bins), aux_mape_real=mape(real_in.aux, real_in.energy_gev),
                      aux_mape_gen=mape(gen_in.aux, gen_in.energy_gev),
                      outside_bins=int((~inside).sum()),
                      gen_empty_fraction=(float((gen_in.hits == 0).mean()) if len(gen_in)
                                          else 0.0), generator=generator, draws=draws)
