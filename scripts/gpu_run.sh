#!/usr/bin/env bash
# One device call: GPU tests in bf16, then the benchmark; everything lands in $OUT.
# Usage (repo root, on the GPU machine): bash scripts/gpu_run.sh [bench parts...]
set -o pipefail
OUT=${OUT:-/tmp/codetta-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # baselines carried as wheels (liger-kernel)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-} CODETTA_CACHE_DIR=/tmp/codetta-cache CODETTA_TUNE_VERBOSE=1
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "commit (CODETTA_COMMIT): ${CODETTA_COMMIT:-unset; the .git here may be stale}"
  python3 -c "from codetta.bench.harness import source_hash; print('source', source_hash())"
} 2>&1 | tee "$OUT/env.txt"
nvidia-smi dmon -s pc -d 1 > "$OUT/dmon.txt" 2>&1 &
DMON=$!
if [ -n "${PROFILE:-}" ]; then
  python3 scripts/profile_launch.py 2>&1 | head -70 | tee "$OUT/profile.txt"
fi
if [ -z "${SKIP_TESTS:-}" ]; then
  # the tail split first, on its own: a hang there must not eat the whole call
  timeout 120 python3 -m pytest -q tests/test_gemm.py -k "tail" 2>&1 | tail -5 | tee "$OUT/smoke.txt"
  timeout 300 python3 -m pytest -q -m "not slow" tests 2>&1 | tail -30 | tee "$OUT/tests.txt"
fi
timeout "${BENCH_TIMEOUT:-540}" python3 -m codetta bench --out results/gpu "${@:+--parts}" "$@" 2>&1 | tee "$OUT/bench.txt"
if [ -n "${BREAKDOWN:-}" ]; then
  timeout 120 python3 scripts/breakdown.py 2>&1 | tee "$OUT/breakdown.txt"
fi
kill $DMON 2>/dev/null
tar czf "$OUT/results.tgz" results/gpu
cp /tmp/codetta-cache/tuning.json "$OUT/" 2>/dev/null || true
