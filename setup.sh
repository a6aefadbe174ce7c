#!/usr/bin/env bash
# Install everything (idempotent) and run the default demo: a 2-rank MPI job through
# hpcai-launch, each rank reporting its rank, CPU binding and the libmpi it loaded.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash scripts/install.sh
source scripts/env.sh
exec hpcai-launch --ranks-per-node 2 --report-bindings -- python -m hpcai.launcher.probe
