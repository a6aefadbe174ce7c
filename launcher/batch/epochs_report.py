"""hpcai-launch report RUN_DIR, for one training run: its full epoch records.

Reads ``RUN_DIR/epochs.jsonl`` (written by the trainer, ``training/record.py``) and prints
every field of every epoch record, nested fields as ``peak.gflops_per_rank``: first the
set-up fields (model, peak, provenance, ...) once where every record has the same value,
then per epoch the rest. The console line
(``training/console.py``) keeps a few of them; this is the whole record. A line that is
not a readable epoch record is named as a ``warning:`` on stderr and left out.
"""

from __future__ import annotations

import sys
from pathlib import Path

from ...core.errors import UserError
from ...training.record import EpochRecord, OtherRecord, RecordError

EPOCHS_FILE = "epochs.jsonl"
SETUP = ("model", "framework", "flops_per_sample", "flop_convention", "peak.",
         "allreduce.overlap", "allreduce.bucket_mb", "provenance.", "eval.samples",
         "physics.events")   # fields shown once when every record has the same value


def flatten(value: object, prefix: str = "") -> dict[str, object]:
    """{"a.b": leaf} for nested dicts; lists stay as they are."""
    if not isinstance(value, dict):
        return {prefix: value}
    out: dict[str, object] = {}
    for key, inner in value.items():
        out.update(flatten(inner, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _text(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(_text(v) for v in value)
    return "-" if value is None else str(value)


def read(path: Path) -> tuple[list[EpochRecord], list[str]]:
    """The epoch records of ``path`` and a problem per line left out."""
    records, problems = [], []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path}: {exc}",
                        "give a run directory written by train --out") from exc
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(EpochRecord.from_json(line))
        except OtherRecord:
            continue
        except RecordError as exc:
            problems.append(f"{path}:{number}: {exc}; left out")
    return records, problems


def render(records: list[EpochRecord]) -> str:
    """Markdown: the fields common to all records, then each epoch's own."""
    flat = [{k: v for k, v in flatten(r.to_dict()).items() if k not in ("record", "version")}
            for r in records]
    keys = list(dict.fromkeys(k for f in flat for k in f))
    missing = object()
    common = [k for k in keys if k.startswith(SETUP)
              and all(f.get(k, missing) == flat[0].get(k, missing) for f in flat)]
    width = max(len(k) for k in keys)
    lines = [f"# Epoch records ({len(records)})", "", "## Set-up, the same in every epoch", "", "```"]
    lines += [f"{k:<{width}}  {_text(flat[0][k])}" for k in common]
    lines.append("```")
    for r, f in zip(records, flat):
        resumed = f", resumed at step {r.first_step}" if r.first_step else ""
        lines += ["", f"## Epoch {r.epoch} ({r.steps} steps{resumed})", "", "```"]
        lines += [f"{k:<{width}}  {_text(f[k])}" for k in keys if k in f and k not in common]
        lines.append("```")
    return "\n".join(lines) + "\n"


def run(run_dir: Path) -> int:
    """Print every epoch record of ``run_dir/epochs.jsonl``."""
    path = run_dir / EPOCHS_FILE
    records, problems = read(path)
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    if not records:
        raise UserError(f"no readable epoch record in {path}",
                        "give a run directory written by train --out after its first epoch")
    print(render(records), end="", flush=True)
    return 0
