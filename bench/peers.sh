#!/usr/bin/env bash
# Create the vllm-mlx peer venv used by `promptcache bench --systems vllm_mlx`.
#
# It lives in its own venv (.peers/vllm-mlx, ~6.5 GB) because vllm-mlx pins an
# older mlx-lm: it must never be installed into the project's .venv.
# On Linux the CPU build of mlx is used (mlx[cpu]); vllm-mlx targets Apple Silicon.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PEERS="${PEERS_DIR:-$ROOT/.peers}"
VENV="$PEERS/vllm-mlx"
PYTHON="${PYTHON:-python3}"
VLLM_MLX_SPEC="${VLLM_MLX_SPEC:-vllm-mlx}"

mkdir -p "$PEERS"
if [ ! -x "$VENV/bin/python" ]; then
    echo "peers: creating $VENV"
    "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --upgrade pip
echo "peers: installing $VLLM_MLX_SPEC into $VENV (large download)"
"$VENV/bin/pip" install "$VLLM_MLX_SPEC"
if [ "$(uname -s)" = "Linux" ]; then
    # the mlx wheel on Linux needs its CPU backend package
    "$VENV/bin/pip" install -q "mlx[cpu]" || echo "peers: warning: mlx[cpu] install failed" >&2
fi
echo "peers: installed:"
"$VENV/bin/pip" list 2>/dev/null | grep -iE '^(vllm-mlx|mlx|mlx-lm|mlx-cpu) ' || true
if [ -x "$VENV/bin/vllm-mlx" ]; then
    echo "peers: ok: $VENV/bin/vllm-mlx"
else
    echo "peers: error: $VENV/bin/vllm-mlx was not installed" >&2
    exit 1
fi
