#!/usr/bin/env bash
# The driver probes on a lent GPU machine, run from the repository root there (the device command
# runs it first): OUTDIR gets probes.json. Needs .gpu/ carried: the charliecloud-runtime .deb
# (apt-get download charliecloud-runtime) and, in .gpu/chlib/, the libraries ch-run loads that
# the GPU machine lacks (copied from `ldd /usr/bin/ch-run` here, glibc's left out: libfuse3,
# libsquashfuse_ll, liblzo2, liblz4, liblzma, libz, libzstd); cudaprobe is built there with gcc.
#   1. python -m hpcai.launcher.gpuprobe in the host's own environment: cuInit in the driver's
#      libcuda (must PASS);
#   2. the same probe made to load a CUDA toolkit's stub libcuda (the control: must FAIL);
#   3. bench/gpu/container_probe.py: the probe in a minimal ch-run image with the driver's
#      compute libraries staged and bound (must PASS) and without them (the control).
set -uo pipefail
OUTDIR=$(realpath -m "${1:?OUTDIR}")
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
W=/tmp/hpcai-probes; mkdir -p "$W/pkg" "$OUTDIR"
ln -sfn "$ROOT" "$W/pkg/hpcai"
export PYTHONPATH="$W/pkg${PYTHONPATH:+:$PYTHONPATH}" USER=${USER:-root}
cd "$OUTDIR"
run() { local name=$1; shift; echo "== $name: $*"; timeout 120 "$@" > "$W/$name.json" 2> "$W/$name.err"
        echo "rc=$?" > "$W/$name.rc"; tail -c 1500 "$W/$name.json"; tail -3 "$W/$name.err"; }
run host python3 -m hpcai.launcher.gpuprobe
stub=$(ls /usr/local/cuda/lib64/stubs/libcuda.so /usr/local/cuda*/targets/*/lib/stubs/libcuda.so \
       2>/dev/null | head -1)
if [ -n "$stub" ]; then run stub python3 -m hpcai.launcher.gpuprobe --libcuda "$stub"
else echo '{"skipped": "no CUDA toolkit stub libcuda on this machine"}' > "$W/stub.json"; echo "rc=none" > "$W/stub.rc"; fi
deb=$(ls "$ROOT"/.gpu/charliecloud-runtime_*.deb 2>/dev/null | head -1)
if [ -n "$deb" ] && gcc -O2 -o "$W/cudaprobe" "$ROOT/bench/gpu/cudaprobe.c"; then
  dpkg -x "$deb" "$W/ch"
  run container python3 "$ROOT/bench/gpu/container_probe.py" --probe "$W/cudaprobe" \
    --ch-run "$W/ch/usr/bin/ch-run" --ch-lib "$ROOT/.gpu/chlib"
else echo '{"skipped": "no charliecloud-runtime .deb in .gpu/ or no gcc"}' > "$W/container.json"; echo "rc=none" > "$W/container.rc"; fi
python3 - "$W" "$OUTDIR/probes.json" <<'PY'
import json, sys, pathlib
w = pathlib.Path(sys.argv[1]); out = {}
for name in ("host", "stub", "container"):
    try:
        body = json.loads((w / f"{name}.json").read_text())
    except ValueError:
        body = {"unparsed": (w / f"{name}.json").read_text()[-2000:],
                "stderr": (w / f"{name}.err").read_text()[-2000:] if (w / f"{name}.err").exists() else ""}
    out[name] = {"rc": (w / f"{name}.rc").read_text().strip(), **body}
pathlib.Path(sys.argv[2]).write_text(json.dumps(out, indent=1))
print("probes:", {k: (v.get("verdict"), v["rc"]) for k, v in out.items()})
PY
