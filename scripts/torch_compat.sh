#!/usr/bin/env bash
# The CPU suite under another torch than CI's (default 2.11.0, the GPU machine's), in a venv
# of its own: CI installs torch 2.13, whose dynamo traces what 2.11's refuses (run 187-188:
# `torch.compiler.assume_constant_result` over a module argument, `bool()` of a list), so a
# torch.compile path can pass CI and fail on 2.11. PyPI's torch wheels for Linux bring the
# CUDA libraries (~5 GB in the venv); the tests run on the CPU through the interpreter.
# Usage (repo root): bash scripts/torch_compat.sh [VERSION] [pytest args, default: the suite]
#   e.g. bash scripts/torch_compat.sh 2.11.0 tests/test_hf.py -k compile
set -euo pipefail
cd "$(dirname "$0")/.."
version=${1:-2.11.0}
[ $# -gt 0 ] && shift
venv=${COMPAT_VENV:-/tmp/codetta-torch-$version}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q "torch==$version" "numpy<2.4" "pytest>=8" "pytest-xdist>=3" "transformers>=5.0"
fi
"$venv/bin/pip" install -q --no-deps -e .
"$venv/bin/python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
"$venv/bin/python" -m pytest -q -n auto --maxprocesses 4 -p no:cacheprovider "${@:-tests}"
