#!/usr/bin/env bash
# Set up dfl-agent in ./.venv on a Debian/Ubuntu machine with Python >= 3.10.
#
#   scripts/setup.sh          # a training node (torch), the demo (HAR data), amqtt fallback broker
#   scripts/setup.sh --test   # ... plus the test, lint, onnx, metrics and privacy extras
#
# torch: kept if the venv already has one. Otherwise a CPU build, never CUDA packages
# on a machine without an NVIDIA GPU: a local CPU wheel when pip's find-links has one,
# else PyTorch's CPU index. On a machine with an NVIDIA GPU, PyPI's (CUDA) build.
# mosquitto: installed with apt-get when missing and we are root (the demo falls back
# to the pure-Python amqtt broker without it; integration tests need it).
set -euo pipefail
cd "$(dirname "$0")/.."

EXTRAS="train,plot,har,broker,digits"
[[ "${1:-}" == "--test" ]] && EXTRAS="$EXTRAS,test,onnx,metrics,lint,privacy"
PY="${PYTHON:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"

"$PY" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 10) else "dfl-agent needs Python >= 3.10")'

if ! command -v mosquitto >/dev/null 2>&1 && [[ ! -x /usr/sbin/mosquitto ]]; then
  if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing mosquitto"
    (apt-get install -y -qq mosquitto >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq mosquitto >/dev/null; }) \
      || echo "setup: could not install mosquitto; the demo will use amqtt"
  else
    echo "setup: mosquitto not found (sudo apt-get install -y mosquitto); the demo will use amqtt"
  fi
fi

[[ -x .venv/bin/python ]] || "$PY" -m venv .venv
VPY=.venv/bin/python
$VPY -m pip install -q --upgrade pip >/dev/null 2>&1 || true

if ! $VPY -c 'import torch' >/dev/null 2>&1; then
  tmp=$(mktemp -d)
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found: installing torch==$TORCH_VERSION (CUDA build)"
    $VPY -m pip install -q "torch==$TORCH_VERSION"
  elif $VPY -m pip download -q --no-deps --no-index -d "$tmp" "torch==$TORCH_VERSION" >/dev/null 2>&1 \
       && ls "$tmp"/torch-*.whl >/dev/null 2>&1; then
    echo "setup: installing the local CPU wheel $(basename "$tmp"/torch-*.whl)"
    $VPY -m pip install -q "$tmp"/torch-*.whl
  else
    echo "setup: installing torch==$TORCH_VERSION from PyTorch's CPU index"
    $VPY -m pip install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu \
      --extra-index-url https://pypi.org/simple
  fi
  rm -rf "$tmp"
fi

$VPY -m pip install -q numpy
$VPY -m pip install -q -e ".[$EXTRAS]"
$VPY -c 'import torch, dfl_agent; print(f"setup: dfl-agent {dfl_agent.__version__} with torch {torch.__version__} ready in .venv")'
