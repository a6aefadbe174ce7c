#!/usr/bin/env bash
# Install everything (idempotent), then run the default demo: a short 2-rank 3DGAN training
# on generated showers through hpcai-launch. Every rank reports its CPU binding; rank 0
# prints one line per epoch (time, samples/s, % of peak, the main losses, the worst energy
# bin of the held-out validation); hpcai-launch report out/demo shows the full records.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash scripts/install.sh
source scripts/env.sh
rm -rf out/demo   # the demo's own output; a rerun starts fresh
exec hpcai-launch --ranks-per-node 2 --report-bindings -- \
  train 3dgan --generate 256 --epochs 2 --batch-size 4 --max-steps 4 --out out/demo
