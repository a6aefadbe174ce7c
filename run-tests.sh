#!/usr/bin/env bash
# Install what is missing (idempotent), then run the whole test suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash scripts/install.sh
source scripts/env.sh
# Horovod: built once from its patched sdist (~6 min), then a cached wheel. A failed build
# fails this script here, before any test runs.
bash scripts/build-horovod.sh
# mpi4py for the MPI-5 standard ABI (the ABI matrix): built once (~8 min), then cached.
bash scripts/build-mpi4py-abi.sh
# Strict: a skip fails its test unless it is a limit of the machine (tests/suite_rules.py).
export HPCAI_TESTS_STRICT=1
exec python -m pytest -ra --durations=25 "$@"
