#!/usr/bin/env bash
# The GPU checks of issue 40 in one call on a lent GPU machine, from the repository root there:
#
#   HPCAI_GIT_COMMIT=<commit> OUT=<dir> bash bench/gpu_device.sh [--cpu]
#
# 1. the machine: nvidia-smi -L, python3's torch, CUDA, cuDNN, NCCL and torchvision versions;
# 2. bench/gpu_parity.py (train against a plain PyTorch loop: ResNet-50 batch 64 and 256 in
#    tf32 and bf16, channels-last; the 3DGAN batch 64 against 158 samples/s, and its bf16 and
#    channels-first variants): $OUT/gpu-parity-h200.json, within PARITY_BUDGET_S seconds;
# 3. a torch.profiler summary of the 3DGAN step: $OUT/gan-profile-h200.txt and .json;
# 4. a 1-rank run of `train resnet50 --device cuda` under hpcai-launch with NCCL started
#    (world size 1): $OUT/nccl-smoke.log and its epochs.jsonl;
# 5. a summary table, printed last. Everything printed also goes to $OUT/log.txt.
#
# That machine has python3 with a CUDA PyTorch and no MPI or network: the wheels of mpi4py,
# MPICH, pyelftools and python-hostlist travel in .whl/ and are installed under /tmp, with
# hpcai-launch and train wrappers, as bench/gpu_learning.sh does. Each part runs under its
# own timeout, so one that fails or hangs leaves the others their time (at most about 9.5
# minutes in all). --cpu runs the same parts on this machine's CPU with tiny sizes (no
# nvidia-smi, no wheels: the environment's python3, hpcai-launch and hpcai), to test the
# script.
set -uo pipefail
CPU=0
[ "${1:-}" = "--cpu" ] && CPU=1
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
W=$(mktemp -d /tmp/hpcai-gpu-device.XXXXXX)
export PYTHONUNBUFFERED=1
exec > >(tee -a "$OUT/log.txt") 2>&1
t0=$(date +%s)
say() { echo "== $* ($(( $(date +%s) - t0 )) s)"; }

if [ "$CPU" = 0 ]; then
  say "setup: wheels from .whl/"
  mkdir -p "$W/pkg" "$W/bin"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$W/site" \
    "$ROOT"/.whl/mpi4py-*.whl "$ROOT"/.whl/pyelftools-*.whl \
    "$ROOT"/.whl/python_hostlist-*.whl || { echo "setup: wheels failed"; exit 3; }
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --prefix "$W/mpich" \
    "$ROOT"/.whl/mpich-*.whl || { echo "setup: MPICH wheel failed"; exit 3; }
  ln -sfn "$ROOT" "$W/pkg/hpcai"
  printf '#!/bin/sh\nexec python3 -c "import sys; from hpcai.launcher.cli import main; sys.exit(main())" "$@"\n' \
    > "$W/bin/hpcai-launch"
  printf '#!/bin/sh\nexec python3 -m hpcai.training "$@"\n' > "$W/bin/train"
  chmod +x "$W/bin/hpcai-launch" "$W/bin/train"
  export PATH="$W/bin:$W/mpich/bin:$PATH" PYTHONPATH="$W/site:$W/pkg"
  DEV=cuda
  PARITY=(--budget-s "${PARITY_BUDGET_S:-330}" --gan-variants)
  # PARITY_BATCHES: the ResNet batches ('' for the 3DGAN alone); ONLY_PARITY=1: no profile
  # or smoke run (a second call that only adds pairs)
  [ -n "${PARITY_BATCHES+x}" ] && PARITY+=(--batches "$PARITY_BATCHES")
  PROFILE=()
  SMOKE=(resnet50 --device cuda --comm nccl --batch-size 64 --samples 320)
  nvidia-smi -L
  say "plan: hpcai-launch --dry-run on this machine's GPUs"
  timeout 30 hpcai-launch --dry-run -- python3 -c pass
else
  say "setup: --cpu, this environment"
  DEV=cpu
  PARITY=(--budget-s "${PARITY_BUDGET_S:-60}" --model resnet-tiny --image-size 16 --batches 2
          --steps 1 --epochs 2 --warmup 1 --gan-batch 1 --gan-steps 1 --max-pairs 1
          --first-pair-s 5)
  PROFILE=(--gan-batch 1 --warmup 1 --profile-steps 1)
  SMOKE=(resnet-tiny --device cpu --image-size 16 --batch-size 2 --samples 10)
fi
cd "$W" || exit 3   # not the checkout: everything works from any directory
python3 -c 'import torch, mpi4py
print("torch", torch.__version__, "CUDA", torch.version.cuda, "available", torch.cuda.is_available(), "mpi4py", mpi4py.__version__)
if torch.cuda.is_available():
    print("GPU", torch.cuda.get_device_name(), "cuDNN", torch.backends.cudnn.version(), "NCCL", torch.cuda.nccl.version())
try:
    import torchvision; print("torchvision", torchvision.__version__)
except ImportError:
    print("torchvision: not installed (the plain loop uses hpcai models/resnet.py)")'

say "parity: bench/gpu_parity.py"
timeout "${PARITY_TIMEOUT_S:-380}" python3 "$ROOT/bench/gpu_parity.py" --device "$DEV" \
  "${PARITY[@]}" --json "$OUT/${PARITY_JSON:-gpu-parity-h200.json}"
echo "parity rc=$?"

if [ "${ONLY_PARITY:-0}" = 1 ]; then say "done (parity only)"; exit 0; fi
say "profile: the 3DGAN step under torch.profiler"
timeout 80 python3 "$ROOT/bench/gpu_parity.py" --device "$DEV" "${PROFILE[@]}" \
  --profile "$OUT/gan-profile-h200.txt" | tail -40
echo "profile rc=${PIPESTATUS[0]}"

say "smoke: hpcai-launch -N 1 -- train ${SMOKE[*]}"
timeout 80 hpcai-launch -N 1 -- train "${SMOKE[@]}" --epochs 2 --max-steps 5 \
  --eval-samples 0 --out "$W/smoke" < /dev/null > "$OUT/nccl-smoke.log" 2>&1
echo "smoke rc=$?"
cut -c1-240 "$OUT/nccl-smoke.log" | tail -8
cp "$W/smoke/epochs.jsonl" "$OUT/nccl-smoke-epochs.jsonl" 2>/dev/null

say "summary"
python3 - "$OUT" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
try:
    doc = json.loads((out / "gpu-parity-h200.json").read_text())
except (OSError, ValueError) as exc:
    print(f"parity: no result ({exc})")
else:
    print(f"parity on {doc['provenance'].get('gpu')}, torch {doc['provenance']['torch']}, "
          f"{doc['elapsed_s']} s, verdict {doc['verdict']}")
    print(f"{'configuration':36} {'plain/s':>9} {'hpcai/s':>9} {'ratio':>7} {'95% CI':>17} "
          f"{'target':>6} verdict")
    for r in doc["rows"]:
        mean = lambda v: sum(v) / len(v) if v else float("nan")  # noqa: E731
        ci = r["ratio"]["ci95"]
        ci = f"[{ci[0]:.3f},{ci[1]:.3f}]" if ci else "-"
        ratio = r["ratio"]["mean"]
        print(f"{r['key']:36} {mean(r['plain_samples_per_s']):9.1f} "
              f"{mean(r['hpcai_samples_per_s']):9.1f} "
              f"{ratio if ratio is not None else float('nan'):7.3f} {ci:>17} "
              f"{r['target']:>6} {r['verdict']} (n={r['ratio']['n']})")
    for f in doc["failures"]:
        print("failed:", f[:300])
try:
    prof = json.loads((out / "gan-profile-h200.json").read_text())
    top = ", ".join(f"{t['name']} {t[prof['sorted_by']] / prof['total_self_us']:.0%}"
                    for t in prof["top"][:5])
    print(f"3DGAN profile: {prof['ms_per_step']} ms/step = {prof['samples_per_s']} samples/s; "
          f"top self time: {top}")
except (OSError, ValueError, ZeroDivisionError) as exc:
    print(f"3DGAN profile: none ({exc})")
log = (out / "nccl-smoke.log").read_text(errors="replace") if (out / "nccl-smoke.log").exists() else ""
nccl = [line for line in log.splitlines() if "NCCL" in line or "averaged" in line]
epochs = [line for line in log.splitlines() if line.startswith("epoch ")]
print("smoke:", (nccl[0][:160] if nccl else "no NCCL line"), "|",
      (epochs[-1][:120] if epochs else "no epoch line"))
EOF
say "done"
