#!/usr/bin/env bash
# The GPU checks that CPU-only sessions left pending (NOTES.md, the first sections' "Next"),
# as two device calls of under ten minutes each. Run from the repo root on the GPU machine:
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 1    # fp16 against bf16, call by call (1B widths)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 2    # Qwen2.5 tuning keys, then test_hf whole
# (with the liger wheel carried in .whl, as scripts/gpu_call.sh expects). Results under $OUT.
set -o pipefail
OUT=${OUT:-/tmp/codetta-out}
export OUT
case "${1:-}" in
  1)
    # fp16 amp's 12 % (run 215: its ping-pong calls 30 % slower than bf16's in the step):
    # every GEMM call of a 1B-width layer in fp16 and in bf16, against cuBLAS in the same dtype
    RATIO_TIMEOUT=285 bash scripts/gpu_call.sh "ratios:--widths llama3-1b --tokens 16384 --dtype fp16" \
      "ratios:--widths llama3-1b --tokens 16384 --dtype bf16"
    ;;
  2)
    # tune the Qwen2.5 keys the shipped table lists as pending at 16384 tokens (merged into a copy of
    # the shipped table: $OUT/tuned/; run 213 did qwen2.5-7b), then test_hf whole on the GPU
    TUNE_SCOPE="--model qwen2.5-1.5b qwen2.5-3b qwen2.5-14b --tokens 16384" TUNE_MERGE=1 TUNE_FORCE=0 \
      TUNE_TIMEOUT=300 bash scripts/gpu_call.sh tune
    TEST_WORKERS=4 TEST_TIMEOUT=250 bash scripts/gpu_call.sh "tests:tests/test_hf.py -k 'not loss_curve'"
    ;;
  *)
    echo "usage: CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 1|2" >&2
    exit 2
    ;;
esac
ls -R "$OUT" | head -40
