#!/usr/bin/env bash
# The GPU checks that CPU-only sessions left pending (NOTES.md, the first sections' "Next"),
# as two device calls of under ten minutes each. Run from the repo root on the GPU machine:
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 1    # tests of the new code paths, then train --amp
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 2    # Qwen2.5 tuning keys and the Qwen2.5 layers' bench
# (with the liger wheel carried in .whl, as scripts/gpu_call.sh expects). Results under $OUT.
set -o pipefail
OUT=${OUT:-/tmp/codetta-out}
export OUT
case "${1:-}" in
  1)
    # the drop-in whole (Qwen2 cases, the stricter amp per-step test, the layout and hook
    # refusals), the bias programs on both mainloops, the operators' edges, the n != 2 RoPE
    # backward; ~330 s with four workers
    TEST_WORKERS=4 TEST_TIMEOUT=330 bash scripts/gpu_call.sh \
      "tests:tests/test_hf.py tests/test_api_edges.py tests/test_rope.py tests/test_programs.py tests/test_pingpong.py -k 'not loss_curve and (qwen2 or phi3 or bias or rotated_outputs or amp or layout or edge or refus or hook or matches or plan)'"
    # codetta train --amp, bf16 and fp16, against the unpatched model (2 layers of the 1B config)
    export PYTHONPATH=/tmp/site:.
    for dt in bf16 fp16; do
      for c in codetta no-codetta; do
        timeout 100 python3 -m codetta train --model llama3-1b --layers 2 --parallel none --amp --dtype "$dt" \
          --steps 50 --time-from 10 "--$c" --out "$OUT/amp_${dt}_${c}.json" 2>&1 | tail -2
      done
    done
    ;;
  2)
    # tune the Qwen2.5 keys the shipped table lists as pending at 16384 tokens (merged into a copy of
    # the shipped table: $OUT/tuned/), then two Qwen2.5-7B-width layers against every peer
    TUNE_SCOPE="--model qwen2.5-7b qwen2.5-1.5b --tokens 16384" TUNE_MERGE=1 TUNE_FORCE=0 TUNE_TIMEOUT=300 \
      bash scripts/gpu_call.sh tune
    BENCH_TIMEOUT=260 BENCH_ARGS="--models qwen2.5-7B-layers --step fwd-bwd --variants eager liger torch.compile:regional codetta" \
      bash scripts/gpu_call.sh bench:model
    ;;
  *)
    echo "usage: CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 1|2" >&2
    exit 2
    ;;
esac
ls -R "$OUT" | head -40
