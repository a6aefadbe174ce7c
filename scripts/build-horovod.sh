#!/usr/bin/env bash
# Build Horovod 0.28.1 (the last release) from its PyPI sdist against the MPI on PATH and the
# PyTorch / TensorFlow installed in the venv, and install it there.
#
# The sdist does not build as is against current frameworks; this script applies the fixes:
#   * C++17 instead of C++14 (root and horovod/torch CMakeLists): PyTorch 2.x headers need it;
#   * drop horovod/tensorflow/xla_mpi_ops.cc: it does not compile against TensorFlow 2.21
#     (only XLA-compiled Horovod ops need it; the normal TF ops are unaffected).
# Gloo and MXNet are left out: hpcai runs Horovod over MPI only.
#
# The wheel is cached under $HPCAI_CACHE/wheels (default ~/.cache/hpcai), keyed by the
# Horovod, torch, TensorFlow and MPI versions, so a second run only installs it (seconds).
#
# Usage: scripts/build-horovod.sh [--torch-only | --tf-only] [--check]
#   --check   exit 0 if Horovod already imports with the wanted frameworks, 1 otherwise
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HPCAI_VENV:-$ROOT/.venv}
PY="$VENV/bin/python"
export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-3}   # quiet imports of TensorFlow
HOROVOD_VERSION=0.28.1
CACHE=${HPCAI_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpcai}
WITH_TORCH=auto WITH_TF=auto CHECK=0
for arg in "$@"; do
  case $arg in
    --torch-only) WITH_TF=no ;;
    --tf-only) WITH_TORCH=no ;;
    --check) CHECK=1 ;;
    *) echo "error: unknown argument $arg" >&2
       echo "hint: scripts/build-horovod.sh [--torch-only | --tf-only] [--check]" >&2; exit 2 ;;
  esac
done
say() { echo "[build-horovod] $*"; }

has() { "$PY" -c "import $1" 2>/dev/null; }
[ "$WITH_TORCH" = auto ] && { has torch && WITH_TORCH=yes || WITH_TORCH=no; }
[ "$WITH_TF" = auto ] && { has tensorflow && WITH_TF=yes || WITH_TF=no; }
if [ "$WITH_TORCH$WITH_TF" = nono ]; then
  echo "error: neither torch nor tensorflow imports in $VENV" >&2
  echo "hint: run scripts/install.sh first" >&2; exit 2
fi

want=()
[ "$WITH_TORCH" = yes ] && want+=(horovod.torch)
[ "$WITH_TF" = yes ] && want+=(horovod.tensorflow)
imports_ok() {
  for m in "${want[@]}"; do
    (cd / && "$PY" -c "import $m" 2>/dev/null) || return 1
  done
}
if imports_ok && [ -s "$VENV/.hpcai-horovod-wheel" ]; then
  say "horovod already installed with ${want[*]} ($(cat "$VENV/.hpcai-horovod-wheel"))"
  exit 0
fi
[ "$CHECK" = 1 ] && exit 1

command -v mpicxx >/dev/null || {
  echo "error: mpicxx not found on PATH" >&2
  echo "hint: install an MPI with its compiler wrappers (Debian: libopenmpi-dev)" >&2; exit 2; }
versions() {
  "$PY" - <<'PY'
import importlib
parts = []
for mod in ("torch", "tensorflow"):
    try:
        parts.append(f"{mod}{importlib.import_module(mod).__version__}")
    except ImportError:
        pass
print("-".join(parts))
PY
}
mpi_id=$(mpicxx --showme:version 2>/dev/null || mpicxx -show 2>/dev/null | head -c 60 || echo mpi)
key=$(printf '%s|%s|%s|%s|%s' "$HOROVOD_VERSION" "$WITH_TORCH" "$WITH_TF" \
      "$( [ "$WITH_TF" = yes ] || [ "$WITH_TORCH" = yes ] && versions)" "$mpi_id" \
      | sha256sum | cut -c1-16)
WHEELS="$CACHE/wheels/horovod-$key"
if ! ls "$WHEELS"/horovod-*.whl >/dev/null 2>&1; then
  work=$(mktemp -d)
  trap 'rm -rf "$work"' EXIT
  say "downloading the horovod==$HOROVOD_VERSION sdist from PyPI"
  "$PY" -m pip -q --disable-pip-version-check download --no-deps --no-binary :all: \
    -d "$work" "horovod==$HOROVOD_VERSION"
  tar -xzf "$work/horovod-$HOROVOD_VERSION.tar.gz" -C "$work"
  src="$work/horovod-$HOROVOD_VERSION"
  say "patching: C++17, no XLA op file"
  sed -i 's/set(CMAKE_CXX_STANDARD 14)/set(CMAKE_CXX_STANDARD 17)/' \
    "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  sed -i '/xla_mpi_ops\.cc/d' "$src/horovod/tensorflow/CMakeLists.txt"
  grep -q 'CMAKE_CXX_STANDARD 17' "$src/CMakeLists.txt" "$src/horovod/torch/CMakeLists.txt"
  ! grep -q 'xla_mpi_ops' "$src/horovod/tensorflow/CMakeLists.txt"
  flags=(HOROVOD_WITH_MPI=1 HOROVOD_WITHOUT_GLOO=1 HOROVOD_WITHOUT_MXNET=1
         HOROVOD_CPU_OPERATIONS=MPI MAKEFLAGS=-j"$(nproc)")
  [ "$WITH_TORCH" = yes ] && flags+=(HOROVOD_WITH_PYTORCH=1) || flags+=(HOROVOD_WITHOUT_PYTORCH=1)
  [ "$WITH_TF" = yes ] && flags+=(HOROVOD_WITH_TENSORFLOW=1) || flags+=(HOROVOD_WITHOUT_TENSORFLOW=1)
  say "building the wheel (${want[*]}; several minutes) with: ${flags[*]}"
  mkdir -p "$work/wheel"
  env "${flags[@]}" "$PY" -m pip --disable-pip-version-check wheel --no-deps \
    --no-build-isolation -w "$work/wheel" "$src" > "$work/build.log" 2>&1 || {
      tail -40 "$work/build.log" >&2
      echo "error: the Horovod build failed (log above)" >&2
      echo "hint: check that mpicxx, cmake and g++ work, and the framework versions" >&2
      exit 1; }
  mkdir -p "$WHEELS"
  cp "$work"/wheel/horovod-*.whl "$WHEELS/"
fi
say "installing $(ls "$WHEELS"/horovod-*.whl)"
"$PY" -m pip -q --disable-pip-version-check install --no-deps --force-reinstall \
  "$WHEELS"/horovod-*.whl
# horovod's own runtime deps (cloudpickle, cffi, psutil, pyyaml, packaging), from PyPI
"$PY" -m pip -q --disable-pip-version-check install cloudpickle cffi psutil pyyaml packaging
imports_ok || { echo "error: horovod installed but ${want[*]} does not import" >&2; exit 1; }
# the wheel of this venv's Horovod, for the image (HPCAI_IMAGE_HOROVOD_WHEEL, tests)
ls "$WHEELS"/horovod-*.whl | head -1 > "$VENV/.hpcai-horovod-wheel"
say "ready: $(cd / && "$PY" -c 'import horovod; print(horovod.__version__)') with ${want[*]}"
