#!/usr/bin/env bash
# Issue 16's GPU runs on one host with 2 GPUs (device kind nvidia-h200-x2), from the repo
# root: `python -m codetta train` under torchrun, FSDP2 (float32 parameters, bf16
# compute, float32 gradient reduction), the same global batch (8 x 2048 tokens) on 1
# and 2 GPUs. Results under $OUT/fsdp/ (one JSON + log per run), then a summary
# (scripts/fsdp_summary.py). Runs, named by what they vary:
#   1gpu / 1gpu-codetta         one GPU each, side by side (loss curves only)
#   2gpu / 2gpu-codetta         FSDP2 over both GPUs, unpatched and patched
#   2gpu-moved                  unpatched, weights moved by ~one bf16 rounding (the noise)
#   2gpu-compile                unpatched, each decoder layer torch.compile'd
#   2gpu-codetta-mN             patched, CODETTA_SM_MARGIN=N (SMs the GEMMs leave to NCCL)
#   2gpu-codetta-mNcC           the same with NCCL_MAX_NCHANNELS=C (NCCL's CTAs fit in the margin)
#   <run>-rK                    <run> again under its own name (interleaved repeats)
#   2gpu-profile / 2gpu-codetta-profile  20 steps, steps 10-12 under torch.profiler (rank 0):
#                               GPU busy time per step next to the step's wall time
#   2gpu-host / 2gpu-codetta-host  20 steps, steps 10-12 under cProfile (rank 0): where the
#                               host's time to issue a step goes
#   tune                        python -m codetta tune for the model at 8192 tokens (one 2-GPU
#                               run's tokens per GPU) into the cache the runs after it use
#   1gpu-half / 1gpu-half-codetta  one GPU each, side by side, half the batch (a 2-GPU
#                               run's tokens per GPU, no communication)
# Env: MODEL (llama3-1b), STEPS (100), RUNS (all of the above), RUN_TIMEOUT (s per run).
set -o pipefail
OUT=${OUT:-/tmp/codetta-out}
mkdir -p "$OUT/fsdp"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-} NCCL_NVLS_ENABLE=0 \
  CODETTA_AUTOTUNE=${CODETTA_AUTOTUNE:-0} CODETTA_CACHE_DIR=${CODETTA_CACHE_DIR:-/tmp/codetta-cache}
{
  nvidia-smi --query-gpu=index,name,driver_version,clocks.sm,temperature.gpu --format=csv
  nvidia-smi topo -m 2>/dev/null | head -4
  python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
  echo "commit (CODETTA_COMMIT): ${CODETTA_COMMIT:-unset}"
} 2>&1 | tee "$OUT/fsdp/env.txt"
COMMON=(--model "${MODEL:-llama3-1b}" --seq-len 2048 --batch 8 --steps "${STEPS:-100}" --time-from 10
        --log-every 25 --parallel fsdp)
run() {  # tag, GPUs ("0", "1" or "0,1"), then train's arguments
  local tag=$1 gpus=$2; shift 2
  local n; n=$(echo "$gpus" | tr ',' '\n' | wc -l)
  echo "=== $tag ($(date +%T), GPUs $gpus)"
  CUDA_VISIBLE_DEVICES=$gpus timeout "${RUN_TIMEOUT:-240}" torchrun --standalone --nproc_per_node="$n" \
    -m codetta train "${COMMON[@]}" --out "$OUT/fsdp/$tag.json" "$@" > "$OUT/fsdp/$tag.log" 2>&1
  echo "$tag rc=$? $(grep '^done' "$OUT/fsdp/$tag.log")"
  grep -E "Error|error:" "$OUT/fsdp/$tag.log" | tail -3
}
RUNS=${RUNS:-"1gpu 2gpu 2gpu-codetta 2gpu-moved 2gpu-compile"}
for r in $RUNS; do
  base=${r%-r[0-9]*}  # a trailing -rN repeats a run under its own name (interleaved repeats)
  case $base in
    1gpu)  # the two one-GPU runs side by side, one GPU each
      run 1gpu 0 --no-codetta & run 1gpu-codetta 1 --codetta; wait ;;
    2gpu) run "$r" 0,1 --no-codetta ;;
    2gpu-codetta) run "$r" 0,1 --codetta ;;
    2gpu-moved) run 2gpu-moved 0,1 --no-codetta --perturb ;;
    2gpu-compile) run "$r" 0,1 --no-codetta --compile ;;
    tune)
      echo "=== tune ($(date +%T))"
      CUDA_VISIBLE_DEVICES=0 timeout "${TUNE_TIMEOUT:-270}" python3 -m codetta tune --model "${MODEL:-llama3-1b}" \
        --tokens 8192 --seconds 0.3 --out "$OUT/fsdp/tuned/" > "$OUT/fsdp/tune.log" 2>&1
      echo "tune rc=$?"; tr '\r' '\n' < "$OUT/fsdp/tune.log" | grep -v "^\s*$" | tail -3 ;;
    2gpu-profile) run 2gpu-profile 0,1 --no-codetta --steps 20 --profile 3 ;;
    2gpu-codetta-profile) run 2gpu-codetta-profile 0,1 --codetta --steps 20 --profile 3 ;;
    2gpu-host) run 2gpu-host 0,1 --no-codetta --steps 20 --host-profile 3 ;;
    2gpu-codetta-host) run 2gpu-codetta-host 0,1 --codetta --steps 20 --host-profile 3 ;;
    2gpu-codetta-m*c*)  # SMs left free and NCCL held to that many channels (CTAs) per collective
      m=${base#2gpu-codetta-m}
      CODETTA_SM_MARGIN=${m%c*} NCCL_MAX_NCHANNELS=${m#*c} run "$r" 0,1 --codetta ;;
    2gpu-codetta-m*) CODETTA_SM_MARGIN=${base#2gpu-codetta-m} run "$r" 0,1 --codetta ;;
    1gpu-half)
      run 1gpu-half 0 --no-codetta --batch 4 & run 1gpu-half-codetta 1 --codetta --batch 4; wait ;;
  esac
done
python3 scripts/fsdp_summary.py "$OUT/fsdp" 2>&1 | tee "$OUT/fsdp/summary.md"
# (the device returns a few files only: one archive)
tar czf "$OUT/fsdp.tgz" -C "$OUT" fsdp && rm -r "$OUT/fsdp"
