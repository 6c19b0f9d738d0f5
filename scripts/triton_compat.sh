#!/usr/bin/env bash
# codetta under another Triton than the pinned 3.6 (default 3.7.1 and 3.8.0: what PyTorch
# 2.12-2.14's CUDA builds pin), on this CPU, each in a venv of its own over this Python's
# packages (torch's CPU build pins no Triton; only the Triton wheel, ~200 MB, is fetched):
#   1. the CPU suite through the interpreter (the sm_90a check's test left to step 2);
#   2. the sm_90a compile check (`sm90_check --ci`: HGMMA, TMA, pipelined wgmma, no spills,
#      shared memory fits) with the shipped tables read as if tuned under this Triton, so
#      their picks are compiled too (codetta itself skips a table of another Triton series).
# Compiling and passing here is what a move of the pin needs first; the speed and the GPU
# tests under that Triton need a GPU (NOTES.md section "Session 57").
# Usage (repo root): bash scripts/triton_compat.sh [VERSION ...]
#   TRITON_COMPAT_TESTS: pytest arguments for step 1 (default: the suite); TRITON_COMPAT_CHECK=0
#   skips step 2 (~3-6 CPU minutes on a cold cache).
set -uo pipefail
cd "$(dirname "$0")/.."
status=0
for version in "${@:-3.7.1 3.8.0}"; do
  for v in $version; do
    venv=/tmp/codetta-triton-$v
    if [ ! -x "$venv/bin/python" ]; then
      python3 -m venv --system-site-packages "$venv"
      "$venv/bin/pip" install -q --no-deps "triton==$v" || { status=1; continue; }
    fi
    "$venv/bin/python" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
    export TRITON_CACHE_DIR=/tmp/codetta-triton-cache-$v  # (apart from the pinned Triton's)
    # shellcheck disable=SC2086
    PYTHONPATH=. "$venv/bin/python" -m pytest -q -n auto --maxprocesses 4 -p no:cacheprovider \
      -k "not test_sm90_sass" ${TRITON_COMPAT_TESTS:-tests} || status=1
    if [ "${TRITON_COMPAT_CHECK:-1}" != 0 ]; then
      series=$(python3 -c "import json, glob; print({'.'.join(json.load(open(f))['identity']['triton'].split('.')[:2]) for f in glob.glob('codetta/kernels/tuned/*.json')}.pop())")
      PYTHONPATH=. "$venv/bin/python" -W ignore -c "
import runpy, sys
import codetta.kernels.tuning as tuning
tuning.triton_series = lambda: '$series'  # the shipped tables' series: their picks compiled too
sys.argv = ['sm90_check', '--ci']
runpy.run_module('codetta.programs.sm90_check', run_name='__main__')
" > "/tmp/codetta-triton-$v-sm90.txt" 2>&1
      rc=$?
      grep -v ", ok$" "/tmp/codetta-triton-$v-sm90.txt" | tail -20
      echo "triton $v: sm_90a check rc $rc ($(grep -c "" "/tmp/codetta-triton-$v-sm90.txt") lines in /tmp/codetta-triton-$v-sm90.txt)"
      [ $rc -eq 0 ] || status=1
    fi
  done
done
exit $status
