#!/usr/bin/env bash
# Make .venv-sglang/: SGLang's real model classes, importable on this CPU-only
# machine, for tests that compare weightwire's resharding with SGLang's loaders.
# Idempotent: silent when the stamp matches this script; SGLANG_ENV_FORCE=1 redoes it.
#
#   scripts/sglang-env.sh            # make or check the venv
#   make test-sglang                 # tests/sglang in it
#
# Only torch==2.13.0 is a local CPU wheel; every other torch pulls GBs of CUDA
# wheels, so every install below runs under a constraints file pinning it.
# sglang goes in with --no-deps: its declared deps are CUDA kernels and server
# pieces; below is the set that importing and building the models needs (found
# by trial, see scripts/SGLANG_NOTES.md). sgl_kernel and torchvision are not
# installed: tests/sglang/sglang_cpu.py puts stand-in modules in their place.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-sglang"
PY="${PYTHON:-python3}"
STAMP="$VENV/.sglang-env-stamp"
SGLANG_VERSION="0.5.23"

# Versions pinned as sglang 0.5.23's metadata asks, where it pins them.
DEPS=(
  "transformers==5.19.0" "tokenizers==0.23.2" "compressed-tensors==0.18.0"
  "triton" "apache-tvm-ffi==0.1.11" "openai==2.8.0" "sentencepiece==0.2.1"
  "gguf" "einops" "partial_json_parser" "orjson" "psutil" "pybase64" "requests"
  "pillow" "starlette" "IPython" "aiohttp" "dill"
  # weightwire's own runtime deps and the test tools
  "msgspec" "pyzmq" "structlog" "uvloop" "cryptography" "xxhash" "pytest" "numpy"
)

want="$(cat "${BASH_SOURCE[0]}" "$ROOT/pyproject.toml" | sha256sum | cut -c1-16)"  # entry points live in pyproject
if [[ "${SGLANG_ENV_FORCE:-0}" != 1 && -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi

t0=$(date +%s)
log() { echo "[sglang-env] $*" >&2; }

if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  log "need Python 3.11 as $PY (got $("$PY" --version 2>&1))"; exit 1
fi

rm -f "$STAMP"
[[ -x "$VENV/bin/python" ]] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
CONSTRAINTS="$VENV/constraints.txt"
echo "torch==2.13.0" >"$CONSTRAINTS"

pipq() {
  # pip's resolver prints sglang's unmet (CUDA) requirements as "ERROR: ... conflicts"
  # and exits 0; keep its output out of the way unless the install really fails.
  local out
  if ! out="$("$VPY" -m pip install --disable-pip-version-check -q "$@" 2>&1)"; then
    echo "$out" >&2; return 1
  fi
}

log "pip + torch==2.13.0"
pipq --upgrade pip
pipq -c "$CONSTRAINTS" "torch==2.13.0"
log "sglang==$SGLANG_VERSION (--no-deps)"
pipq -c "$CONSTRAINTS" --no-deps "sglang==$SGLANG_VERSION"
log "${#DEPS[@]} pure-Python dependencies"
pipq -c "$CONSTRAINTS" "${DEPS[@]}"
log "weightwire (editable, --no-deps)"
pipq --no-deps -e "$ROOT"

# torch must still be the CPU wheel, and the models must import and build.
"$VPY" -W ignore - "$ROOT" <<'EOF'
import sys
sys.path.insert(0, sys.argv[1])
import torch
assert torch.__version__.startswith("2.13.0"), torch.__version__
import tests.sglang.sglang_cpu  # noqa: F401  stand-ins, CPU engine
import sglang.srt.models.qwen3, sglang.srt.models.qwen3_moe  # noqa: F401
EOF

echo "$want" >"$STAMP"
size="$(du -sh "$VENV" | cut -f1)"
sg="$("$VPY" -c 'import importlib.metadata as m; print(m.version("sglang"))')"
tr="$("$VPY" -c 'import importlib.metadata as m; print(m.version("transformers"))')"
echo "sglang-env: $VENV ready: python $("$VPY" -c 'import platform; print(platform.python_version())'), torch $("$VPY" -c 'import torch; print(torch.__version__)'), sglang $sg, transformers $tr; $size; $(( $(date +%s) - t0 ))s"
