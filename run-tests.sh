#!/usr/bin/env bash
# Install what is missing (idempotent), then run the test suite.
#   ./run-tests.sh [PYTEST ARGS]         the whole suite (what CI runs), in pytest-xdist
#       workers, one per core and one more (at most 4), each running whole files
#   ./run-tests.sh --fast [PYTEST ARGS]  the fast tier, `pytest -m fast`: the unit and golden
#       tests, which start no MPI job, no Slurm, no container and no training run longer than
#       a second (tests/fast_tier.py lists them). It skips the Horovod and
#       mpi4py-ABI builds, which only the whole suite needs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
bash scripts/install.sh
source scripts/env.sh
# Strict: a skip fails its test unless it is a limit of the machine (tests/suite_rules.py).
export HPCAI_TESTS_STRICT=1
if ((fast)); then
  exec python -m pytest -m fast -ra --durations=10 "$@"
fi
# Horovod: built once from its patched sdist (~6 min), then a cached wheel. A failed build
# fails this script here, before any test runs.
bash scripts/build-horovod.sh
# mpi4py for the MPI-5 standard ABI (the ABI matrix): built once (~8 min), then cached.
bash scripts/build-mpi4py-abi.sh
# One pytest worker per core and one more (at most 4), each taking whole files, so a
# module's fixtures are made once. The suite is mostly CPU-bound, but many of its tests wait
# (a frozen rank for the watchdog, a Slurm job, a signal's checkpoint, a timeout): the
# extra worker uses the CPUs meanwhile.
workers=$(( $(nproc) + 1 ))
exec python -m pytest -ra --durations=25 --numprocesses="$(( workers < 4 ? workers : 4 ))" \
  --dist=loadfile "$@"
