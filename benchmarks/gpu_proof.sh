#!/usr/bin/env bash
# GPU proof in one prepared run (issue #22): device facts, the kernel tests compiled on CUDA,
# fused MoE (Triton) against the torch path with a block-size sweep, one CUDA engine rank;
# and, asked for by STEPS="facts graphs", the decode step against its floor, eager and with
# decode graphs (benchmarks/gpu_engine.py); by STEPS="facts fp8", the block-FP8 kernels against
# their references and the bf16 ones on Qwen3-30B-A3B's and DeepSeek-V3's layer shapes.
#
#   OUT=/some/dir benchmarks/gpu_proof.sh            # all steps
#   STEPS="moe engine" OUT=... benchmarks/gpu_proof.sh   # a rerun of some steps
#
# Each step is time-boxed and writes its own JSON under $OUT; a failed step is recorded and
# the next one still runs. At the end the parts are merged into $OUT/gpu-<device>.json and
# the tuned config JSON lies in $OUT. Python packages the GPU machine lacks travel as wheels
# in .whl/ (installed into a private target dir, never into the system).
# SMOKE=1 rehearses the whole script on a CPU with toy shapes.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tidal-gpu-proof}
STEPS=${STEPS:-"facts kernels moe engine"}
mkdir -p "$OUT"
if ! python3 -c "import msgspec, zmq, fastapi, uvicorn" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1
then
  site=$(mktemp -d /tmp/tidal-site-XXXXXX)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" .whl/*.whl || exit 1
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
smoke=()
[ "${SMOKE:-0}" = 1 ] && smoke=(--smoke)
step() {  # step NAME TIMEOUT_S ARGS...: one time-boxed step; its output goes to $OUT/steps.log
  local name=$1 limit=$2; shift 2
  case " $STEPS " in *" $name "*) ;; *) return 0 ;; esac
  local cmd=(benchmarks/gpu_proof.py "$name")
  [ "$name" = graphs ] && cmd=(benchmarks/gpu_engine.py)  # decode graphs against the floor
  echo "== $name (time box ${limit}s) $(date +%T)"
  timeout -k 10 "$limit" python3 "${cmd[@]}" --out "$OUT/$name.json" \
    "${smoke[@]}" "$@" >"$OUT/$name.log.tmp" 2>&1
  echo "   rc=$? $(date +%T)"; tail -n 4 "$OUT/$name.log.tmp"
  { echo "===== $name"; cat "$OUT/$name.log.tmp"; } >>"$OUT/steps.log"; rm -f "$OUT/$name.log.tmp"
}
step facts 90
step kernels 200 --timeout 170
step moe 240 --config-dir "$OUT"
# The engine step serves with the table just tuned (as a shipped file would be found).
if [ "${SMOKE:-0}" != 1 ] && [ -f "$OUT/tuned_moe_config.json" ]; then
  name=$(python3 -c "import json;print(json.load(open('$OUT/moe.json'))['config_file'])")
  cp "$OUT/tuned_moe_config.json" "tidal/kernels/configs/$name" && echo "   engine uses $name"
fi
step engine 300
# Not in the default STEPS (the four above fill a 10-minute call): a call of its own,
# STEPS="facts graphs".
step graphs 480
# Not in the default STEPS either: STEPS="facts fp8" (its own call).
step fp8 420
device=$(python3 -c "import json;print(json.load(open('$OUT/facts.json'))['device'])" 2>/dev/null \
  | tr -c 'A-Za-z0-9_.\n-' '_')
python3 benchmarks/gpu_proof.py merge --out "$OUT/gpu-${device:-unknown}.json" \
  "$OUT"/facts.json "$OUT"/kernels.json "$OUT"/moe.json "$OUT"/engine.json "$OUT"/graphs.json \
  "$OUT"/fp8.json
