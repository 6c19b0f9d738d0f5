#!/usr/bin/env bash
# A device call returns at most 8 files from $OUT (runs 232 and 233 lost their tuned tables
# to that limit). Past 8, every file but log.txt (the caller's tee still writes it) goes
# into one archive, all.tgz; a second pack in the same call into all-2.tgz, and so on.
# Usage, last in a device command: bash scripts/pack_out.sh "$OUT" (pending_gpu.sh does).
OUT=${1:-${OUT:-/tmp/codetta-out}}
if [ "$(find "$OUT" -type f | wc -l)" -gt 8 ]; then
  pack=all.tgz n=1
  while [ -e "$OUT/$pack" ]; do n=$((n + 1)); pack=all-$n.tgz; done
  (cd "$OUT" && find . -type f ! -name log.txt ! -name 'all*.tgz' | tar czf "$pack" -T - \
    && find . -type f ! -name log.txt ! -name 'all*.tgz' -delete && find . -mindepth 1 -type d -empty -delete)
  echo "packed into $OUT/$pack: $(tar tzf "$OUT/$pack" | tr '\n' ' ')"
fi
