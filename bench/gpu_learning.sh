#!/usr/bin/env bash
# The learning benchmark on a lent GPU machine (issue 17, item 5: measure the budget that the
# criteria need), run from the repository root there:
#
#   HPCAI_GIT_COMMIT=<commit> bash bench/gpu_learning.sh OUTDIR SECONDS [learning.py args...]
#
# That machine has python3 with a CUDA PyTorch, NumPy, h5py and matplotlib but no MPI and no
# network: the wheels of mpi4py, MPICH, pyelftools and python-hostlist travel in .whl/ (the
# README's --device cuda paragraph says how they were fetched). The script installs them
# under /tmp and makes hpcai-launch and train wrappers. It checks data-parallel equivalence
# on the GPU (bench/gpu_equivalence.py, with its control), then runs bench/learning.py with
# --device cuda, all seeds at once, each stopped after SECONDS minus what the check took
# (--deadline; SECONDS 0: the check alone). Everything it writes goes to OUTDIR.
set -uo pipefail
OUTDIR=$(realpath -m "${1:?OUTDIR}"); SECONDS_LEFT=${2:?SECONDS}; shift 2
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$OUTDIR" /tmp/hpcai-gpu/pkg /tmp/hpcai-gpu/bin
t0=$(date +%s)
W=/tmp/hpcai-gpu
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$W/site" \
  "$ROOT"/.whl/mpi4py-*.whl "$ROOT"/.whl/pyelftools-*.whl \
  "$ROOT"/.whl/python_hostlist-*.whl || exit 3
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --prefix "$W/mpich" \
  "$ROOT"/.whl/mpich-*.whl || exit 3
ln -sfn "$ROOT" "$W/pkg/hpcai"
printf '#!/bin/sh\nexec python3 -c "import sys; from hpcai.launcher.cli import main; sys.exit(main())" "$@"\n' \
  > "$W/bin/hpcai-launch"
printf '#!/bin/sh\nexec python3 -m hpcai.training "$@"\n' > "$W/bin/train"
chmod +x "$W/bin/hpcai-launch" "$W/bin/train"
export PATH="$W/bin:$W/mpich/bin:$PATH" PYTHONPATH="$W/site:$W/pkg" PYTHONUNBUFFERED=1
nvidia-smi -L
python3 -c 'import torch, mpi4py, numpy, h5py, matplotlib; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available(), "mpi4py", mpi4py.__version__, "numpy", numpy.__version__)'
cd "$OUTDIR" || exit 3   # not the checkout: everything works from any directory
python3 "$ROOT/bench/gpu_equivalence.py" --device cuda --json "$OUTDIR/gpu_equivalence.json" \
  || echo "gpu_equivalence failed"
[ "$SECONDS_LEFT" = 0 ] && exit 0   # the equivalence check alone
left=$(( SECONDS_LEFT - ($(date +%s) - t0) ))
echo "learning: $left s left for the seeds"
python3 "$ROOT/bench/learning.py" --deadline "$left" --timeout $((left + 300)) \
  --train-arg=--device --train-arg=cuda --workdir "$W/runs" "$@"
rc=$?
for d in "$W"/runs/seed*; do cp "$d/physics.json" "$OUTDIR/$(basename "$d")-physics.json"; done
exit $rc
