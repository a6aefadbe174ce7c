#!/usr/bin/env bash
# Build mpi4py for the MPI-5 standard ABI (MPI4PY_BUILD_MPIABI=1 with MPICH 5's mpicc_abi,
# from PyPI's sdist; needs Cython) once, and cache the wheel under
# $HPCAI_CACHE/wheels/mpi4py-mpiabi-<mpi4py>-<mpich> (a few minutes the first time, then
# nothing). The ABI-matrix tests put it into a variant of the project's image.
# Usage: scripts/build-mpi4py-abi.sh [--print-dir]
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HPCAI_VENV:-$ROOT/.venv}
MPI4PY_VERSION=$("$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('mpi4py'))")
MPICH=$VENV/opt/mpich5
MPICH_VERSION=$(cd / && PYTHONPATH=$(echo "$MPICH"/lib/python3*/site-packages) "$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('mpich'))")
CACHE=${HPCAI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpcai}
OUT=$CACHE/wheels/mpi4py-mpiabi-$MPI4PY_VERSION-mpich$MPICH_VERSION
if [ "${1:-}" = --print-dir ]; then echo "$OUT"; exit 0; fi
if compgen -G "$OUT/mpi4py-*.whl" >/dev/null; then
  echo "[build-mpi4py-abi] cached: $OUT"; exit 0
fi
if [ ! -x "$MPICH/bin/mpicc_abi" ]; then
  echo "error: $MPICH/bin/mpicc_abi is missing" >&2
  echo "hint: run scripts/install.sh first (it installs MPICH 5 into $MPICH)" >&2; exit 2
fi
echo "[build-mpi4py-abi] building mpi4py $MPI4PY_VERSION for the standard ABI (MPICH $MPICH_VERSION)"
tmp=$(mktemp -d "$CACHE/wheels/.mpiabi-XXXXXX")
trap 'rm -rf "$tmp"' EXIT
(cd / && MPI4PY_BUILD_MPIABI=1 MPICC="$MPICH/bin/mpicc_abi" "$VENV/bin/python" -m pip wheel -q \
   --disable-pip-version-check --no-deps --no-build-isolation --no-binary mpi4py -w "$tmp" \
   "mpi4py==$MPI4PY_VERSION")
mv "$tmp" "$OUT"
trap - EXIT
echo "[build-mpi4py-abi] built: $OUT"
