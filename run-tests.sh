#!/usr/bin/env bash
# Install what is missing (idempotent), then run the whole test suite.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
bash scripts/install.sh
source scripts/env.sh
exec python -m pytest -ra "$@"
