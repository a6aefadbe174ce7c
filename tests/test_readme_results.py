"""The performance tables of README.md and docs/*.md are what the committed result files say.

``bench/render.py`` renders each ``<!-- results:NAME -->`` block from the newest
``bench/results/NAME-*.json``; these tests fail when a document and the files disagree, and
their negative controls show that a doctored file or a doctored document is caught. README.md
stays under README_LINES lines, with a control.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))

import common  # noqa: E402
import render  # noqa: E402

DOCS = {doc.relative_to(REPO).as_posix(): doc.read_text() for doc in render.documents(REPO)}
README = "".join(DOCS.values())   # every document, for the blocks' controls
RESULTS = REPO / "bench" / "results"
BLOCKS = render.BLOCK.findall(README)
README_LINES = 250
# the blocks of ratio rows
RATIO_BLOCKS = [b for b in BLOCKS if b[1] not in {"startup", "summary", *render.ALL_FILES}]
PROVENANCE = ("git_commit", "date", "machine", "cpus", "open_mpi", "threads_env", "packages",
              "load_average_at_start", "load_average_at_end")


def test_documents_have_results_blocks():
    assert {name for _, name, _, _ in BLOCKS} >= {"torch_baselines", "allreduce_bw", "training",
                                                   "learning", "startup", "summary"}
    assert "<!-- results:summary -->" in DOCS["README.md"]


@pytest.mark.parametrize("name", sorted(DOCS))
def test_document_matches_committed_results(name):
    assert render.render_readme(DOCS[name], RESULTS) == DOCS[name], \
        f"{name} differs from bench/results: run python bench/render.py"


def test_render_check_covers_readme_and_docs():
    """``render.py --check`` (what a contributor runs) reads README.md and docs/*.md."""
    assert {"README.md", "docs/benchmarks.md"} <= set(DOCS)


def too_long(text: str, limit: int = README_LINES) -> bool:
    """More lines than ``limit``: a README a newcomer cannot read in a few minutes."""
    return len(text.splitlines()) > limit


def test_readme_is_short():
    lines = len(DOCS["README.md"].splitlines())
    assert not too_long(DOCS["README.md"]), \
        f"README.md has {lines} lines (> {README_LINES}): move detail to docs/"


def test_negative_control_a_251_line_readme_is_too_long():
    assert too_long("line\n" * 251) and not too_long("line\n" * 250)


@pytest.mark.parametrize("name", sorted({n for _, n, _, _ in BLOCKS}
                                        - set(render.ALL_FILES) - {"summary"}))
def test_rendered_files_carry_provenance_and_trials(name):
    data = json.loads(render.newest(name, RESULTS).read_text())
    missing = [k for k in PROVENANCE if k not in data["provenance"]]
    assert not missing, f"{name} lacks provenance {missing}"
    assert data["trials"] and data["settings"]
    verdicts = ("met", "missed", "unresolved", "invalid", "report")
    for row in data.get("rows", []):
        if row["stats"] is not None:
            assert row["stats"]["n"] >= 1 and row["verdict"] in verdicts


def _doctored_copy(tmp_path: Path) -> Path:
    """A copy of the results in which the first measured row's median is changed."""
    out = tmp_path / "results"
    shutil.copytree(RESULTS, out)
    path = out / render.newest(RATIO_BLOCKS[0][1], RESULTS).name
    data = json.loads(path.read_text())
    row = next(r for r in data["rows"] if r["stats"] is not None)
    row["stats"]["median"] += 0.01
    path.write_text(json.dumps(data))
    return out


def test_negative_control_doctored_json_is_caught(tmp_path):
    assert render.render_readme(README, _doctored_copy(tmp_path)) != README


def test_negative_control_doctored_readme_is_caught():
    block = RATIO_BLOCKS[0][2]
    number = re.search(r"\d\.\d{3}", block).group(0)
    doctored = README.replace(block, block.replace(number, "9.999", 1), 1)
    assert doctored != README
    assert render.render_readme(doctored, RESULTS) != doctored


def test_startup_block_is_its_json_and_a_doctored_one_is_caught(tmp_path):
    """The start-up tables (bench/startup.py's own layout) follow the JSON too: a changed
    per-rank count or verdict in a copy of the file changes the rendered block."""
    assert "startup" in {name for _, name, _, _ in BLOCKS}
    out = tmp_path / "results"
    shutil.copytree(RESULTS, out)
    path = out / render.newest("startup", RESULTS).name
    data = json.loads(path.read_text())
    data["measured"]["srun/new"]["other ranks"]["shared_calls"]["median"] += 100
    data["verdicts"][0]["verdict"] = "missed"
    path.write_text(json.dumps(data))
    doctored = render.render_readme(README, out)
    assert doctored != README
    block = render.BLOCK.search(doctored[doctored.index("<!-- results:startup"):]).group(3)
    assert "| missed |" in block


def test_learning_block_shows_every_committed_run_and_a_doctored_one_is_caught(tmp_path):
    """The learning table has a row per seed of every ``learning-*.json`` (two with
    ``--generator-ema``: the average and the raw generator), each file with its provenance;
    a changed validation value or verdict in a copy changes the rendered block."""
    block = render.BLOCK.search(README[README.index("<!-- results:learning"):]).group(3)
    files = sorted(RESULTS.glob("learning-*.json"))
    assert files
    for f in files:
        data = json.loads(f.read_text())
        assert {"git_commit", "date", "machine", "cpus", "load_average_at_start",
                "load_average_at_end"} <= set(data["provenance"]), f.name
        sides = 2 if "raw_generator" in data else 1   # the average, then the raw control
        assert block.count(f"| `{f.name}` |") == sides * len(data["runs"]) >= 1
        if sides == 2:
            assert f"| {data['runs'][0]['seed']} (raw) |" in block
    out = tmp_path / "results"
    shutil.copytree(RESULTS, out)
    path = out / files[-1].name
    data = json.loads(path.read_text())
    data["runs"][0]["history"][-1]["sampling_fraction_worst_rel_diff"] = 0.0123
    data["verdict"]["passed"] = True
    path.write_text(json.dumps(data))
    doctored = render.render_readme(README, out)
    assert doctored != README
    new = render.BLOCK.search(doctored[doctored.index("<!-- results:learning"):]).group(3)
    assert "0.012" in new and "| passed |" in new


def test_negative_control_block_without_file_fails(tmp_path):
    with pytest.raises(FileNotFoundError):
        render.render_readme("<!-- results:nothing -->\n<!-- /results -->", tmp_path)


def test_interval_needs_six_trials_and_whole_interval_decides():
    five = common.RatioStats.of([1.0] * 5, [2.0] * 5)
    assert five.interval is None and common.verdict(five, "<=", 0.9) == "unresolved"
    ten = common.RatioStats.of([0.8, 0.85, 0.7, 0.8, 0.82, 0.8, 0.86, 0.8, 0.81, 0.95], [1] * 10)
    assert ten.interval == (0.8, 0.86) and ten.coverage > 0.95
    assert common.verdict(ten, "<=", 0.9) == "met"
    assert common.verdict(ten, "<=", 0.85) == "unresolved"
    assert common.verdict(ten, ">=", 0.9) == "missed"


def test_launches_are_the_units_of_the_across_launch_interval():
    """Eight launches of 20 trials each, every launch tight around its own level. When the
    launches agree, the row resolves; when their levels spread across the target, the pooled
    trials alone would still give a narrow interval below it, but the launch-level one
    straddles the target (the control: 'unresolved', not 'missed')."""
    def launches(levels):
        return [([lv + 0.001 * (i % 5) for i in range(20)], [1.0] * 20) for lv in levels]
    agree = common.Row.across_runs("k", "l", ">=", 0.95, launches([0.90, 0.91] * 4))
    assert agree.verdict == "missed" and agree.stats.interval[1] < 0.95
    spread = launches([0.80, 0.85, 0.90, 0.99, 0.84, 0.88, 1.02, 0.86])
    pooled = common.RatioStats.of([x for a, _ in spread for x in a], [1.0] * 160)
    assert common.verdict(pooled, ">=", 0.95) == "missed"
    row = common.Row.across_runs("k", "l", ">=", 0.95, spread)
    assert row.verdict == "unresolved" and row.stats.interval[1] > 0.95, row.stats
    assert "median ratio per launch: 0.802, 0.852" in row.note
    # with no target the same launches are reported with their interval, never judged
    reported = common.Row.across_runs("k", "l", "", None, spread)
    assert reported.verdict == "report" and reported.stats.interval == row.stats.interval


def test_negative_baseline_is_invalid_not_met():
    row = common.Row.measured("k", "l", "<=", 0.5, [0.1] * 6, [-0.2] * 6)
    assert row.verdict == "invalid" and "baseline" in row.note


def test_alternating_order_is_palindromic():
    assert common.alternating_order(["a", "b"], 4) == list("abbaabba")


def _untracked_results(repo: Path) -> list[str]:
    """Result files in ``repo``'s bench/results that git does not track (empty outside git)."""
    import subprocess
    if not (repo / ".git").exists():
        return []
    out = subprocess.run(["git", "-C", str(repo), "ls-files", "--others", "--exclude-standard",
                          "--", "bench/results"], capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_rendered_results_are_committed():
    """A README rendered from a file that is not committed fails on a clean clone: every file
    in bench/results must be tracked (commit it, or move it out, then re-render)."""
    assert _untracked_results(REPO) == [], "commit these result files and re-render the README"


def test_negative_control_untracked_result_is_reported(tmp_path):
    import subprocess
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "training-x.json").write_text("{}")
    assert _untracked_results(tmp_path) == ["bench/results/training-x.json"]
