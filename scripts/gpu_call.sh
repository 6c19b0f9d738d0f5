#!/usr/bin/env bash
# A device call made of named steps, each with its own time limit; output under $OUT.
# Usage (repo root, on the GPU machine): CODETTA_COMMIT=<sha> bash scripts/gpu_call.sh STEP...
#   tests:<pytest args>   e.g. "tests:tests/test_gemm.py -k 'parts or plain'" (quotes honoured; limit
#                         TEST_TIMEOUT, default 240 s; TEST_WORKERS=N: pytest-xdist's N processes, from .whl)
#   profile               host time per call and its cProfile breakdown (scripts/profile_launch.py)
#   tune                  python -m codetta tune $TUNE_SCOPE ... into $OUT/tuned/ (limit TUNE_TIMEOUT; TUNE_MERGE;
#                         TUNE_FORCE=0 tunes only keys this GPU's shipped table and the cache lack)
#   bench:<parts>         python -m codetta bench --parts <parts> (comma-separated; limit BENCH_TIMEOUT)
#   ratios:<args>         per-call time vs cuBLAS of a layer's GEMMs (scripts/call_ratios.py; limit RATIO_TIMEOUT)
#   script:<file args>    python3 scripts/<file> <args> (limit SCRIPT_TIMEOUT, default 200 s)
#   coldstart[:ARGS]      first forward+backward of a patched 8B-width model (scripts/coldstart.py ARGS), empty caches
#   profstep:<case>:<v,..> where a model step's GPU time goes (scripts/profile_step.py; limit PROF_TIMEOUT)
set -o pipefail
OUT=${OUT:-/tmp/codetta-out}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  # (once per machine: a second call in the same command would only print warnings)
  [ -d /tmp/site ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1 PYTHONPATH=.:${PYTHONPATH:-} CODETTA_CACHE_DIR=${CODETTA_CACHE_DIR:-/tmp/codetta-cache}
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu,power.limit --format=csv
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  echo "commit (CODETTA_COMMIT): ${CODETTA_COMMIT:-unset}"
  # the device's checkout holds the landed commit's .git under the working tree that was sent:
  # git names that commit (plus -dirty), not the code that runs; the source hash below does
  [ -n "${CODETTA_COMMIT:-}" ] || echo "WARNING: CODETTA_COMMIT unset: results will name the landed commit, not this tree"
  # (run 189 passed a placeholder and run 192 a guess: the results then name no commit)
  [ -z "${CODETTA_COMMIT:-}" ] || [[ "$CODETTA_COMMIT" =~ ^[0-9a-f]{7,40}$ ]] \
    || echo "WARNING: CODETTA_COMMIT=$CODETTA_COMMIT is not a commit hash; the source hash below names the code"
  python3 -c "from codetta.bench.harness import source_hash; print('source', source_hash())"
} 2>&1 | tee "$OUT/env.txt"
for step in "$@"; do
  echo "=== $step ($(date +%T))"
  case "$step" in
    tests:*)
      # shell words, quotes honoured: "tests:tests/test_hf.py -k 'llama or qwen3'"
      eval "targs=(${step#tests:})"
      [ -n "${TEST_WORKERS:-}" ] && targs+=(-n "$TEST_WORKERS")
      # -v names every test as it ends and SIGINT at the limit lets pytest print its summary
      # (runs 251 and 253: a plain SIGTERM cut both parts of pending_gpu.sh 22 with no names,
      # one failure among 500 tests unnamed)
      tlog="$OUT/tests-$(echo "${step#tests:}" | tr -c 'a-z0-9' '_' | cut -c1-40).txt"
      timeout -s INT -k 30 "${TEST_TIMEOUT:-240}" python3 -m pytest -v -rf --tb=short -p no:cacheprovider "${targs[@]}" \
        > "$tlog" 2>&1
      # the failed tests by name (from -v's lines too, so a cut run still names them), then the count
      grep -E "^(FAILED|ERROR) | (FAILED|ERROR) tests/" "$tlog" | sed 's/^\[gw[0-9]*\] \[ *[0-9]*%\] //' | sort -u | tail -30
      tail -n 5 "$tlog" | grep -E "passed|failed|error|Interrupt|^E " ;;
    profile)
      timeout 120 python3 scripts/profile_launch.py 2>&1 | tee "$OUT/profile.txt" | head -60 ;;
    tune)
      # TUNE_SCOPE (default --all-known): e.g. "--model llama3-1b --tokens 16384"; TUNE_MERGE=1 starts
      # from the shipped table (the result is it with these keys re-tuned), or from $OUT's table
      # where an earlier tune of this call wrote one: chained tunes add up (run 272's second tune
      # started again from the shipped table and its file lost the first's keys)
      mkdir -p "$OUT/tuned"
      if [ -n "${TUNE_MERGE:-}" ]; then
        for f in codetta/kernels/tuned/*.json; do
          [ -e "$OUT/tuned/$(basename "$f")" ] || cp "$f" "$OUT/tuned/"
        done
        TUNE_ARGS="${TUNE_ARGS:-} --merge"
      fi
      # (--time-limit: the tune stops itself before a key it could not finish, writes its table
      # and names the keys not reached; 30 s under the hard limit for its start and last write)
      # (a TUNE_TIMEOUT that is not whole seconds, such as 5m, goes to timeout alone)
      limit=${TUNE_TIMEOUT:-300}
      soft=""
      if [[ $limit =~ ^[1-9][0-9]*$ ]]; then
        soft="--time-limit $((limit - 30 > limit / 2 ? limit - 30 : limit / 2))"
      fi
      # shellcheck disable=SC2086
      timeout "$limit" python3 -m codetta tune ${TUNE_SCOPE:---all-known} $([ "${TUNE_FORCE:-1}" = 0 ] || echo --force) \
        --seconds "${TUNE_SECONDS:-0.3}" $soft --out "$OUT/tuned/" ${TUNE_ARGS:-} > "$OUT/tune.txt" 2>&1
      # (tune.txt: this tune's log, read by retune_report.py; tune-all.txt: every tune's of the call)
      cat "$OUT/tune.txt" >> "$OUT/tune-all.txt"
      grep -v "^codetta: " "$OUT/tune.txt" | tr '\r' '\n' | grep -v "^\s*$" | grep -v "not reached: " | tail -5
      grep "not reached: " "$OUT/tune.txt" || true; ls -la "$OUT/tuned/" ;;
    bench:*)
      parts=${step#bench:}
      # (the GPU and versions head bench.txt: its "codetta: tuned" lines, which the printed
      # tail may cut, then serve `scripts/merge_tuned.py TABLE --from-log bench.txt`; run 339)
      [ -s "$OUT/bench.txt" ] || cp "$OUT/env.txt" "$OUT/bench.txt"
      # shellcheck disable=SC2086
      timeout "${BENCH_TIMEOUT:-400}" python3 -m codetta bench --out "$OUT/results" --parts ${parts//,/ } \
        ${BENCH_ARGS:-} 2>&1 | tee -a "$OUT/bench.txt" | grep -v "^codetta:   " | tail -60 ;;
    profstep:*)
      spec=${step#profstep:}
      # shellcheck disable=SC2086
      timeout "${PROF_TIMEOUT:-240}" python3 scripts/profile_step.py ${spec%%:*} $(echo "${spec#*:}" | tr ',' ' ') 2>&1 \
        | tee -a "$OUT/profile_step.txt" | grep "^==" ;;
    ratios:*)
      # shellcheck disable=SC2086
      timeout "${RATIO_TIMEOUT:-300}" python3 scripts/call_ratios.py --out "$OUT" ${step#ratios:} 2>&1 \
        | grep -v "^codetta: " | tee -a "$OUT/ratios.txt" ;;
    script:*)
      spec=${step#script:}
      # (the file keeps every line; the console drops codetta's "codetta: ..." log lines)
      # shellcheck disable=SC2086
      timeout "${SCRIPT_TIMEOUT:-200}" python3 scripts/$spec 2>&1 \
        | tee -a "$OUT/$(echo "${spec%% *}" | tr -c 'a-z0-9_.\n' '_')".txt | grep -v "^codetta: " ;;
    coldstart*)
      # coldstart[:ARGS]: scripts/coldstart.py ARGS (e.g. "coldstart:model --precompile") with empty caches
      rm -rf /tmp/coldstart-cache /tmp/coldstart-triton
      cargs=${step#coldstart}; cargs=${cargs#:}
      # shellcheck disable=SC2086
      CODETTA_CACHE_DIR=/tmp/coldstart-cache TRITON_CACHE_DIR=/tmp/coldstart-triton timeout 200 \
        python3 scripts/coldstart.py $cargs 2>&1 | tee -a "$OUT/coldstart.txt" | grep -v "^codetta: " | tail -12 ;;
  esac
done
cp "$CODETTA_CACHE_DIR/tuning.json" "$OUT/" 2>/dev/null || true
# one archive per call of this script: a second call in the same device command (other
# BENCH_ARGS, say) adds results-2.tgz instead of replacing the first's tables
if [ -d "$OUT/results" ]; then
  tgz="$OUT/results.tgz" n=1
  while [ -e "$tgz" ]; do n=$((n + 1)); tgz="$OUT/results-$n.tgz"; done
  tar czf "$tgz" -C "$OUT" results && rm -r "$OUT/results"
fi
