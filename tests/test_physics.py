"""The physics validation's numbers on synthetic showers with known answers, and its controls:
identical real and generated showers give distance 0, shifted or scaled ones a known value."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hpcai.training import physics


def _showers(energies, cells) -> np.ndarray:
    """One shower per energy; ``cells`` is [(i, j, k, GeV), ...] for every event."""
    x = np.zeros((len(energies), 25, 25, 25))
    for i, j, k, value in cells:
        x[:, i, j, k] = value
    return x


def _lateral_gauss(energies, seed=0) -> np.ndarray:
    """Showers with a Gaussian longitudinal and lateral profile, sum = 2 % of E."""
    rng = np.random.default_rng(seed)
    idx = np.arange(25)
    out = []
    for e in energies:
        z = np.exp(-0.5 * ((idx - 8 - rng.normal(0, 0.3)) / 3.0) ** 2)
        t = np.exp(-0.5 * ((idx - 12) / 1.5) ** 2)
        cube = t[:, None, None] * t[None, :, None] * z[None, None, :]
        cube[cube < 1e-3] = 0   # no cells near the hit threshold
        out.append(cube / cube.sum() * 0.02 * e)
    return np.array(out)


ENERGIES = np.array([50.0, 60.0, 150.0, 250.0, 350.0, 450.0, 480.0])


def test_one_event_has_the_known_profiles_moments_hits_and_fraction():
    # 1 GeV at z=2 and 1 GeV at z=6, both at (x, y) = (3, 5): 2 hits, sum 2 GeV of 100 GeV
    x = _showers([100.0], [(3, 5, 2, 1.0), (3, 5, 6, 1.0)])
    s = physics.summarise(x, [100.0])
    assert s.profiles[0, 0, 3] == 2 and s.profiles[0, 1, 5] == 2
    assert s.profiles[0, 2, 2] == 1 and s.profiles[0, 2, 6] == 1 and s.hits[0] == 2
    first, second = physics.moments(s.profiles)
    assert first[0].tolist() == [3.0, 5.0, 4.0] and second[0].tolist() == [0.0, 0.0, 2.0]
    v = physics.compare(s, s, epoch=0)
    (bin_,) = [b for b in v.bins if b.events]
    assert (bin_.e_lo_gev, bin_.e_hi_gev) == (100.0, 200.0)
    assert bin_.real.sampling_fraction == pytest.approx(0.02)
    assert bin_.real.first_moment == (3.0, 5.0, 4.0) and bin_.real.hits == 2


def test_identical_showers_are_at_distance_zero():
    x = _lateral_gauss(ENERGIES)
    e_prime = ENERGIES / 100
    real = physics.summarise(x, ENERGIES, aux=e_prime)
    v = physics.compare(real, real, epoch=1)
    summary = v.summary()
    assert summary["profile_distance_x"] == summary["profile_distance_y"] == 0
    assert summary["profile_distance_z"] == 0
    assert summary["sampling_fraction_worst_rel_diff"] == 0
    assert summary["hits_worst_rel_diff"] == 0
    assert summary["aux_mape_real"] == summary["aux_mape_gen"] == 0
    assert summary["events"] == len(ENERGIES)
    assert [b.events for b in v.bins] == [2, 1, 1, 1, 2]


def test_a_shower_shifted_by_one_layer_has_the_known_distance():
    # z profile 1, 2, 1 GeV on layers 4-6, shifted to 5-7: |diff| = 1+1+1+1 of 4 -> 1.0
    real_x = _showers([100.0], [(12, 12, 4, 1.0), (12, 12, 5, 2.0), (12, 12, 6, 1.0)])
    gen_x = np.roll(real_x, 1, axis=3)
    v = physics.compare(physics.summarise(real_x, [100.0]), physics.summarise(gen_x, [100.0]),
                        epoch=0)
    (bin_,) = [b for b in v.bins if b.events]
    assert bin_.profile_distance == (0.0, 0.0, 1.0)
    assert bin_.gen.first_moment[2] - bin_.real.first_moment[2] == pytest.approx(1.0)
    assert bin_.sampling_fraction_rel_diff == pytest.approx(0.0)


def test_scaled_showers_and_a_biased_discriminator_give_known_errors():
    x = _lateral_gauss(ENERGIES, seed=1)
    e_prime = ENERGIES / 100
    real = physics.summarise(x, ENERGIES, aux=e_prime * 0.95)
    gen = physics.summarise(1.1 * x, ENERGIES, aux=e_prime * 1.2)
    summary = physics.compare(real, gen, epoch=2).summary()
    for axis in "xyz":
        assert summary[f"profile_distance_{axis}"] == pytest.approx(0.1)
    assert summary["sampling_fraction_worst_rel_diff"] == pytest.approx(0.1)
    assert summary["hits_worst_rel_diff"] == pytest.approx(0.0)   # same cells hit
    assert summary["aux_mape_real"] == pytest.approx(5.0)
    assert summary["aux_mape_gen"] == pytest.approx(20.0)


def test_empty_generated_showers_bins_outside_and_json():
    x = _lateral_gauss(ENERGIES)
    energies = np.append(ENERGIES, 600.0)   # outside 10-500 GeV
    x = np.concatenate([x, x[:1]])
    real = physics.summarise(x, energies)
    gen = physics.summarise(np.zeros_like(x), energies)
    v = physics.compare(real, gen, epoch=0)
    assert v.outside_bins == 1 and v.events == len(ENERGIES)
    summary = v.summary()
    assert summary["profile_distance_z"] == pytest.approx(1.0)   # all energy missing
    assert summary["sampling_fraction_worst_rel_diff"] == pytest.approx(1.0)
    assert all(b.gen.first_moment == (None, None, None) for b in v.bins)   # no energy
    assert "aux_mape_real" not in summary                          # no aux given
    json.dumps(v.to_dict(), allow_nan=False)


def test_generated_showers_must_share_the_real_energies():
    x = _lateral_gauss(ENERGIES)
    with pytest.raises(ValueError, match="energies"):
        physics.compare(physics.summarise(x, ENERGIES), physics.summarise(x, ENERGIES + 1), 0)


def test_physics_json_history_plots_and_the_run_report(tmp_path, capsys):
    from hpcai.slurm import report
    from hpcai.training import validation
    from hpcai.training.shower_data import DatasetIndex

    held_out = DatasetIndex((tmp_path / "Ele_9_0.h5",), (7,))
    x = _lateral_gauss(ENERGIES)
    real = physics.summarise(x, ENERGIES, aux=ENERGIES / 100)
    for epoch, scale in ((1, 1.5), (0, 2.0)):   # the last: a resumed run's epoch 0
        gen = physics.summarise(scale * x, ENERGIES, aux=ENERGIES / 100)
        validation.record(tmp_path, [physics.compare(real, gen, epoch)], held_out)
    doc = json.loads((tmp_path / "physics.json").read_text())
    assert [v["epoch"] for v in doc["validations"]] == [0]   # later epochs replaced
    assert doc["validations"][0]["summary"]["profile_distance_z"] == pytest.approx(1.0)
    assert report.main([str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "Held-out files: Ele_9_0.h5" in out and "| 0 | 7 |" in out
    assert "Judged: the trained generator." in out and "Beside it" not in out
    assert "| 10-100 | 2 | 0.02 / 0.04 | 1 | 1 | 1 |" in out
    for name in ("physics-profiles.png", "physics-sampling-fraction.png",
                 "physics-metrics.png"):
        assert (tmp_path / "rep" / name).read_bytes()[:4] == b"\x89PNG"
    # the negative control: a physics.json without a validation is refused, named
    (tmp_path / "physics.json").write_text(json.dumps({**doc, "validations": []}))
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error: " in err and "physics.json" in err and "hint: " in err


def test_the_run_report_names_the_average_and_shows_the_trained_generator_beside_it(
        tmp_path, capsys):
    """With --generator-ema physics.json judges the average first and keeps the trained
    generator under ``others``: the report says which is which and tabulates both; the
    control above (a run without an average) names the trained generator only."""
    from hpcai.slurm import report
    from hpcai.training import validation
    from hpcai.training.shower_data import DatasetIndex

    held_out = DatasetIndex((tmp_path / "Ele_9_0.h5",), (7,))
    x = _lateral_gauss(ENERGIES)
    real = physics.summarise(x, ENERGIES)
    average = physics.compare(real, physics.summarise(1.1 * x, ENERGIES), 0, generator="average")
    raw = physics.compare(real, physics.summarise(3.0 * x, ENERGIES), 0, generator="raw")
    validation.record(tmp_path, [average, raw], held_out)
    assert report.main([str(tmp_path), "--out", str(tmp_path / "rep")]) == 0
    out = capsys.readouterr().out
    assert "Judged: the generator's weight average (train --generator-ema)." in out
    assert "Beside it, on the same events: the trained generator." in out
    assert out.count("| 0 | 7 |") == 2
    assert "| 10-100 | 2 | 0.02 / 0.022 |" in out   # the bins are the average's


def test_empty_generated_showers_are_counted():
    """A collapsed generator (all-zero showers) shows as gen_empty_fraction 1; identical
    showers, the control, as 0."""
    x = _lateral_gauss(ENERGIES)
    real = physics.summarise(x, ENERGIES)
    empty = physics.summarise(np.zeros_like(x), ENERGIES)
    assert physics.compare(real, empty, epoch=0).summary()["gen_empty_fraction"] == 1.0
    assert physics.compare(real, real, epoch=0).summary()["gen_empty_fraction"] == 0.0
