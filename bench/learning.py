"""Does the 3DGAN learn? A short 2-rank training on generated showers (several minutes).

Prints, epoch by epoch, the discriminator's auxiliary energy error on a fixed sample of real
showers (mean |aux - E'| / E') and Σcells / f(E') of generated showers (1 is physical; a
fresh generator is far off), from the epoch records. Writes bench/results/learning.json.

    python bench/learning.py [--epochs 6] [--events 1024] [--batch-size 8]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from common import loopback_env


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--events", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--json", default="bench/results/learning.json")
    args = parser.parse_args()
    env = loopback_env()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        argv = ["hpcai-launch", "-N", "2", "--", "train", "3dgan", "--generate",
                str(args.events), "--epochs", str(args.epochs), "--batch-size",
                str(args.batch_size), "--max-steps", str(args.max_steps), "--eval-samples",
                "64", "--out", str(out)]
        result = subprocess.run(argv, env=env, text=True, timeout=7200)
        if result.returncode != 0:
            return result.returncode
        records = [json.loads(line) for line in (out / "epochs.jsonl").read_text().splitlines()]
    rows = [{"epoch": r["epoch"], **r["eval"], "d_real_aux_loss": r["losses"]["d_real_aux"],
             "g_ecal_loss": r["losses"]["g1_ecal"]} for r in records]
    print("\nepoch  aux_rel_error  gen_sum/f(E')  real_sum/f(E')")
    for row in rows:
        print(f"{row['epoch']:5d}  {row['aux_rel_error']:13.3f}  {row['gen_sum_over_f']:13.3f}"
              f"  {row['real_sum_over_f']:14.3f}")
    first, last = rows[0], rows[-1]
    summary = {
        "aux_rel_error_first_last": [first["aux_rel_error"], last["aux_rel_error"]],
        "gen_sum_over_f_first_last": [first["gen_sum_over_f"], last["gen_sum_over_f"]],
        "aux_error_fell": last["aux_rel_error"] < first["aux_rel_error"],
        "sum_ratio_moved_toward_1": abs(last["gen_sum_over_f"] - 1) <
        abs(first["gen_sum_over_f"] - 1),
        "rows": rows,
    }
    print(f"aux error fell: {summary['aux_error_fell']}; generated sum/f moved toward 1: "
          f"{summary['sum_ratio_moved_toward_1']}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
