#!/usr/bin/env bash
# The learning benchmark on a lent GPU machine (issue 17, item 5: measure the budget that the
# criteria need), run from the repository root there:
#
#   HPCAI_GIT_COMMIT=<commit> bash bench/gpu_learning.sh OUTDIR SECONDS \
#       [--no-equivalence] [--probe] [learning.py args...]
#
# That machine has python3 with a CUDA PyTorch, NumPy, h5py and matplotlib but no MPI and no
# network: the wheels of mpi4py, MPICH, pyelftools and python-hostlist travel in .whl/ (the
# README's --device cuda paragraph says how they were fetched). The script installs them
# under /tmp and makes hpcai-launch and train wrappers. It checks data-parallel equivalence
# on the GPU (bench/gpu_equivalence.py, with its control; --no-equivalence skips it), then
# runs bench/learning.py with --device cuda, the seeds stopped SECONDS after the script
# started (--deadline; SECONDS 0: the check alone). By default all seeds train at once.
# --probe first times 2-rank steps of one seed alone on the GPU (batch 16, --cell-scale 100,
# the second of two 12-step epochs); if three such steps take under 0.5 s, the seeds train
# one after the other, each with a third of the time (three seeds at once took 0.69 s per
# step on an H200). Everything it writes goes to OUTDIR.
set -uo pipefail
OUTDIR=$(realpath -m "${1:?OUTDIR}"); SECONDS_LEFT=${2:?SECONDS}; shift 2
EQUIVALENCE=1; PROBE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --no-equivalence) EQUIVALENCE=0; shift ;;
    --probe) PROBE=1; shift ;;
    *) break ;;
  esac
done
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
if [ "$EQUIVALENCE" = 1 ]; then
  python3 "$ROOT/bench/gpu_equivalence.py" --device cuda --json "$OUTDIR/gpu_equivalence.json" \
    || echo "gpu_equivalence failed"
fi
[ "$SECONDS_LEFT" = 0 ] && exit 0   # the equivalence check alone
JOBS=3
if [ "$PROBE" = 1 ]; then
  hpcai-launch -N 2 -- train 3dgan --generate 2048 --seed 99 --epochs 2 --max-steps 12 \
    --batch-size 16 --cell-scale 100 --validate-events 0 --eval-samples 0 --device cuda \
    --out "$W/probe" > "$OUTDIR/probe.log" 2>&1 || { echo "probe failed"; tail "$OUTDIR/probe.log"; }
  alone=$(python3 -c 'import json, sys; r = [json.loads(l) for l in open(sys.argv[1])][-1]
print(round(r["epoch_time_s"] / r["steps"], 4))' "$W/probe/epochs.jsonl" 2>/dev/null || echo 9)
  sequential=$(python3 -c "print(int(3 * $alone < 0.5))")
  echo "probe: one seed alone, $alone s per 2-rank step; three at once: 0.69 s (H200, earlier)"
  [ "$sequential" = 1 ] && JOBS=1
fi
left=$(( SECONDS_LEFT - ($(date +%s) - t0) ))
deadline=$(( JOBS == 1 ? (left - 45) / 3 : left - 20 ))
echo "learning: $left s left; --jobs $JOBS, each seed stopped after $deadline s"
python3 "$ROOT/bench/learning.py" --jobs "$JOBS" --deadline "$deadline" \
  --timeout $((deadline + 300)) --train-arg=--device --train-arg=cuda --workdir "$W/runs" "$@"
rc=$?
for d in "$W"/runs/seed*; do cp "$d/physics.json" "$OUTDIR/$(basename "$d")-physics.json"; done
exit $rc
