#!/usr/bin/env bash
# Every GPU check in one go, for the day a CUDA machine is lent: the CUDA equivalence tests
# (Triton kernel vs the CPU path, engine greedy on CUDA vs CPU), then the throughput and
# long-context benchmarks on the GPU. Each step has a timeout; the exit status is non-zero if
# any step failed or timed out. Needs a CUDA build of torch and triton in $PYTHON's env.
#   GPU_CHECK_TIMEOUT=900 PYTHON=/path/to/python scripts/gpu_check.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
STEP_TIMEOUT=${GPU_CHECK_TIMEOUT:-900}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export KVPOOL_REQUIRE_CUDA=1

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" || true
  nvidia-smi -L || true
  echo "gpu_check: torch sees no CUDA device (install a CUDA build of torch and triton)" >&2
  exit 3
fi
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"

failed=()
step() {
  local name=$1; shift
  echo "=== $name: $*"
  local start=$SECONDS
  timeout --signal=TERM --kill-after=30 "$STEP_TIMEOUT" "$@"
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - start)) s"
  [ "$rc" -eq 0 ] || failed+=("$name (rc=$rc)")
}

step cuda-tests "$PY" -m pytest -q -rs -p no:cacheprovider tests/engine/test_cuda_attention.py
step interpreter-test "$PY" -m pytest -q -rs -p no:cacheprovider tests/engine/test_triton_interpreter.py
step throughput-bf16 "$PY" -m kvpool.cli bench throughput --device cuda --dtype bfloat16
step throughput-fp32 "$PY" -m kvpool.cli bench throughput --device cuda --dtype float32
step long-context "$PY" -m kvpool.cli bench long-context --device cuda --dtype bfloat16

if [ "${#failed[@]}" -ne 0 ]; then
  printf 'gpu_check: FAILED: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "gpu_check: all steps passed"
