#!/usr/bin/env bash
# One device call: GPU tests (optional), then benchmark parts; everything lands in $OUT.
# Usage (repo root, on the GPU machine):
#   CODETTA_COMMIT=<sha> [TESTS="tests/test_pingpong.py ..."] [SKIP_TESTS=1] bash scripts/gpu_run.sh [bench parts...]
# Caches live in /tmp (the tuning cache in /tmp/codetta-cache): a call made while the
# machine is still warm reuses the previous call's tuning and compiled kernels.
set -o pipefail
OUT=${OUT:-/tmp/codetta-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then  # baselines carried as wheels (liger-kernel)
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-} CODETTA_CACHE_DIR=/tmp/codetta-cache CODETTA_TUNE_VERBOSE=1
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "commit (CODETTA_COMMIT): ${CODETTA_COMMIT:-unset; the .git here may be stale}"
  python3 -c "from codetta.bench.harness import source_hash; print('source', source_hash())"
} 2>&1 | tee "$OUT/env.txt"
nvidia-smi dmon -s pc -d 1 > "$OUT/dmon.txt" 2>&1 &
DMON=$!
if [ -z "${SKIP_TESTS:-}" ]; then
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -rf --tb=short -m "not slow" --maxfail=25 -p no:cacheprovider \
    ${TEST_K:+-k "$TEST_K"} ${TESTS:-tests} > "$OUT/tests.txt" 2>&1
  grep -E "passed|failed|FAILED|^E " "$OUT/tests.txt" | tail -40
fi
if [ "$#" -gt 0 ]; then
  timeout "${BENCH_TIMEOUT:-540}" python3 -m codetta bench --out "$OUT/results" --parts "$@" ${BENCH_ARGS:-} 2>&1 \
    | tee "$OUT/bench.txt" | grep -v "^codetta:   " | tail -80
fi
kill $DMON 2>/dev/null
cp /tmp/codetta-cache/tuning.json "$OUT/" 2>/dev/null || true
# at most 8 files come back: the results folder travels as one archive
if [ -d "$OUT/results" ]; then tar czf "$OUT/results.tgz" -C "$OUT" results && rm -r "$OUT/results"; fi
