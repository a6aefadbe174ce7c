#!/usr/bin/env bash
# Idempotent install of everything hpcai needs on Debian 12 (root, PyPI + apt only):
# apt MPI/Slurm/hwloc packages, a venv with pinned torch, Intel MPI (impi-rt) in its own
# prefix, and this package (editable). A second run only checks and returns.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HPCAI_VENV:-$ROOT/.venv}
IMPI_VERSION=2021.19.0
APT_PACKAGES=(openmpi-bin libopenmpi-dev mpich slurm-wlm munge libpmi2-0 hwloc numactl charliecloud-runtime debootstrap squashfs-tools cmake g++ strace)

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
# Intel MPI from PyPI goes into its own prefix: installed into the venv itself, its
# libmpi.so and mpirun would shadow the system MPIs for every program in the venv.
IMPI="$VENV/opt/impi-rt"
if [ ! -x "$IMPI/bin/mpiexec.hydra" ]; then
  say "pip install impi-rt==$IMPI_VERSION into $IMPI"
  "${PIP[@]}" install --no-deps --prefix "$IMPI" "impi-rt==$IMPI_VERSION"
fi
# Is this checkout the one installed? Asked from / so that the checkout's own hpcai/ folder
# cannot answer for the installed package.
if [ ! -x "$VENV/bin/hpcai-launch" ] || ! (cd / && "$VENV/bin/python" - "$ROOT" <<'PY' 2>/dev/null
import os, sys
import hpcai, hpcai.core.cli, hpcai.launcher
here = os.path.dirname(os.path.abspath(hpcai.__file__))   # the repository root is the package
sys.exit(0 if here == sys.argv[1] else 1)
PY
); then
  say "pip install -e $ROOT"
  "${PIP[@]}" install --no-deps --no-build-isolation -e "$ROOT"
fi
say "ready: $VENV"
