#!/usr/bin/env bash
# The GPU checks that CPU-only sessions left pending (NOTES.md, the first sections' "Next"),
# as two device calls of under ten minutes each. Run from the repo root on the GPU machine:
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 1    # the fp16 ce_logits fix timed, train --amp fp16/bf16
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 2    # Qwen2.5 tuning keys, then test_hf whole
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 3    # H200: the seeded programs re-tuned, then a step A/B
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 4    # H100: its table's most-used pending keys
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 5    # the final norm as factors, the split LSE: tests, keys, ratios
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 6    # H100: where its 1B step's time over the floor goes
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 7    # the split LSE against the tree before it; the factors step A/B
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 8    # the ping-pong store order A/B; the ce programs' GPU tests
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 9    # step 5's GPU tests whole; the grad pass launch; GROUP_M
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 10   # the LM head's keys re-tuned with GROUP_M 8 and 4 (H200 first)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 11   # H100: its 8B-width LM-head re-pick in a model step
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 12   # H200: the loss against its peers (bench ce)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 13   # the loss without its gradient pass in a model step
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 14   # that path's keys tuned, its kernels against the default's
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 15   # that path without its host sync and slow target rows
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 16   # that path at one chunk: its target rows as a table
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 17   # that path's keys tuned on this GPU (the H100's had none)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 18   # the LM head's logits on 128x256 / 256x128 tiles too
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 19   # the probabilities path's per-row dW target term, GPU shapes
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 20   # run 250's two GPU failures taken apart (done: runs 254-255)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 21   # H100: the 1B step's largest GEMM excesses re-tuned, a step A/B (runs 252, 257: same picks)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 22   # the whole test suite on the GPU, in four calls (PART=A1, A2, B1, B2)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 23   # H100: the hybrid ping-pong policy's keys tuned, its 1B step (run 256: level)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 24   # the model-step tables at this commit with every peer (PART=1, 2; one bench each: 1a, 1b, 2a, 2b)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 25   # the 8B slice's GEMM calls all timed (H100), their keys re-tuned; keep-y there (runs 270-271: 1.033x cuBLAS, re-tune level, keep-y 0.3-0.9 %)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 26   # H100 first: the loss's rows in one chunk (the head's dW one GEMM) in the step (run 276: nothing gained)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 27   # H100: the main models' keys still lent at 4096-32768, then 65536 (run 300: none left)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 28   # float16's K1 without h: its GPU tests (run 283; run 294 again)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 29   # host time per call with a new token count each call (runs 295, 297, 306)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 30   # a new token count each step: the SDPA backends (run 298)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 31   # the same with padded rows (a mask): default, efficient, cudnn (run 302)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 32   # H200: issue 11's cold start and host time per call at this commit
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 33   # K1 at a new M each call: whose Triton cache_key is slow (run 308: none)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 34   # the row passes bound per int class: tests, a new-M A/B (run 316: no gain, reverted)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 35   # issue 11: shipped against tuned here, one part a call (PART=qkv, ce, ce-262k, mlp, norm, plain, backward)
#   CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 36   # issue 14: the norm's statistics summed in a GEMM's K loop, against the pass (probe)
# (with the liger wheel carried in .whl, as scripts/gpu_call.sh expects). Results under $OUT.
set -o pipefail
OUT=${OUT:-/tmp/codetta-out}
export OUT

# The LM head's logits keys (ce_logits_scaled: every model's head hands its final norm to
# the loss as factors) tuned at 16384 tokens within $1 s, merged into a copy of the shipped
# table that this checkout then runs, then timed against cuBLAS (one process)
tune_head() {
  CODETTA_TUNE_VERBOSE=1 TUNE_MERGE=1 TUNE_ARGS="--method both" TUNE_TIMEOUT="$1" \
    TUNE_SCOPE="--model llama3-1b llama3-8b qwen3-8b --tokens 16384 --program ce_logits_scaled" \
    bash scripts/gpu_call.sh tune
  cp "$OUT"/tuned/*.json codetta/kernels/tuned/
  RATIO_TIMEOUT=90 bash scripts/gpu_call.sh "ratios:--widths llama3-1b llama3-8b --tokens 16384 --only ce_logits_scaled"
}

# The probabilities path's keys (CODETTA_CE_PROBS=1) of the 1B and 8B widths: limit $1 s,
# programs $2, at token counts $4, merged into a copy of the shipped table that this
# checkout then runs; the tune's log kept as tune-$3.txt
probs_tune() {
  CODETTA_CE_PROBS=1 CODETTA_TUNE_VERBOSE=1 TUNE_MERGE=1 TUNE_ARGS="--method both" TUNE_TIMEOUT="$1" \
    TUNE_SCOPE="--model llama3-1b llama3-8b --tokens $4 --program $2" bash scripts/gpu_call.sh tune
  cp "$OUT"/tuned/*.json codetta/kernels/tuned/
  mv "$OUT/tune.txt" "$OUT/tune-$3.txt"
}

case "${1:-}" in
  1)
    # the wgmma fixes after run 216 timed (fp16 ce_logits, P.rounded: 2x cuBLAS before; the
    # seeded programs' tail split), their tests on the GPU, then train --amp fp16 against bf16
    RATIO_TIMEOUT=120 bash scripts/gpu_call.sh "ratios:--widths llama3-1b --tokens 16384 --dtype fp16 --only ce_logits residual_rms residual_rms_f32 accumulate accumulate_f32" \
      "ratios:--widths llama3-1b --tokens 16384 --dtype bf16 --only ce_logits residual_rms residual_rms_f32 accumulate accumulate_f32" \
      "tests:tests/test_cross_entropy.py tests/test_residual_rmsnorm.py tests/test_gemm.py -k 'float16 or fp16 or tail'"
    export PYTHONPATH=/tmp/site:.
    for dt in fp16 bf16; do
      timeout 70 python3 -m codetta train --model llama3-1b --layers 2 --parallel none --amp --dtype "$dt" \
        --steps 30 --time-from 10 --out "$OUT/amp_${dt}.json" 2>&1 | tail -1
    done
    ;;
  2)
    # tune the Qwen2.5 keys the shipped table lists as pending at 16384 tokens (merged into a copy of
    # the shipped table: $OUT/tuned/; run 213 did qwen2.5-7b), then test_hf whole on the GPU
    TUNE_SCOPE="--model qwen2.5-1.5b qwen2.5-3b qwen2.5-14b --tokens 16384" TUNE_MERGE=1 TUNE_FORCE=0 \
      TUNE_TIMEOUT=300 bash scripts/gpu_call.sh tune
    TEST_WORKERS=4 TEST_TIMEOUT=250 bash scripts/gpu_call.sh "tests:tests/test_hf.py -k 'not loss_curve'"
    ;;
  3)
    # (an H200) the seeded programs' picks predate the tail-split fix (262be82): the H100's
    # tuner dropped the H200's ping-pong picks of residual_rms_f32 and finish_f32 for
    # tail-split ones (runs 217, 219). Re-tune them at 16384 tokens into a copy of the
    # shipped table, then time a 1B step with the new picks (the shipped ones as the cache)
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "step 3 is for an H200" >&2; exit 2; }
    cp codetta/kernels/tuned/nvidia-h200.json .table-before.json
    CODETTA_TUNE_VERBOSE=1 TUNE_MERGE=1 TUNE_ARGS="--method both" TUNE_TIMEOUT=330 \
      TUNE_SCOPE="--model llama3-1b llama3-8b llama3-3b qwen3-8b --tokens 16384 --program residual_rms residual_rms_f32 accumulate_f32 finish_f32" \
      bash scripts/gpu_call.sh tune
    cp "$OUT/tuned/nvidia-h200.json" codetta/kernels/tuned/nvidia-h200.json
    SCRIPT_TIMEOUT=200 bash scripts/gpu_call.sh "script:table_ab.py .table-before.json --cases llama-3.2-1B --batch 4 --rounds 2"
    PYTHONPATH=. python3 scripts/retune_report.py .table-before.json "$OUT/tuned/nvidia-h200.json" "$OUT/tune.txt" | tail -20
    ;;
  4)
    # (an H100) its own table's pending keys, the most-used first: Llama 3 1B / 8B and Qwen3-8B
    # at the other token buckets (the 16384-token keys are tuned: runs 217, 219)
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 || { echo "step 4 is for an H100" >&2; exit 2; }
    # (TUNE_FORCE=0: only the keys its table still lacks; runs 241-242 took 102 of the 119)
    CODETTA_TUNE_VERBOSE=1 TUNE_MERGE=1 TUNE_FORCE=0 TUNE_ARGS="--method both" TUNE_TIMEOUT=520 \
      TUNE_SCOPE="--model llama3-1b llama3-8b qwen3-8b --tokens 4096 8192 32768" bash scripts/gpu_call.sh tune
    ;;
  5)
    # (either GPU) the final norm handed to the loss as h and rstd (row_scale, CE_LOGITS_SCALED,
    # rms_backward_factors; built on the CPU in the twenty-sixth session): its GPU tests, its
    # logits keys tuned at 16384 tokens into a copy of the shipped table (until then
    # ce_logits' picks stand in), the logits GEMM against ce_logits and cuBLAS (the 1B step
    # with it against CODETTA_CE_NORM_FACTORS=0, n formed: step 7)
    # (and the split log-sum-exp of the twenty-seventh session: float32 without slack, the
    # split program output, the row finish on pairs; the finish and gradient pass timed
    # against run 114's 15.5 us and ~540-552 us)
    # (and CE_LOGITS_SCALED's tile stored before its reductions, stores_first: its whole-sub-tile
    # ping-pong config e1 no longer spills, a candidate again: test_pingpong runs each candidate)
    TEST_TIMEOUT=200 bash scripts/gpu_call.sh \
      "tests:tests/test_cross_entropy.py tests/test_residual_rmsnorm.py tests/test_shipped.py tests/test_programs.py tests/test_pingpong.py -k 'row_scale or factors or compile_fullgraph or scaled_logits or matches_float64 or without_slack or split_row_lse or row_finish or ce_logits'" \
      "script:row_sweep.py 16384 finish ce"
    tune_head 150
    CODETTA_CE_NORM_FACTORS=0 RATIO_TIMEOUT=90 bash scripts/gpu_call.sh \
      "ratios:--widths llama3-1b llama3-8b --tokens 16384 --only ce_logits"
    ;;
  7)
    # (either GPU; after 5, whose tuned keys it copies in if $OUT holds them) the split
    # log-sum-exp's cost: the tree before it (b9d56f3, carried as .old: `git archive b9d56f3
    # codetta scripts | tar -x -C .old`; .whl and .old together pass the device's 64 MiB carry
    # limit: move hf_xet, pygments, execnet and pytest_xdist out of .whl for this call)
    # against this one, one process each, the same steps:
    # the loss at issue 15's shapes against cuBLAS's three GEMMs (bench ce, codetta), the
    # row finish and the gradient pass; then the 1B step with the final norm as factors
    # against CODETTA_CE_NORM_FACTORS=0
    [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
    for tree in .old .; do
      name=$([ "$tree" = . ] && echo new || echo old)
      echo "=== tree $name ($(date +%T))"
      (cd "$tree" && PYTHONUNBUFFERED=1 PYTHONPATH=.:/tmp/site CODETTA_CACHE_DIR=/tmp/codetta-cache-$name \
        timeout 130 python3 -m codetta bench --parts ce --variants codetta --out "$OUT/ce-$name" 2>&1 \
        | tee "$OUT/ce-$name.txt" | grep -E "fwd|GPU|codetta " | tail -14)
      (cd "$tree" && PYTHONPATH=.:/tmp/site timeout 45 python3 scripts/row_sweep.py 16384 finish ce 2>&1 \
        | tee "$OUT/sweep-$name.txt" | tail -12)
    done
    BENCH_TIMEOUT=200 BENCH_ARGS="--models llama-3.2-1B --variants codetta codetta:no-norm-factors --rounds 2" \
      bash scripts/gpu_call.sh bench:model
    ;;
  6)
    # (an H100) its 1B step is 1.13x its floor where the H200's is 1.09x (runs 218, 214): the
    # profile of codetta's and Liger's steps (kernels by name, the GPU's idle time, the
    # GEMM calls against cuBLAS), to tell the bandwidth-bound passes' share (the H100 has
    # 3.35 TB/s to the H200's 4.8) from the GEMMs' and the clock's
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 || { echo "step 6 is for an H100" >&2; exit 2; }
    PROF_TIMEOUT=420 bash scripts/gpu_call.sh "profstep:llama-3.2-1B:codetta,liger"
    ;;
  8)
    # (either GPU) the ping-pong epilogue's store order (Program.stores_first, set by
    # CE_LOGITS_SCALED so its e1 does not spill): both orders of ce_logits, ce_logits_scaled
    # and residual_rms at each epilogue split, against cuBLAS, one process; first the ce
    # programs' ping-pong tests (each candidate, e1 included; run 223's test step was cut)
    # (ORDER_SHORT=1: the ce programs' ping-pong tests and the ce A/B alone, for ~5 min)
    if [ -n "${ORDER_SHORT:-}" ]; then
      TEST_TIMEOUT=110 TEST_WORKERS=4 bash scripts/gpu_call.sh "tests:tests/test_pingpong.py -k ce_logits"
      SCRIPT_TIMEOUT=170 bash scripts/gpu_call.sh "script:order_ab.py --only ce_logits ce_logits_scaled --out $OUT/order_ab.json"
      exit
    fi
    # (and the seed barriers initialized only where a seed uses them, dee6979: every
    # ping-pong program, test_pingpong whole)
    # (the limits: 240 + 260 s within a call's 600; step 5's other tests, cut in run 223,
    # are a later call's)
    TEST_TIMEOUT=240 TEST_WORKERS=4 bash scripts/gpu_call.sh "tests:tests/test_pingpong.py"
    SCRIPT_TIMEOUT=260 bash scripts/gpu_call.sh "script:order_ab.py --out $OUT/order_ab.json"
    ;;
  9)
    # (either GPU; run 225 did it on an H100: use TEST_WORKERS=2 there, 4 workers ran the
    # V 262144 cases out of its 80 GB) step 5's GPU tests whole (test_pingpong's ce checks
    # fixed for the split lse in 398372a: e1 with the tile stored first among them); the
    # gradient pass's launch by vocabulary width; the LM head's raster row group (GROUP_M)
    TEST_TIMEOUT=240 TEST_WORKERS=${TEST_WORKERS:-2} bash scripts/gpu_call.sh \
      "tests:tests/test_cross_entropy.py tests/test_residual_rmsnorm.py tests/test_shipped.py tests/test_programs.py tests/test_pingpong.py -k 'row_scale or factors or compile_fullgraph or scaled_logits or matches_float64 or without_slack or split_row_lse or row_finish or ce_logits'"
    SCRIPT_TIMEOUT=80 bash scripts/gpu_call.sh "script:row_sweep.py 16384 cegrid"
    SCRIPT_TIMEOUT=110 bash scripts/gpu_call.sh "script:group_ab.py --out $OUT/group_ab.json"
    ;;
  10)
    # (the H200: run 226 did it on an H100) the LM head's logits keys (ce_logits_scaled)
    # re-tuned at 16384 tokens with their candidates at GROUP_M 8 and 4 (08e10be; the H100's
    # table has e1 at 4 for all three, the H200's are untried), into a copy of the shipped
    # table. First the raster A/B and the gradient pass's launch (paired and sustained)
    # (and P.tanh made accurate, 3d8b819: the soft-capped loss and the long-row gradient
    # pass's test on the GPU; they passed on the H100, run 226). Limits: 70 + 60 + 200 + 170
    # + the ratios' 90 = 590 s of a call's 600 (run 226: the tune took ~70 s on a warm cache)
    SCRIPT_TIMEOUT=70 bash scripts/gpu_call.sh "script:group_ab.py --groups 4 8 --out $OUT/group_ab.json"
    SCRIPT_TIMEOUT=60 bash scripts/gpu_call.sh "script:row_sweep.py 16384 cegrid"
    # (run 226, an H100: the tests were cut at 100 s cold, took 53 s warm; no model's head
    # runs ce_logits, its final norm being handed to the loss as factors: the tuner refuses
    # a program no model runs)
    TEST_TIMEOUT=200 TEST_WORKERS=2 bash scripts/gpu_call.sh \
      "tests:tests/test_cross_entropy.py tests/test_pingpong.py tests/test_programs.py -k 'options or row_scale or vocab_chunk or longer_than or ce_logits or tanh'"
    tune_head 170
    ;;
  11)
    # (an H100) run 226's tuner moved the H100's ce_logits_scaled 8B-width keys from the
    # Triton pick (s4w8e4g8Ft4) to the ping-pong e1 at GROUP_M 4: paired 1.18x cuBLAS against
    # 1.26x, sustained 1.25x against 1.18x, in two calls. The model step judges: an 8B-width
    # step with the LM head against the same step with the table before (git show
    # f2f5bf7:codetta/kernels/tuned/nvidia-h100-80gb-hbm3.json > .table-before-h100.json;
    # .table-*.json is git-ignored: name it in the call's carry, else the device's checkout
    # must hold f2f5bf7 for the git show below). Run 227: 1.007 / 1.005 before / after, kept
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 || { echo "step 11 is for an H100" >&2; exit 2; }
    [ -f .table-before-h100.json ] || git show f2f5bf7:codetta/kernels/tuned/nvidia-h100-80gb-hbm3.json > .table-before-h100.json
    SCRIPT_TIMEOUT=400 bash scripts/gpu_call.sh \
      "script:table_ab.py .table-before-h100.json --cases 8B-4layers+head --batch 4 --step fwd-bwd --rounds 3"
    ;;
  12)
    # (an H200, with the table as committed: merge step 10's keys first, merge_tuned.py) the loss
    # against cuBLAS, torch.compile and Liger at issue 15's shapes: on the H100 (run 230) it
    # was behind the compile at every shape; the H200's last full run is 138 (30557dd),
    # before the split log-sum-exp, the row scale, GROUP_M 4 and the gradient pass's launch
    # (H100: STEP12_ANY_GPU=1 runs it there too: run 230 lacked the ce-chunk-2g variant)
    [ -n "${STEP12_ANY_GPU:-}" ] || nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 \
      || { echo "step 12 is for an H200 (STEP12_ANY_GPU=1: any GPU)" >&2; exit 2; }
    # (and codetta:ce-chunk-2g: 2 GiB row chunks, half the float32 dW sum's passes, one chunk at
    # 8192 tokens; codetta:ce-probs, CODETTA_CE_PROBS=1: no gradient pass, CPU-built, its first
    # GPU run: first run its tests, `pytest tests/test_cross_entropy.py -k probs`; the
    # low-memory and dx-f32 variants left out for the time)
    TEST_TIMEOUT=120 TEST_WORKERS=2 bash scripts/gpu_call.sh "tests:tests/test_cross_entropy.py tests/test_programs.py tests/test_pingpong.py -k 'probs or target_rows'"
    BENCH_TIMEOUT=480 BENCH_ARGS="--variants eager torch.compile liger codetta codetta:row-scale codetta:ce-chunk-2g codetta:ce-probs" \
      bash scripts/gpu_call.sh bench:ce
    ;;
  13)
    # (either GPU; after 12's tests passed) CODETTA_CE_PROBS=1 (the loss's probabilities
    # path, CPU-built in the thirtieth session) in the drop-in's training step: its tests
    # (bf16, every probs test and program), then the 1B step and the 8B-width slice with its
    # head, each against the default, paired and sustained (bench model, variant
    # codetta:ce-probs; the final norm handed on as factors: CE_PROBS_SCALED)
    # (STEP13_NO_TESTS=1: step 15 ran them on this machine)
    [ -n "${STEP13_NO_TESTS:-}" ] || TEST_TIMEOUT=120 TEST_WORKERS=2 bash scripts/gpu_call.sh "tests:tests/test_cross_entropy.py tests/test_programs.py tests/test_pingpong.py -k 'probs or target_rows'"
    BENCH_TIMEOUT=400 BENCH_ARGS="--models llama-3.2-1B 8B-4layers+head --variants codetta codetta:ce-probs --rounds 2" \
      bash scripts/gpu_call.sh bench:model
    ;;
  14)
    # (either GPU, the H200 first) why the probabilities path (CODETTA_CE_PROBS=1) was slower than
    # the stored-logits default at every shape of run 231 (fwd+bwd / cuBLAS 1.173 / 1.137 against
    # 1.065 / 1.084, an H200): its two programs' keys were never tuned (ce_probs took ce_logits'
    # picks; ce_probs_dx the rule, on the backward's 128x128 candidates until the thirty-first
    # session gave it the streaming ones, 128x256 among them). First its GPU tests (the row pass
    # probs_rows is new since run 231), then its keys tuned at 16384 tokens (8192's share them:
    # 4096-row chunks either way) for bench ce's plain loss (CODETTA_CE_NORM_FACTORS=0:
    # ce_probs) and for the drop-in's (ce_probs_scaled) into a copy of the table, then each
    # kernel of both paths (ce_kernels.py), then bench ce: the default against ce-probs.
    # Limits 100 + 100 + 70 + 80 + 190 = 540 s of a call's 600 (each gpu_call start ~5-10 s)
    TEST_TIMEOUT=100 TEST_WORKERS=2 bash scripts/gpu_call.sh "tests:tests/test_cross_entropy.py tests/test_programs.py -k 'probs'"
    CODETTA_CE_NORM_FACTORS=0 probs_tune 100 "ce_probs ce_probs_dx" plain 16384
    probs_tune 70 ce_probs_scaled scaled 16384
    SCRIPT_TIMEOUT=80 bash scripts/gpu_call.sh "script:ce_kernels.py --shapes 16384x2048x128256"
    BENCH_TIMEOUT=190 BENCH_ARGS="--variants codetta codetta:ce-probs" bash scripts/gpu_call.sh bench:ce
    ;;
  15)
    # (either GPU, the H200 first; run 236's probs keys merged) the probabilities path after the
    # thirty-second session's two fixes. Run 236 (H200, tuned): its kernels 1.032x cuBLAS's
    # against the default's 1.087 at 16384 x 2048, but its wall 2.8 ms over its kernels (0.9
    # the default's): the host sync a call (now an event after the last chunk's log-sum-exp,
    # before its gradient GEMMs) and 0.84 ms of target-row sums (a sort a chunk, and ignored
    # rows clamped to class 0: one program summed 241 rows one load after another; now one
    # sort a call, the rows without a target skipped, 8 rows' loads at a time). Its tests (the
    # pinned-memory wait is GPU-only), each kernel of both paths at two shapes, then bench ce
    # against the default and torch.compile. Limits 100 + 90 + 300 = 490 s of a call's 600
    TEST_TIMEOUT=100 TEST_WORKERS=2 bash scripts/gpu_call.sh "tests:tests/test_cross_entropy.py tests/test_programs.py -k 'probs or target_rows'"
    SCRIPT_TIMEOUT=90 bash scripts/gpu_call.sh "script:ce_kernels.py --shapes 16384x2048x128256 8192x4096x128256"
    BENCH_TIMEOUT=300 BENCH_ARGS="--variants torch.compile codetta codetta:ce-probs" bash scripts/gpu_call.sh bench:ce
    ;;
  16)
    # (either GPU) the probabilities path at one chunk (<= 4096 tokens): its dW GEMM adds the
    # target rows' float32 sums from a table (CE_PROBS_DW, tuned like FINISH_F32; the
    # thirty-second session) instead of FINISH_F32 over a zero-filled float32 [V, d]. Its
    # tests (ce_probs_dw's reference-against-kernel test among them), then each kernel of
    # both paths at 4096 tokens, d 2048 and 4096 (the default's one chunk: one plain dW GEMM)
    TEST_TIMEOUT=120 TEST_WORKERS=2 bash scripts/gpu_call.sh "tests:tests/test_cross_entropy.py tests/test_programs.py -k 'probs or target_rows'"
    SCRIPT_TIMEOUT=90 bash scripts/gpu_call.sh "script:ce_kernels.py --shapes 4096x2048x128256 4096x4096x128256"
    ;;
  17)
    # (either GPU; written for the H100, whose table had no key of the probabilities path:
    # run 238 found ce_probs 4.16 ms against cuBLAS's 3.29 at 4096 x 2048 x 128256, untuned)
    # that path's keys at 4096 and 16384 tokens (the 1B and 8B widths; ce_probs_dw only at
    # one chunk) tuned into a copy of the table, then its kernels against the default's at
    # both token counts, then bench ce: the default against ce-probs.
    # Limits 150 + 70 + 90 + 200 = 510 s of a call's 600
    CODETTA_CE_NORM_FACTORS=0 probs_tune 150 "ce_probs ce_probs_dx ce_probs_dw" plain "4096 16384"
    probs_tune 70 ce_probs_scaled scaled "4096 16384"
    SCRIPT_TIMEOUT=90 bash scripts/gpu_call.sh "script:ce_kernels.py --shapes 4096x2048x128256 16384x2048x128256"
    BENCH_TIMEOUT=200 BENCH_ARGS="--variants codetta codetta:ce-probs" bash scripts/gpu_call.sh bench:ce
    ;;
  18)
    # (either GPU, the H100 first) the logits programs (ce_logits and the programs that take
    # its candidates: _scaled, _ext, ce_probs, ce_probs_scaled) got the portable mainloop's
    # 128x256 and 256x128 tiles at quarter sub-tiles (the thirty-third session, no GPU):
    # cuBLAS runs these GEMMs on 256x128 / 320x128 tiles, and the H100's ping-pong 128x128
    # picks were 1.10-1.26x its time (runs 238-239). First ce_logits against ce_probs at the
    # 1B width in isolation (run 239: ce_probs 3.91 ms against ce_logits 3.54 at one config
    # family on the H100, equal on the H200; their sm_90a SASS has the same registers and
    # ~the same instructions), then the four logits keys of each program re-tuned (--force:
    # the new candidates among the old) into a copy of the table, the ratios again, bench ce.
    # First of all the probabilities path's confident-rows test, bf16 at its GPU shapes (its
    # dW target term and a confident row's loss fixed on the CPU in the same session).
    # Limits 60 + 45 + 45 + 110 + 80 + 60 + 150 = 550 s of a call's 600 (the peers: step 15's bench)
    # (and RoPE's sines at positions 2^17-2^22: exact on the GPU if its reductions compile
    # to fused multiply-adds, the thirty-fourth session's reading)
    TEST_TIMEOUT=60 TEST_WORKERS=2 bash scripts/gpu_call.sh \
      "tests:tests/test_cross_entropy.py tests/test_programs.py -k 'confident_rows or probs_path or softcap_confident or sincos'"
    CODETTA_CE_NORM_FACTORS=0 RATIO_TIMEOUT=45 bash scripts/gpu_call.sh "ratios:--widths llama3-1b --tokens 4096 --only ce_logits"
    CODETTA_CE_PROBS=1 CODETTA_CE_NORM_FACTORS=0 RATIO_TIMEOUT=45 \
      bash scripts/gpu_call.sh "ratios:--widths llama3-1b --tokens 4096 --only ce_probs ce_probs_dw"
    CODETTA_TUNE_VERBOSE=1 TUNE_MERGE=1 TUNE_ARGS="--method both" TUNE_TIMEOUT=110 \
      TUNE_SCOPE="--model llama3-1b llama3-8b --tokens 16384 --program ce_logits_scaled" bash scripts/gpu_call.sh tune
    cp "$OUT"/tuned/*.json codetta/kernels/tuned/
    CODETTA_CE_NORM_FACTORS=0 CODETTA_TUNE_VERBOSE=1 TUNE_MERGE=1 TUNE_ARGS="--method both" TUNE_TIMEOUT=80 \
      TUNE_SCOPE="--model llama3-1b llama3-8b --tokens 16384 --program ce_logits" bash scripts/gpu_call.sh tune
    cp "$OUT"/tuned/*.json codetta/kernels/tuned/
    RATIO_TIMEOUT=60 bash scripts/gpu_call.sh "ratios:--widths llama3-1b llama3-8b --tokens 16384 --only ce_logits_scaled"
    BENCH_TIMEOUT=150 BENCH_ARGS="--variants codetta" bash scripts/gpu_call.sh bench:ce
    ;;
  19)
    # (either GPU; short: ~120 s) the probabilities path's dW target term chosen per row (a
    # confident row's - qsum xs, any other's - g x: run 243's dweight failure at 999 x 4096 x
    # 128256, sum) and the confident-rows test's boost by log V, at their GPU shapes; the
    # target-rows kernel's two-input form (the thirty-fourth session, CPU-built)
    TEST_TIMEOUT=200 TEST_WORKERS=2 bash scripts/gpu_call.sh \
      "tests:tests/test_cross_entropy.py -k 'confident_rows or probs_path or target_rows'"
    ;;
  20)
    # (either GPU; ~200 s) run 250's two failures (an H100, 02516a7, 4 xdist workers):
    # test_compiled_backward_follows_keep_y, whose inductor kernel ran through Triton's
    # interpreter in a GPU test process (scripts/autocast_ratios.py, loaded by a test, set
    # TRITON_INTERPRET at import: fixed after the run): alone in one process, then among the
    # same selection as run 250 (the test now asserts the interpreter is off first); and
    # test_matches_unpatched[qwen2-True-padding-float16]'s layer-1 q_proj.bias gradient
    # (2.22x PyTorch's error): the same comparison over 16 seeds with the real kernels
    # (the CPU's interpreter, 40 seeds: that bias's ratio median 1.02, 1 of 40 over 2)
    TEST_TIMEOUT=60 bash scripts/gpu_call.sh "tests:tests/test_swiglu.py -k follows_keep_y"
    TEST_WORKERS=4 TEST_TIMEOUT=200 bash scripts/gpu_call.sh \
      "tests:tests/test_hf.py tests/test_swiglu.py tests/test_tied_embedding.py -k 'not loss_curve'"
    (export PYTHONPATH=.:tests:/tmp/site; timeout 120 python3 scripts/grad_noise.py qwen2 16 64 --dtype fp16 \
      --mask padding 2>&1 | tee "$OUT/grad_noise_qwen2_fp16.txt" | tail -30)
    ;;
  21)
    # (an H100) run 249's profile of the 1B step (1.064x Liger's tokens/s, issue 12 asks
    # 1.10x): its largest GEMM excesses over cuBLAS are dswiglu 1.259x (+3.47 ms a step;
    # 1.10-1.14x on the H200), accumulate_f32 1.113 (+1.06) and residual_rms at K 2048 1.189
    # (+0.61), all on picks of the H100's first tune (runs 217-219). Their four keys
    # re-tuned (--force, --method both: paired and sustained) into a copy of the table,
    # then the 1B step with the new picks against the table before (table_ab).
    # Run 252 (78a5ce8): every pick the same, but dswiglu's final timing had only its two
    # ping-pong configs (the scout dropped the portable ones); since b7369bf the scout keeps
    # each mainloop's best, so a re-run times the best portable one under both timings too.
    # Run 257 (363882b): it did, and lost everywhere (dswiglu 1.459 ms against 1.055): 0 changed
    # Limits 200 + 260 = 460 s of a call's 600
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 || { echo "step 21 is for an H100" >&2; exit 2; }
    cp codetta/kernels/tuned/nvidia-h100-80gb-hbm3.json .table-before-h100.json
    CODETTA_TUNE_VERBOSE=1 TUNE_MERGE=1 TUNE_ARGS="--method both" TUNE_TIMEOUT=200 \
      TUNE_SCOPE="--model llama3-1b --tokens 16384 --program dswiglu residual_rms accumulate_f32" \
      bash scripts/gpu_call.sh tune
    cp "$OUT/tuned/nvidia-h100-80gb-hbm3.json" codetta/kernels/tuned/
    SCRIPT_TIMEOUT=260 bash scripts/gpu_call.sh \
      "script:table_ab.py .table-before-h100.json --cases llama-3.2-1B --batch 4 --rounds 2"
    PYTHONPATH=. python3 scripts/retune_report.py .table-before-h100.json "$OUT/tuned/nvidia-h100-80gb-hbm3.json" \
      "$OUT/tune.txt" | tail -20
    ;;
  22)
    # (either GPU) the whole suite at one commit, which no run has done since the early
    # sessions (each call ran the files its change touched). Runs 251 and 253 (an H100,
    # 78a5ce8) took it in two parts of 540 s and were both cut (part A at ~73 %, part B at
    # ~97 % with one failure then unnamed), so four parts now: A1 test_cross_entropy (2
    # workers: its V 262144 loss cases need the memory), A2 the other kernel files (4), B1 the
    # model files (test_hf, test_swiglu, test_tied_embedding), B2 the rest (4 workers;
    # test_hf's 200-step loss curves left out, ~4 min each: their own step). gpu_call.sh
    # names each failed test even when a part is cut at its limit. Runs 290-292 (6e5cf58, an
    # H100): all four parts whole, no failure (161 s, 127 s, 238 s, 250 s)
    KERNELS="tests/test_cross_entropy.py tests/test_programs.py tests/test_pingpong.py tests/test_gemm.py"
    MODELS="tests/test_hf.py tests/test_swiglu.py tests/test_tied_embedding.py"
    case "${PART:-A1}" in
      A1) TEST_WORKERS=2 TEST_TIMEOUT=540 bash scripts/gpu_call.sh "tests:tests/test_cross_entropy.py" ;;
      A2) TEST_WORKERS=4 TEST_TIMEOUT=540 bash scripts/gpu_call.sh \
           "tests:tests/test_programs.py tests/test_pingpong.py tests/test_gemm.py" ;;
      B1) TEST_WORKERS=4 TEST_TIMEOUT=540 bash scripts/gpu_call.sh "tests:$MODELS -k 'not loss_curve'" ;;
      B2) TEST_WORKERS=4 TEST_TIMEOUT=540 bash scripts/gpu_call.sh \
           "tests:tests $(for f in $KERNELS $MODELS; do printf -- '--ignore=%s ' "$f"; done)" ;;
      *) echo "PART=A1, A2, B1 or B2" >&2; exit 2 ;;
    esac
    ;;
  23)
    # (an H100) the hybrid ping-pong policy (CODETTA_PINGPONG_POLICY=epilogue-bound: the
    # portable mainloop for the light long-K GEMMs, where the ping-pong's overlap does not
    # pay) on the H100, where the 1B step runs at the 700 W cap (run 249: codetta's median SM
    # clock 1455 MHz against Liger's 1590) and is 1.064x Liger's tokens/s (issue 12: 1.10x).
    # On an H200 it was level (run 55, within 0.5 %). Under that policy 7 of the 1B's 21 keys
    # at 16384 tokens are portable-only, and the H100 table lent all 7 from the H200's:
    # tuned here first (store, store_k2, residual_rms: 9 keys, --method both), then the step,
    # codetta against codetta:epilogue-bound and Liger in one process, 2 rounds.
    # PART=2 (the same warm machine after PART=1: its user cache holds the picks) profiles
    # both codetta variants' clocks and GEMM calls. Limits 200 + 330 = 530 s; PART=2 240 s.
    # Run 256 (363882b): level (1.126 / 1.129 against 1.122 / 1.128 x floor; Liger 1.211),
    # its 7 keys shipped; part 2 not run (nothing between the arms to explain)
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 || { echo "step 23 is for an H100" >&2; exit 2; }
    case "${PART:-1}" in
      1)
        CODETTA_PINGPONG_POLICY=epilogue-bound CODETTA_TUNE_VERBOSE=1 TUNE_MERGE=1 TUNE_ARGS="--method both" \
          TUNE_TIMEOUT=200 TUNE_SCOPE="--model llama3-1b --tokens 16384 --program store store_k2 residual_rms" \
          bash scripts/gpu_call.sh tune
        cp "$OUT/tuned/nvidia-h100-80gb-hbm3.json" codetta/kernels/tuned/
        BENCH_TIMEOUT=330 BENCH_ARGS="--models llama-3.2-1B --variants codetta codetta:epilogue-bound liger --rounds 2" \
          bash scripts/gpu_call.sh bench:model ;;
      2) PROF_TIMEOUT=240 bash scripts/gpu_call.sh "profstep:llama-3.2-1B:codetta,codetta:epilogue-bound" ;;
      *) echo "PART=1 or PART=2" >&2; exit 2 ;;
    esac
    ;;
  24)
    # (either GPU, the H200 first) the model-step tables (README, docs/performance.md) at this commit with every
    # peer: the last full ones are runs 130-132 and 195-196 (H200, dec19e1 / 6fc6655), some
    # 60 commits ago; the H100 has none with eager and the regional compile. One process per
    # bench, 2 rounds, paired and sustained. PART=1: Llama-3.2-1B (eager, Liger, the regional
    # compile, codetta) and the two-layer fwd+bwd cases at both widths (issue 12's decoder-
    # layer bar); PART=2: the 8B-width slice with its head, and the 1B step under autocast
    # (float32 parameters, bf16 autocast: Hugging Face Trainer's bf16=True). Limits 260 + 280
    # and 300 + 260 s (runs 195-196 took under 3 min for the 1B step's four variants).
    # Runs 262-266 (an H100, 6963038): on its 80 GB the 1B step's eager and the autocast
    # step's Liger do not fit beside the other variants (each variant's model and AdamW state
    # live through the timing); the bench now leaves such a variant out with the reason.
    # Run 281 (c42da0a) ran PART=1 on an H100 (asked for an H200): as runs 262-263.
    # Codetta behind the regional compile at 8B width there (slice 1.175 / 1.177 x floor
    # against 1.150 / 1.145; NOTES.md): step 25 profiles it. Still to run on an H200
    # PART=1a / 1b / 2a / 2b: each bench of a part alone (shorter calls, for sessions whose
    # machines come late or are taken back mid-call)
    PEERS="liger torch.compile:regional codetta"
    llama_1b_step() { BENCH_TIMEOUT=260 BENCH_ARGS="--models llama-3.2-1B --variants eager $PEERS --rounds 2" \
      bash scripts/gpu_call.sh bench:model; }
    layers() { BENCH_TIMEOUT=280 BENCH_ARGS="--models 1B-layers 8B-layers --step fwd-bwd --variants eager $PEERS --rounds 2" \
      bash scripts/gpu_call.sh bench:model; }
    slice_8b() { BENCH_TIMEOUT=300 BENCH_ARGS="--models 8B-4layers+head --variants $PEERS --rounds 2" \
      bash scripts/gpu_call.sh bench:model; }
    amp_1b_step() { BENCH_TIMEOUT=260 BENCH_ARGS="--amp --models llama-3.2-1B --variants $PEERS --rounds 2" \
      bash scripts/gpu_call.sh bench:model; }
    case "${PART:-1}" in
      1) llama_1b_step; layers ;;
      1a) llama_1b_step ;;
      1b) layers ;;
      2) slice_8b; amp_1b_step ;;
      2a) slice_8b ;;
      2b) amp_1b_step ;;
      *) echo "PART=1, 1a, 1b, 2, 2a or 2b" >&2; exit 2 ;;
    esac
    ;;
  25)
    # (either GPU, the H100 first) where the 8B-width slice loses to the regional compile on
    # the H100 (run 264: codetta's GEMM kernels 209.05 ms a step against cuBLAS's 191.8 in
    # the compiled step, +17.3 ms, where its fusions save 10.6 ms of passes): profile_step's
    # call table now times the norm backward's calls too (q/k/v and gate/up dX and dW, ~60
    # ms of GEMM time run 264 left untimed), each against cuBLAS; then those keys re-tuned
    # with --method both --force (store_k2 / store at 8B width: portable 128x256 s3 picks)
    # and the slice against the table before. Limits 200 + 150 + 200 s.
    # PART=2: the MLP backward's other plan at 8B width on this GPU: y kept from the forward
    # (codetta:keep-y: plain dswiglu, 0.47 GB a layer more held) against y formed again
    # (the default from width 4096 up, chosen on the H200, runs 112 and 116: dswiglu_y, one
    # [tokens, f] write more, 1.180x cuBLAS in run 264), beside the regional compile (three
    # 8B-slice models fit in 80 GB; four may not)
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 || { echo "step 25 is for an H100" >&2; exit 2; }
    case "${PART:-1}" in
      1)
        PROF_TIMEOUT=200 bash scripts/gpu_call.sh "profstep:8B-4layers+head:codetta"
        cp codetta/kernels/tuned/nvidia-h100-80gb-hbm3.json .table-before-h100.json
        CODETTA_TUNE_VERBOSE=1 TUNE_MERGE=1 TUNE_ARGS="--method both" TUNE_TIMEOUT=150 \
          TUNE_SCOPE="--model llama3-8b --tokens 16384 --program store store_k2 store_k3" bash scripts/gpu_call.sh tune
        cp "$OUT"/tuned/*.json codetta/kernels/tuned/
        SCRIPT_TIMEOUT=200 bash scripts/gpu_call.sh \
          "script:table_ab.py .table-before-h100.json --cases 8B-4layers+head --batch 4 --rounds 2" ;;
      2)
        BENCH_TIMEOUT=330 BENCH_ARGS="--models 8B-4layers+head --variants codetta codetta:keep-y torch.compile:regional --rounds 2" \
          bash scripts/gpu_call.sh bench:model ;;
      *) echo "PART=1 or PART=2" >&2; exit 2 ;;
    esac
    ;;
  26)
    # (either GPU, the H100 first) the head's dW as one GEMM over every row, as the compile's:
    # on the H100 at 8B width (NOTES.md, "Runs 270-275": per product against the compile's own
    # GEMMs) the largest single excess of the slice is the loss's four row chunks' float32 dW
    # sum (27.3 ms against the compile's one 23.5 ms GEMM); 2 GiB chunks gained 0.7-0.8 %
    # (run 274). CODETTA_CE_CHUNK_MB=4096 puts 16384 tokens of V 128256 in one chunk (no float32
    # sum; at d 4096 the same peak as 2 GiB chunks, at d 2048 ~2 GiB more). Its one-chunk keys
    # (the logits GEMM at M 16384, the dW as a plain store) tuned first (TUNE_FORCE=0: into the
    # machine's cache, which the bench reads), then the slice and the 1B step with the peers it
    # must beat (the 1B one for its peak against Liger's). Limits 150 + 260 + 170 s.
    CODETTA_CE_CHUNK_MB=4096 TUNE_FORCE=0 TUNE_MERGE=1 TUNE_TIMEOUT=150 \
      TUNE_SCOPE="--model llama3-8b llama3-1b --tokens 16384" bash scripts/gpu_call.sh tune
    BENCH_TIMEOUT=260 BENCH_ARGS="--models 8B-4layers+head --variants codetta codetta:ce-chunk-4g codetta:more-memory torch.compile:regional --rounds 2" \
      bash scripts/gpu_call.sh bench:model
    mkdir -p "$OUT/b1"
    OUT="$OUT/b1" BENCH_TIMEOUT=170 BENCH_ARGS="--models llama-3.2-1B --variants codetta codetta:ce-chunk-4g liger --rounds 2" \
      bash scripts/gpu_call.sh bench:model
    ;;
  27)
    # (an H100) the keys its table still lends from the H200's for the models users train
    # most (`codetta tune --list --gpu "NVIDIA H100 80GB HBM3"` at 198d619: at 4096 and
    # 8192 tokens 10 each, at 32768 14 (3 of them Llama-3-70B's / Qwen3-32B's, run 280 cut
    # there), at 65536 63), TUNE_FORCE=0 (only what the table lacks), the two tunes adding
    # up in one table under $OUT (gpu_call.sh); merge it with scripts/merge_tuned.py.
    # Limits 250 + 300 s. Run 282 (c42da0a) tuned 72 of them; 24 left (Llama-3-70B's and
    # Qwen3-14B's / -32B's widest products at 32768 and 65536): the same call reaches them.
    # Runs 284-285 (cee59b4) tuned 18 more; 6 left (width 8192 at 65536 tokens); run 292
    # (6e5cf58) 4 of them: store tt 32768x8192x65536 and residual_rms_f32 65536x8192x32768 left;
    # run 300 (5e882d7) tuned those two: none left for these models
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H100 || { echo "step 27 is for an H100" >&2; exit 2; }
    MODELS="llama3-1b llama3-3b llama3-8b qwen3-8b qwen3-14b qwen3-32b mistral-7b llama3-70b"
    TUNE_FORCE=0 TUNE_MERGE=1 TUNE_TIMEOUT=250 TUNE_SCOPE="--model $MODELS --tokens 4096 8192 32768" \
      bash scripts/gpu_call.sh tune
    TUNE_FORCE=0 TUNE_MERGE=1 TUNE_TIMEOUT=300 TUNE_SCOPE="--model $MODELS --tokens 65536" \
      bash scripts/gpu_call.sh tune
    ;;
  28)
    # (either GPU) float16's K1 without h (fdcd15e: over a float16 stream K1 runs
    # RESIDUAL_SUMSQ, tuned like RESIDUAL_RMS, and the row pass writes n into a new tensor),
    # built and tested on the CPU only: the float16 tests of the norm, RoPE / q-k-v and
    # drop-in files on the GPU (runs 277-278 passed the same selection before the change).
    # Limit 280 s. Run 283 (c91963e, an H100): 128 passed
    TEST_WORKERS=4 TEST_TIMEOUT=280 bash scripts/gpu_call.sh \
      "tests:tests/test_residual_rmsnorm.py tests/test_rope.py tests/test_hf.py -k 'float16 or fp16 or cast_mode or one_launch or runs_in_the_epilogue'"
    ;;
  29)
    # (either GPU) the host time per call when every call has a token count not seen before
    # (a data loader padding each batch to its longest sequence, no packing): each call
    # misses the bound launcher (launch.py's _BOUND, keyed on shapes) and takes the full
    # path. bench overhead's second table, beside the same-shape rows and cuBLAS's
    BENCH_TIMEOUT=150 bash scripts/gpu_call.sh bench:overhead
    ;;
  30)
    # (either GPU) a new token count each step: which SDPA backend pays ~2.8 ms of host
    # time per call at a new length (run 297: every variant's 1B step host-bound there,
    # codetta 228 ms against 123 at one count; eager 223 / 176), and whether the step
    # keeps its lead on another backend (flash: no per-shape plan, expected); the default
    # beside them on the same machine. The script also splits each variant's step into
    # the host's time to issue it and the GPU's kernel time (torch.profiler, its longest
    # kernels named: which SDPA backend ran), at one count and at new counts. Run 298
    # (5e882d7, an H100): the default ran cuDNN's kernels and paid its per-shape plan; on
    # flash a new count each step cost under 2 % (codetta 130.8 / 133.3 ms, eager 184.2 / 185.4)
    for sdpa in default flash cudnn; do
      VARLEN_SDPA=${sdpa#default} SCRIPT_TIMEOUT=150 bash scripts/gpu_call.sh "script:varlen_step.py llama-3.2-1B 16 4 eager codetta"
      mv "$OUT/varlen_step.py.txt" "$OUT/varlen-$sdpa.txt"
    done
    ;;
  31)
    # (either GPU) step 30 with right-padded rows (VARLEN_PAD=1: a padding mask, as a loader
    # padding each batch to its longest sequence hands it), where SDPA gets a mask that its
    # flash backend cannot take: the default, cuDNN and memory-efficient backends, whose
    # per-new-length cost docs/usage.md's advice (flash, or efficient for masked calls) needs.
    # Run 302 (34fe55e, an H100): efficient pays nothing per length but its kernels are slower
    # (codetta 203.9 ms at new counts); cuDNN fastest at one count (147), host-bound at new
    # ones (220-242); varlen_step.py now prints medians beside the means
    for sdpa in default efficient cudnn; do
      VARLEN_PAD=1 VARLEN_SDPA=${sdpa#default} SCRIPT_TIMEOUT=150 bash scripts/gpu_call.sh "script:varlen_step.py llama-3.2-1B 16 4 eager codetta"
      mv "$OUT/varlen_step.py.txt" "$OUT/varlen-pad-$sdpa.txt"
    done
    ;;
  32)
    # (an H200) issue 11's bars last measured on the H200 at run 94 (cold start of the patched
    # 2-layer 8B-width model + head: 26.8 s extra; 7.9 s with --precompile) and run 32 (gemm
    # K1 23 / 45 us): both again at this commit, the host time per call (bench overhead: same-shape
    # rows beside cuBLAS's, then a new token count each call) first. Limits 150 + 200 + 200 s
    nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 || { echo "step 32 is for an H200" >&2; exit 2; }
    BENCH_TIMEOUT=150 bash scripts/gpu_call.sh bench:overhead coldstart "coldstart:model --precompile"
    ;;
  33)
    # (either GPU) K1's host time at a new token count each call (run 306: 920 us against
    # plain codetta's 234 and cuBLAS's 159; run 307's cProfile: ~255 us of own time in each of
    # Triton's JITCallable.cache_key calls, three a call): which function's key, from where.
    # Limit 100 s
    SCRIPT_TIMEOUT=100 bash scripts/gpu_call.sh "script:cache_key_probe.py"
    ;;
  34)
    # (either GPU) the row passes' direct launch keyed by each plain int's specialization
    # class, so that a new row count binds to the kernel of its class (7ae7993): its tests and
    # an A/B of K1 at a new M each call, by class against by value (run 316: tests passed, K1
    # 359 against 352-387 us a call, no gain past the noise; the change was reverted)
    echo "step 34 ran in run 316 (7ae7993's code, since reverted)" >&2; exit 2
    ;;
  35)
    # (an H200 first) issue 11's "shipped within 2 % of fully tuned": each benchmark part
    # with codetta's A/B variants (the shipped table against keys tuned here, --tuned-ab),
    # one part a call (PART=qkv, ce, ce-262k, mlp, norm, plain or backward; each ~3-6 min). Last on the
    # H200: runs 91-93 (44952ee-9e1afaf): plain 1.006, K1 1.008, residual_norm 1.006, mlp 1.001, qkv
    # 1.021 (1B, host-bound), ce 1.048 (d 4096 forward; its last case cut); every table
    # re-tuned since. On an H100 it checks that card's own table (a diagnostic)
    case "${PART:-qkv}" in
      qkv|mlp) BENCH_TIMEOUT=330 BENCH_ARGS="--variants codetta --tuned-ab" bash scripts/gpu_call.sh "bench:$PART" ;;
      # (runs 317 and 330 on an H100 ran into the limit in ce's fifth case, V 262144: that
      # case is PART=ce-262k alone, the other four here)
      ce) BENCH_TIMEOUT=330 BENCH_ARGS="--variants codetta --tuned-ab --ce-cases 8192x2048x128256 16384x2048x128256 8192x4096x128256 16384x4096x128256" \
        bash scripts/gpu_call.sh bench:ce ;;
      ce-262k) BENCH_TIMEOUT=330 BENCH_ARGS="--variants codetta --tuned-ab --ce-cases 16384x4096x262144" \
        bash scripts/gpu_call.sh bench:ce ;;
      norm) BENCH_TIMEOUT=330 BENCH_ARGS="--variants codetta --tuned-ab" bash scripts/gpu_call.sh bench:k1,residual_norm ;;
      # (plain and backward together ran past 330 s while tuning, run 323: one a call)
      # TUNE_METHODS=both: the tuned variant's candidates scored by the worse of paired and
      # sustained (a pick that holds under both; run 337's plain picks split the methods)
      plain|backward) BENCH_TIMEOUT=500 BENCH_ARGS="--variants codetta --tuned-ab${TUNE_METHODS:+ --tune-methods $TUNE_METHODS}" \
        bash scripts/gpu_call.sh "bench:$PART" ;;
      *) echo "PART=qkv, ce, ce-262k, mlp, norm, plain or backward" >&2; exit 2 ;;
    esac
    ;;
  36)
    # (either GPU) issue 14's forward: can the GEMM form its rows' rstd from the A tiles its K
    # loop streams, instead of the operator's statistics pass (~5 % of the 8B forward)?
    # scripts/rowsq_probe.py: a standalone persistent TMA GEMM in Triton, y = rstd * (x @ W^T),
    # the pass + a loaded-rstd scale against two in-loop sums, at the 8B and 1B q|k|v widths,
    # both timings, x cuBLAS (NOTES.md, section "Session 53"). ~3-4 min (36 compiles)
    SCRIPT_TIMEOUT=420 bash scripts/gpu_call.sh "script:rowsq_probe.py"
    ;;
  *)
    echo "usage: CODETTA_COMMIT=<sha> bash scripts/pending_gpu.sh 1|2|...|36" >&2
    exit 2
    ;;
esac
ls -R "$OUT" | head -40
# (a device call returns at most 8 files: past that, scripts/pack_out.sh packs them)
bash scripts/pack_out.sh "$OUT"
