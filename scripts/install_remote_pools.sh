#!/usr/bin/env bash
# Install what the remote KV pool tests need on a fresh Debian machine (run as root).
# Idempotent: apt runs only for missing packages, pip only for a missing version.
# Usage: scripts/install_remote_pools.sh [VENV_DIR]   (default: .venv)
set -euo pipefail

VENV="${1:-.venv}"
APT_PKGS=(redis-server libibverbs1 libnl-3-200 libnl-route-3-200 prometheus)
MOONCAKE_PKG="mooncake-transfer-engine-non-cuda==0.3.13.post1"

missing=()
for pkg in "${APT_PKGS[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$pkg")
  fi
done
if ((${#missing[@]})); then
  echo "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update
  apt-get install -y --no-install-recommends "${missing[@]}"
else
  echo "Debian packages already installed: ${APT_PKGS[*]}"
fi

if [[ ! -x "$VENV/bin/python" ]]; then
  echo "no virtualenv at $VENV (expected $VENV/bin/python)" >&2
  exit 1
fi
if "$VENV/bin/python" - <<'PY'
import importlib.metadata as md, sys
try:
    ok = md.version("mooncake-transfer-engine-non-cuda") == "0.3.13.post1" and bool(md.version("hiredis"))
except md.PackageNotFoundError:
    ok = False
sys.exit(0 if ok else 1)
PY
then
  echo "Python packages already installed in $VENV"
else
  "$VENV/bin/python" -m pip install "$MOONCAKE_PKG" hiredis
fi

# The native library must load (it needs the Debian libraries above).
"$VENV/bin/python" -c "from mooncake.store import MooncakeDistributedStore" \
  && echo "mooncake.store imports"
command -v redis-server >/dev/null && echo "redis-server: $(redis-server --version | cut -d' ' -f3)"
