"""hpcai-launch report: scaling rows from synthetic sweep results, the files it writes,
and per-file problems for bad points."""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

import pytest

from hpcai.launcher.batch import report
from hpcai.training.record import AllreduceTotals, EpochRecord, Peak, Provenance, RecordError
from hpcai.launcher.batch.report import (
    Row, collect, main, plot, render_markdown, write_csv, write_json)

# Epoch times per (ranks/node, threads) -> nodes -> repeat -> (epoch 0, epoch 1, epoch 2).
# Epoch 0 is the slow warm-up; the means of epochs 1-2 are 11 / 6 / 3.5 s for 1 x 4 and
# half that for 2 x 2.
TIMES = {
    (1, 4): {1: [(50.0, 10.0, 12.0), (50.0, 11.0, 11.0)],
             2: [(30.0, 6.0, 6.0), (30.0, 5.0, 7.0)],
             4: [(20.0, 3.5, 3.5), (20.0, 3.0, 4.0)]},
    (2, 2): {1: [(25.0, 5.0, 6.0), (25.0, 5.5, 5.5)],
             2: [(15.0, 3.0, 3.0), (15.0, 2.5, 3.5)],
             4: [(10.0, 1.75, 1.75), (10.0, 1.5, 2.0)]},
}
BATCH = 8  # per rank
GFLOP_PER_SAMPLE = 19.0


def _record(epoch: int, t: float, nodes: int, rpn: int, threads: int) -> dict:
    world = nodes * rpn
    samples = BATCH * 10 * world / t
    prov = Provenance(world_size=world, ranks_per_node=rpn, threads_per_rank=threads,
                      cpus_rank0=None, framework="pytorch", framework_version="2",
                      comm="mpi", comm_version="mpi4py 4", mpi_library_version="Open MPI",
                      libmpi=None, hosts=("n1",), git_revision="abc", torch="2")
    record = EpochRecord(
        model="3dgan", framework="pytorch", epoch=epoch, steps=10, first_step=0,
        epoch_time_s=t, compute_s=t, comm_s=0.0, grad_sync_s=0.0, grad_sync_imbalance_s=0.0,
        data_s=0.0, samples_per_rank=BATCH * 10, samples_per_s_per_rank=samples / world,
        samples_per_s=samples, flops_per_sample=GFLOP_PER_SAMPLE * 1e9, flop_convention="",
        gflops_per_rank=GFLOP_PER_SAMPLE * samples / world,
        gflops_total=GFLOP_PER_SAMPLE * samples,
        peak=Peak(gflops_per_rank=100.0, source="measured"),
        pct_of_peak=5.0 if epoch == 0 else 40.0 + epoch, lr=1e-3, losses={"g": 1.0},
        allreduce=AllreduceTotals(bytes_per_rank=0, calls=0, overlap=True, bucket_mb=4.0),
        max_rss_mb_per_rank=100.0, provenance=prov)
    return record.to_dict()


def _point(root: Path, nodes: int, rpn: int, threads: int, repeat: int,
           times: tuple[float, ...] | None, status: str = "done") -> Path:
    pdir = root / f"n{nodes}-r{rpn}-t{threads}-rep{repeat}"
    pdir.mkdir(parents=True)
    (pdir / "point.json").write_text(json.dumps({
        "nodes": nodes, "ranks_per_node": rpn, "threads_per_rank": threads, "repeat": repeat,
        "job_id": f"{1000 + nodes}", "status": status, "scaling": "weak"}))
    if times is not None:
        with open(pdir / "epochs.jsonl", "w") as handle:
            for epoch, t in enumerate(times):
                handle.write(json.dumps(_record(epoch, t, nodes, rpn, threads)) + "\n")
    return pdir


def _sweep(root: Path) -> Path:
    for (rpn, threads), by_nodes in TIMES.items():
        for nodes, repeats in by_nodes.items():
            for repeat, times in enumerate(repeats):
                _point(root, nodes, rpn, threads, repeat, times)
    return root


def _expected(rpn: int, threads: int, nodes: int, first: int = 1) -> dict:
    runs = TIMES[(rpn, threads)][nodes]
    world = nodes * rpn
    run_time = [sum(r[first:]) / len(r[first:]) for r in runs]
    run_samples = [sum(BATCH * 10 * world / t for t in r[first:]) / len(r[first:])
                   for r in runs]
    return {"time": sum(run_time) / len(run_time),
            "min": min(t for r in runs for t in r[first:]),
            "samples": sum(run_samples) / len(run_samples),
            "pflops": GFLOP_PER_SAMPLE * sum(run_samples) / len(run_samples) / 1e6}


def _rows_by_key(rows: list[Row]) -> dict[tuple[int, int, int], Row]:
    return {(r.ranks_per_node, r.threads_per_rank, r.nodes): r for r in rows}


def test_numbers_first_epoch_excluded(tmp_path: Path) -> None:
    rows, problems = collect(_sweep(tmp_path))
    assert problems == []
    assert [(r.ranks_per_node, r.threads_per_rank, r.nodes) for r in rows] == [
        (1, 4, 1), (1, 4, 2), (1, 4, 4), (2, 2, 1), (2, 2, 2), (2, 2, 4)]
    by = _rows_by_key(rows)
    # Hand-computed: 1 x 4 -> 11, 6, 3.5 s; linear 11, 5.5, 2.75 s.
    for (rpn, thr), scale in (((1, 4), 1.0), ((2, 2), 0.5)):
        for nodes, t, lin in ((1, 11.0, 11.0), (2, 6.0, 5.5), (4, 3.5, 2.75)):
            row = by[(rpn, thr, nodes)]
            assert row.time_s == pytest.approx(t * scale, abs=1e-12)
            assert row.linear_s == pytest.approx(lin * scale, abs=1e-12)
            assert abs(row.efficiency - lin / t) < 1e-9
            exp = _expected(rpn, thr, nodes)
            assert row.time_min_s == exp["min"]
            assert row.samples_per_s == pytest.approx(exp["samples"], rel=1e-12)
            assert row.pflops == pytest.approx(exp["pflops"], rel=1e-12)
            assert row.pct_of_peak == pytest.approx(41.5)   # epochs 1, 2: 41, 42; not 5
            assert (row.runs, row.epochs, row.scaling) == (2, 4, "weak")
            assert row.first_epoch_excluded
            assert row.peak_gflops_per_rank == 100.0
    assert by[(1, 4, 1)].time_min_s == 10.0
    assert by[(1, 4, 1)].efficiency == 1.0
    assert abs(by[(1, 4, 4)].efficiency - 2.75 / 3.5) < 1e-9


def test_include_first_epoch(tmp_path: Path) -> None:
    rows, _ = collect(_sweep(tmp_path), include_first_epoch=True)
    by = _rows_by_key(rows)
    assert by[(1, 4, 1)].time_s == pytest.approx(24.0)           # (72/3 + 72/3) / 2
    assert by[(1, 4, 2)].time_s == pytest.approx(14.0)           # 42/3
    assert abs(by[(1, 4, 2)].efficiency - (24.0 / 2) / 14.0) < 1e-9
    assert by[(1, 4, 1)].pct_of_peak == pytest.approx((5 + 41 + 42) / 3)
    assert by[(1, 4, 1)].epochs == 6 and not by[(1, 4, 1)].first_epoch_excluded
    assert "first (warm-up) included" in render_markdown(rows, [])


def test_markdown_rows_and_formula(tmp_path: Path) -> None:
    rows, problems = collect(_sweep(tmp_path))
    md = render_markdown(rows, problems)
    assert "## 1 rank x 4 threads (weak scaling)" in md
    assert "## 2 ranks x 2 threads (weak scaling)" in md
    assert ("| nodes | ranks/node | threads | time/epoch (s) | linear (s) | efficiency "
            "| samples/s | PFLOP/s | % of peak | runs |") in md
    assert "| 1 | 1 | 4 | 11.00 | 11.00 | 100.0 % |" in md
    assert "| 2 | 1 | 4 | 6.00 | 5.50 | 91.7 % |" in md
    assert "| 4 | 1 | 4 | 3.50 | 2.75 | 78.6 % |" in md
    assert "| 4 | 2 | 2 | 1.75 | 1.38 | 78.6 % |" in md
    assert "linear(n) = t(n0) * n0 / n" in md and "efficiency = linear / t" in md
    assert "per-rank batch fixed, epoch size fixed" in md
    assert "first epoch of each run left out" in md
    assert md.count("| 41.5 | 2 |") == 6
    assert "## Problems" not in md


def test_csv_and_json_round_trip(tmp_path: Path) -> None:
    rows, problems = collect(_sweep(tmp_path / "res"))
    write_csv(rows, tmp_path / "s.csv")
    with open(tmp_path / "s.csv", newline="") as handle:
        back = list(csv.DictReader(handle))
    assert len(back) == len(rows)
    for row, line in zip(rows, back):
        assert int(line["nodes"]) == row.nodes and int(line["runs"]) == row.runs
        for name in ("time_s", "time_min_s", "linear_s", "efficiency", "samples_per_s",
                     "pflops", "pct_of_peak"):
            assert float(line[name]) == getattr(row, name), name
        assert line["points"].split(";") == row.points
    write_json(rows, ["a problem"], tmp_path / "s.json")
    doc = json.loads((tmp_path / "s.json").read_text())
    assert [Row(**r) for r in doc["rows"]] == rows
    assert doc["problems"] == ["a problem"]
    assert "t(n0) * n0 / n" in doc["formula"]


def test_plot_png(tmp_path: Path) -> None:
    rows, _ = collect(_sweep(tmp_path / "res"))
    png = tmp_path / "scaling.png"
    plot(rows, png)
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000


def test_bad_points_reported_per_file_rest_tabulated(tmp_path: Path) -> None:
    root = _sweep(tmp_path / "res")
    corrupt = _point(root, 8, 1, 4, 0, (9.0, 2.0, 2.0))
    with open(corrupt / "epochs.jsonl", "a") as handle:
        handle.write('{"epoch": 3, "epoch_time_s": 1.\n')
    no_epochs = _point(root, 8, 1, 4, 1, None)
    failed = _point(root, 16, 1, 4, 0, None, status="failed")
    pending = _point(root, 16, 1, 4, 1, None, status="pending")
    orphan = root / "n32-orphan"
    orphan.mkdir()
    (orphan / "epochs.jsonl").write_text(json.dumps(_record(0, 1.0, 32, 1, 4)) + "\n")
    missing_field = _point(root, 8, 2, 2, 0, (9.0, 2.0))
    rec = _record(1, 2.0, 8, 2, 2)
    del rec["gflops_total"]
    (missing_field / "epochs.jsonl").write_text(
        json.dumps(_record(0, 9.0, 8, 2, 2)) + "\n" + json.dumps(rec) + "\n")
    mislabelled = _point(root, 16, 2, 2, 0, None)
    (mislabelled / "epochs.jsonl").write_text(
        "".join(json.dumps(_record(e, 1.0, 8, 2, 2)) + "\n" for e in range(2)))

    rows, problems = collect(root)
    assert len(rows) == 6 and {r.nodes for r in rows} == {1, 2, 4}
    assert _rows_by_key(rows)[(1, 4, 2)].time_s == pytest.approx(6.0)
    assert len(problems) == 7, problems

    def one(path: Path, *words: str) -> None:
        hits = [p for p in problems if p.startswith(str(path))]
        assert len(hits) == 1, (path, problems)
        assert all(w in hits[0] for w in words), hits[0]

    one(corrupt / "epochs.jsonl:4", "not JSON", "skipped")
    one(no_epochs / "epochs.jsonl", "missing", "skipped")
    one(failed / "point.json", "status failed", "skipped")
    one(pending / "point.json", "'pending', not done")
    one(orphan / "point.json", "missing")
    one(missing_field / "epochs.jsonl:2", "'gflops_total' missing")
    one(mislabelled / "epochs.jsonl:1", "provenance.world_size is 16 but point.json says 32")


def test_single_epoch_run_used_and_noted(tmp_path: Path) -> None:
    root = tmp_path / "res"
    single = _point(root, 1, 1, 4, 0, (7.0,))
    _point(root, 2, 1, 4, 0, (9.0, 4.0, 4.0))
    rows, problems = collect(root)
    assert [r.time_s for r in rows] == [7.0, 4.0]
    assert not rows[0].first_epoch_excluded and rows[1].first_epoch_excluded
    assert problems == [f"{single / 'epochs.jsonl'}: only one epoch (0); used it, "
                        "warm-up included"]
    assert rows[0].notes == problems
    md = render_markdown(rows, problems)
    assert "| 1 | 1 | 4 | 7.00* |" in md and "| 2 | 1 | 4 | 4.00 |" in md
    assert "## Problems" in md and "only one epoch" in md


def test_main_writes_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = _sweep(tmp_path / "res")
    _point(root, 8, 1, 4, 0, None, status="failed")
    out = tmp_path / "report-out"
    assert main([str(root), "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "| 2 | 1 | 4 | 6.00 | 5.50 | 91.7 % |" in captured.out
    assert "warning: " in captured.err and "status failed" in captured.err
    for name in ("scaling.md", "scaling.csv", "scaling.json", "scaling.png"):
        assert (out / name).stat().st_size > 0, name
    assert (out / "scaling.md").read_text() == captured.out
    assert not any((root / n).exists() for n in report.OUTPUT_NAMES)


def test_main_default_out_and_first_epoch_flag(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    root = _sweep(tmp_path / "res")
    assert main([str(root), "--include-first-epoch"]) == 0
    doc = json.loads((root / "scaling.json").read_text())
    assert doc["rows"][0]["time_s"] == pytest.approx(24.0)
    assert (root / "scaling.png").exists()
    capsys.readouterr()
    assert main([str(root)]) == 0      # its own outputs in RESULTS do not disturb a rerun
    assert json.loads((root / "scaling.json").read_text())["rows"][0]["time_s"] == 11.0


@pytest.mark.parametrize("layout", ["empty", "all_bad", "missing"])
def test_main_no_usable_results(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                layout: str) -> None:
    root = tmp_path / "res"
    if layout != "missing":
        root.mkdir()
    if layout == "all_bad":
        _point(root, 1, 1, 4, 0, None, status="failed")
        _point(root, 2, 1, 4, 0, None)
    assert main([str(root)]) == 2
    err = capsys.readouterr().err
    assert "hint: " in err
    if layout == "missing":
        assert f"error: {root} is not a directory" in err
    else:
        assert f"error: no usable results in {root}" in err
        assert not (root / "scaling.md").exists()
    if layout == "all_bad":
        assert err.count("warning: ") == 2
        assert "2 point directories found, none usable" in err


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "hint: " in err


# The keys of an epoch record as the trainer writes them (schema 1), in order.
RECORD_KEYS = [
    "record", "version", "model", "framework", "epoch", "steps", "first_step", "epoch_time_s",
    "compute_s", "comm_s", "grad_sync_s", "grad_sync_imbalance_s", "data_s",
    "samples_per_rank", "samples_per_s_per_rank", "samples_per_s", "flops_per_sample",
    "flop_convention", "gflops_per_rank", "gflops_total", "peak", "pct_of_peak", "lr",
    "losses", "allreduce", "max_rss_mb_per_rank", "provenance"]


def test_record_keys_and_round_trip() -> None:
    doc = _record(1, 2.0, 2, 2, 4)
    assert list(doc) == RECORD_KEYS and len(doc) == 27
    assert list(doc["peak"]) == ["gflops_per_rank", "source"]
    assert list(doc["allreduce"]) == ["bytes_per_rank", "calls", "overlap", "bucket_mb"]
    line = json.dumps(doc)
    record = EpochRecord.from_json(line)
    assert record.provenance.hosts == ("n1",) and record.eval is None
    assert json.loads(record.to_json()) == json.loads(line)
    doc["eval"] = {"samples": 4, "aux_rel_error": 0.5}
    with_eval = EpochRecord.from_json(json.dumps(doc))
    assert list(with_eval.to_dict()) == RECORD_KEYS + ["eval"]
    assert with_eval.eval == {"samples": 4, "aux_rel_error": 0.5}


@pytest.mark.parametrize("change,message", [
    ({"version": 2}, "schema version 2, but this hpcai reads version 1 only"),
    ({"version": None}, "field 'version' not an integer (None)"),
    ({"steps": 1.5}, "field 'steps' not an integer (1.5)"),
    ({"epoch_time_s": "fast"}, "field 'epoch_time_s' not a number ('fast')"),
    ({"peak": 3}, "field 'peak' not an object (3)"),
    ({"losses": {"g": "x"}}, "field 'losses' not an object of numbers"),
])
def test_record_errors_name_the_field(change, message) -> None:
    doc = {**_record(1, 2.0, 1, 1, 4), **change}
    with pytest.raises(RecordError, match=re.escape(message)):
        EpochRecord.from_json(json.dumps(doc))
    nested = _record(1, 2.0, 1, 1, 4)
    del nested["provenance"]["threads_per_rank"]
    with pytest.raises(RecordError, match="field 'provenance.threads_per_rank' missing"):
        EpochRecord.from_dict(nested)


def test_unknown_schema_version_is_named_and_skipped(tmp_path: Path) -> None:
    root = tmp_path / "res"
    newer = _point(root, 1, 1, 4, 0, None)
    doc = _record(0, 2.0, 1, 1, 4)
    doc["version"] = 2
    (newer / "epochs.jsonl").write_text(json.dumps(doc) + "\n")
    _point(root, 2, 1, 4, 0, (9.0, 4.0, 4.0))
    rows, problems = collect(root)
    assert [r.nodes for r in rows] == [2]
    assert problems == [f"{newer / 'epochs.jsonl'}:1: epoch record schema version 2, but this "
                        "hpcai reads version 1 only (written by another hpcai version? read it "
                        "with that one); skipped"]
