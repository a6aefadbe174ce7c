"""bench/results holds small JSON summaries and the plots the docs show: no tracked file
there is over 256 KB, and the tracked files together stay under 5 MB. The control runs the
same check on a folder with a 300 KB file, which must fail."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "bench"))
from common import dump_result, rounded  # noqa: E402 - bench/ is not a package
FILE_LIMIT = 256 * 1024
TOTAL_LIMIT = 5 * 1024 * 1024


def tracked(repo: Path, folder: str) -> list[Path]:
    """The files git tracks under ``folder`` of ``repo`` that exist in the work tree (every
    file there when ``repo`` is not a git checkout, e.g. an unpacked source archive)."""
    done = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--", folder],
                          capture_output=True, text=True)
    if done.returncode != 0:
        return [f for f in (repo / folder).rglob("*") if f.is_file()]
    return [repo / name for name in done.stdout.split("\0") if name and (repo / name).is_file()]


def size_problems(files: list[Path]) -> list[str]:
    """Each file over FILE_LIMIT, and the total when it is over TOTAL_LIMIT."""
    sizes = {f: f.stat().st_size for f in files}
    problems = [f"{f}: {n:,} B > {FILE_LIMIT:,} B" for f, n in sizes.items() if n > FILE_LIMIT]
    total = sum(sizes.values())
    if total > TOTAL_LIMIT:
        problems.append(f"total {total:,} B > {TOTAL_LIMIT:,} B")
    return problems


def test_tracked_results_are_small():
    files = tracked(REPO, "bench/results")
    assert files, "git tracks nothing under bench/results"
    assert size_problems(files) == [], \
        "commit a JSON summary (with the artefact's SHA-256 and command), not the artefact"


def test_negative_control_a_300_kb_file_fails(tmp_path):
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    folder = tmp_path / "bench" / "results"
    folder.mkdir(parents=True)
    (folder / "small.json").write_text("{}")
    (folder / "big.bin").write_bytes(b"\0" * 300 * 1024)
    subprocess.run(["git", "-C", str(tmp_path), "add", "bench"], check=True)
    problems = size_problems(tracked(tmp_path, "bench/results"))
    assert len(problems) == 1 and "big.bin" in problems[0]


def test_negative_control_a_large_total_fails(tmp_path):
    files = []
    for k in range(21):   # 21 x 250 KB: each under the file limit, together over 5 MB
        f = tmp_path / f"part{k}.json"
        f.write_bytes(b" " * 250 * 1024)
        files.append(f)
    assert size_problems(files) == [f"total {21 * 250 * 1024:,} B > {TOTAL_LIMIT:,} B"]


def test_result_text_keeps_number_lists_on_one_line_and_reads_back():
    data = {"rows": [{"label": "a ÷ b [1,2]", "stats": [0.1, 2]}],
            "trials": rounded({"runs": [[0.0016234567891234, 1e-07, 3], [2.5]]})}
    text = dump_result(data)
    assert json.loads(text) == data
    assert '"runs": [\n' in text and "[0.00162346, 1e-07, 3]" in text
    assert '"label": "a \\u00f7 b [1,2]"' in text   # a string's text is left as it is
    assert rounded(0.0016234567891234) != 0.0016234567891234   # control: it does round
