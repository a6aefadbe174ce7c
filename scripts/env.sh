# Sourced by setup.sh and run-tests.sh: the venv first on PATH, MPI pinned to loopback.
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${HPCAI_VENV:-$ROOT/.venv}
export PATH="$VENV/bin:$PATH"
export OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo UCX_NET_DEVICES=lo
export I_MPI_ROOT=${I_MPI_ROOT:-$VENV/opt/impi-rt}
export USER=${USER:-$(id -un)}   # ch-run refuses to start without $USER
