#!/usr/bin/env bash
# Every GPU check in one go, for a lent CUDA machine, most important first, within one overall
# time budget (GPU_CHECK_BUDGET seconds; a step that would start past it is skipped and counted
# as failed): the CUDA equivalence tests (Triton kernel vs the CPU path; the engine on CUDA vs
# CPU on tiny checkpoints of every architecture; batch invariance on CUDA), then throughput,
# determinism and long-context benchmarks on random-weight models of the bundled model's shape
# and of SmolLM2-1.7B's (scripts/make_big_model.py; no model download, no GGUF needed).
# Needs a CUDA build of torch, triton and transformers in $PYTHON's env.
#   GPU_CHECK_BUDGET=480 PYTHON=python3 TOKENIZER=DIR LOGS=DIR scripts/gpu_check.sh
# TOKENIZER: a directory with tokenizer.json + tokenizer_config.json (make_big_model.py's
# --tokenizer); default: read from the bundled GGUF. LOGS: where each step's output goes.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
BUDGET=${GPU_CHECK_BUDGET:-1800}
LOGS=${LOGS:-/tmp/gpu_check}
SMALL=${SMALL_MODEL:-/tmp/kvpool-135m}
BIG=${BIG_MODEL:-/tmp/kvpool-1.7b}
mkdir -p "$LOGS"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export KVPOOL_REQUIRE_CUDA=1

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" || true
  nvidia-smi -L || true
  echo "gpu_check: torch sees no CUDA device (install a CUDA build of torch and triton)" >&2
  exit 3
fi
"$PY" -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, \
'transformers', transformers.__version__, torch.cuda.get_device_name())"

failed=()
step() {  # step NAME TIMEOUT CMD...: runs unless the budget is spent; output in $LOGS/NAME.log
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS))
  if [ "$left" -lt 20 ]; then
    echo "=== $name: skipped (budget spent)"; failed+=("$name (skipped)"); return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "=== $name (limit ${limit}s): $*"
  local start=$SECONDS
  timeout --signal=TERM --kill-after=10 "$limit" "$@" >"$LOGS/$name.log" 2>&1
  local rc=$?
  tail -n 25 "$LOGS/$name.log"
  echo "=== $name: rc=$rc in $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed+=("$name (rc=$rc)")
}
tok=()
[ -n "${TOKENIZER:-}" ] && tok=(--tokenizer "$TOKENIZER")


step make-small 120 "$PY" scripts/make_big_model.py "$SMALL" --shape 135m "${tok[@]}"
step cuda-tests 240 "$PY" -m pytest -q -rs -p no:cacheprovider tests/engine/test_cuda_attention.py \
  tests/engine/test_cuda_engine.py
step throughput-bf16 120 "$PY" -m kvpool.cli bench throughput --device cuda --dtype bfloat16 --model "$SMALL"
step determinism-bf16 120 "$PY" -m kvpool.cli bench determinism --device cuda --dtype bfloat16 --model "$SMALL"
step long-context-bf16 120 "$PY" -m kvpool.cli bench long-context --device cuda --dtype bfloat16 --model "$SMALL"
step make-big 180 "$PY" scripts/make_big_model.py "$BIG" --shape 1.7b "${tok[@]}"
step throughput-big-bf16 180 "$PY" -m kvpool.cli bench throughput --device cuda --dtype bfloat16 --model "$BIG"
step throughput-fp32 120 "$PY" -m kvpool.cli bench throughput --device cuda --dtype float32 --model "$SMALL"
step determinism-fp32 120 "$PY" -m kvpool.cli bench determinism --device cuda --dtype float32 --model "$SMALL"

if [ "${#failed[@]}" -ne 0 ]; then
  printf 'gpu_check: FAILED: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "gpu_check: all steps passed"
