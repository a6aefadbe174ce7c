"""The physics validation's numbers on synthetic showers with known answers, and its controls:
identical real and generated showers give distance 0, shifted or scaled ones a known value."""

from __future__ import annotations

import json
import os
from pathlib import Path

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


def _summaries(energy: np.ndarray, fraction: np.ndarray) -> physics.EventSummaries:
    """Events whose only energy is ``fraction`` x E, in one cell of each profile."""
    profiles = np.zeros((len(energy), 3, 25))
    profiles[:, :, 12] = (fraction * energy)[:, None]
    return physics.EventSummaries(energy, profiles, np.ones(len(energy)),
                                  np.full(len(energy), np.nan))


def test_draws_repeat_the_real_energies_and_the_standard_error_is_the_spread_of_the_diff():
    """K generated showers per real event: a bin keeps its real event count, and the standard
    error of gen/real - 1 matches the spread of that difference over many repeated samples
    (Monte Carlo: 400 samples of 30 real events and 2 x 30 generated, 30 % event-to-event
    spread on the generated side, 1.5 % on the real)."""
    rng = np.random.default_rng(5)
    diffs, errors = [], []
    for _ in range(400):
        energy = rng.uniform(110.0, 190.0, 30)           # all in the 100-200 GeV bin
        real = _summaries(energy, 0.02 * (1 + 0.015 * rng.standard_normal(30)))
        gen = _summaries(np.tile(energy, 2), 0.02 * (1 + 0.3 * rng.standard_normal(60)))
        v = physics.compare(real, gen, 0)
        assert v.draws == 2
        b = v.bins[1]
        assert (b.events, v.events) == (30, 30)
        diffs.append(b.sampling_fraction_rel_diff)
        errors.append(b.sampling_fraction_rel_se)
    assert np.mean(errors) == pytest.approx(np.std(diffs), rel=0.15)
    assert np.mean(errors) == pytest.approx(0.3 / np.sqrt(60), rel=0.1)
    # the control: one draw has a standard error sqrt(2) larger
    one = physics.compare(real, _summaries(energy, gen.profiles[:30, 0, 12] / energy), 0)
    assert one.draws == 1 and one.bins[1].sampling_fraction_rel_se > b.sampling_fraction_rel_se
    with pytest.raises(ValueError, match="energies"):      # draws made at other energies
        physics.compare(real, _summaries(np.concatenate([energy, energy + 1]),
                                         np.full(60, 0.02)), 0)
    with pytest.raises(ValueError, match="energies"):      # not a whole number of draws
        physics.compare(real, _summaries(energy[:29], np.full(29, 0.02)), 0)


def test_physics_json_history_plots_and_the_run_report(tmp_path, capsys):
    from hpcai.launcher.batch import report
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
    from hpcai.launcher.batch import report
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


@pytest.mark.mpi
def test_a_run_with_two_draws_judges_twice_the_generated_showers_of_the_same_events(
        tmp_path):
    """``--validate-draws 2`` with the weight average on: every generator is judged on two
    showers per held-out event, the real side is the one-draw run's. The control is the
    one-draw run of the same seed: same real side, other generated numbers."""
    from jobs import train

    args = ["3dgan", "--generate", "8", "--batch-size", "1", "--max-steps", "2",
            "--validate-every", "1", "--validate-events", "8", "--eval-samples", "0",
            "--peak-gflops", "50", "--cell-scale", "100", "--epochs", "1",
            "--generator-ema", "0.5"]
    last = {}
    for draws in (1, 2):
        out = tmp_path / f"draws{draws}"
        result = train(2, *args, "--validate-draws", str(draws), "--out", str(out))
        assert result.returncode == 0, result.stderr[-2000:]
        last[draws] = json.loads((out / "physics.json").read_text())["validations"][-1]
    one, two = last[1], last[2]
    assert (one["draws"], two["draws"], two["others"][0]["draws"]) == (1, 2, 2)
    assert two["events"] == one["events"] == 8
    assert [b["events"] for b in two["bins"]] == [b["events"] for b in one["bins"]]
    assert [b["real"] for b in two["bins"]] == [b["real"] for b in one["bins"]]
    assert [b["gen"] for b in two["bins"]] != [b["gen"] for b in one["bins"]]
    assert all(b["sampling_fraction_rel_se"] is None or b["sampling_fraction_rel_se"] > 0
               for b in two["bins"])


@pytest.mark.parametrize("mask", [0o022, 0o027])
def test_physics_json_gets_the_umasks_permissions(mask, tmp_path):
    """physics.json is written atomically but, like the run's other files, with the umask's
    permissions (0644 under 022, 0640 under 027): it was 0600, from mkstemp, so nobody else in
    a shared project directory could read it. Two umasks, so the mode follows the umask and
    is not a constant; no temporary file is left behind."""
    from hpcai.training import validation
    from hpcai.training.shower_data import DatasetIndex

    held_out = DatasetIndex((tmp_path / "Ele_9_0.h5",), (7,))
    real = physics.summarise(_lateral_gauss(ENERGIES), ENERGIES, aux=ENERGIES / 100)
    old = os.umask(mask)
    try:
        validation.record(tmp_path, [physics.compare(real, real, 0)], held_out)
    finally:
        os.umask(old)
    assert (tmp_path / "physics.json").stat().st_mode & 0o777 == 0o666 & ~mask
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".physics.json")]


@pytest.mark.parametrize("values", [[2.0, 3.0, 5.0], [0.031, 0.05], [1e-4, 3.0, 700.0]])
def test_a_profile_axis_always_shows_two_labelled_decades(values):
    """The profile plots turn minor ticks off (half the drawing time); ``_log_axis`` then
    widens the y range so that two major ticks, each labelled, fall inside it. Control: the
    same data on a plain log axis without minor ticks shows fewer than two when they span
    less than a decade."""
    from hpcai.training import physics_plots

    def majors(ax) -> list[float]:
        ax.figure.canvas.draw()
        lo, hi = ax.get_ylim()
        return [t for t in ax.yaxis.get_majorticklocs() if lo <= t <= hi]

    fig = physics_plots._figure(4, 3, title=False)
    ax = fig.add_subplot()
    ax.step(range(len(values)), values)
    physics_plots._log_axis(ax, values)
    assert len(majors(ax)) >= 2, (values, ax.get_ylim())
    assert all(label.get_text() for label in ax.get_yticklabels()
               if ax.get_ylim()[0] <= label.get_position()[1] <= ax.get_ylim()[1])
    assert not ax.yaxis.get_minorticklocs().size
    lo, hi = ax.get_ylim()
    assert lo <= min(values) and hi >= max(values)

    control = physics_plots._figure(4, 3, title=False).add_subplot()
    control.step(range(len(values)), values)
    control.set_yscale("log")
    control.minorticks_off()
    if max(values) / min(values) < 10:
        assert len(majors(control)) < 2, control.get_ylim()


def test_a_failed_redraw_leaves_the_last_plots_whole(tmp_path, monkeypatch):
    """``write_plots`` draws each PNG into a temporary file and renames it: a redraw that
    fails half-way through writing leaves the previous PNG as it was and no temporary file.
    Control: the same failing write straight into the PNG leaves it cut short."""
    from matplotlib.figure import Figure

    from hpcai.training import physics_plots

    doc = {"axes": list(physics.AXES), "validations": [{
        **physics.compare(physics.summarise(_lateral_gauss(ENERGIES), ENERGIES,
                                            aux=ENERGIES / 100),
                          physics.summarise(1.5 * _lateral_gauss(ENERGIES), ENERGIES,
                                            aux=ENERGIES / 100), 0).to_dict(),
        "summary": {"profile_distance_x": 0.5}}]}
    paths = physics_plots.write_plots(doc, tmp_path)
    before = {p: p.read_bytes() for p in paths}
    assert all(b[:4] == b"\x89PNG" for b in before.values())

    def half_then_fail(self, fname, **kwargs):
        Path(fname).write_bytes(before[paths[0]][:100])
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", half_then_fail)
    with pytest.raises(OSError, match="disk full"):
        physics_plots.write_plots(doc, tmp_path)
    assert {p: p.read_bytes() for p in paths} == before
    assert sorted(q.name for q in tmp_path.iterdir()) == sorted(physics_plots.PLOT_NAMES)
    with pytest.raises(OSError):       # the control: written in place, the PNG is cut short
        physics_plots.profiles(doc, paths[0])
    assert len(paths[0].read_bytes()) == 100


def test_the_plot_clock_redraws_at_most_every_interval_and_always_at_the_end():
    """``PlotClock`` on a fake clock: within the interval of its start or of the last
    drawing a validation is not drawn (``behind``), the run's last one always is, and one
    after the interval is again; a validation stays ``behind`` until it is drawn (a drawing
    that fails leaves it so). Control: an interval of 0 draws every validation."""
    from hpcai.training.validation import PlotClock

    now = [0.0]
    clock = PlotClock(every_s=60.0, clock=lambda: now[0])
    plan = []
    for t, last in ((10.0, False), (59.0, False), (61.0, False), (90.0, False), (95.0, True)):
        now[0] = t
        due = clock.due(last)
        plan.append((due, clock.behind))
        if due:
            clock.drawn()
            assert not clock.behind
    assert plan == [(False, True), (False, True), (True, True), (False, True), (True, True)]
    every = PlotClock(every_s=0.0, clock=lambda: now[0])
    assert all(every.due(last=False) for _ in range(3)) and every.behind
    every.drawn()
    assert not every.behind


def test_plots_behind_physics_json_are_found_on_resume(tmp_path):
    """``plots_behind`` (a resumed run's ``PlotClock`` starts ``behind`` with it): no
    physics.json, nothing behind; a plot missing or older than physics.json, behind; every
    plot as new as physics.json or newer (the control), not behind."""
    from hpcai.training.physics_plots import PHYSICS_FILE, PLOT_NAMES
    from hpcai.training.validation import plots_behind

    assert not plots_behind(tmp_path)
    (tmp_path / PHYSICS_FILE).write_text("{}")
    assert plots_behind(tmp_path)                           # no plot yet
    for name in PLOT_NAMES:
        (tmp_path / name).write_bytes(b"png")
    written = (tmp_path / PHYSICS_FILE).stat().st_mtime_ns
    for name in PLOT_NAMES:
        os.utime(tmp_path / name, ns=(written, written))
    assert not plots_behind(tmp_path)                       # the control
    os.utime(tmp_path / PLOT_NAMES[1], ns=(written - 10**9, written - 10**9))
    assert plots_behind(tmp_path)                           # one older than the JSON
