"""What a re-tune changed: each key's earlier pick against its new one, by the tuner's own
scores in the same sweep (CPU; reads a tune log written with CODETTA_TUNE_VERBOSE=1).

With ``--method both`` a candidate's score is the best paired time times its worse ratio
to the best of each timing (``tuning.both_scores``), so old / new is the earlier pick's
loss under the worse of the two timings. An earlier pick absent from the log was dropped
by the scouting round: more than ``tuning.SCOUT_KEEP`` (1.10) slower than the best there.

Usage (repo root): python scripts/retune_report.py BEFORE_TABLE AFTER_TABLE TUNE_LOG
"""

from __future__ import annotations

import json
import re
import sys

from codetta.kernels.configs import config_from_dict


def sweeps(log: str) -> dict:
    """{key: {config short name: score ms}} of every key the log tuned."""
    out, cur = {}, None
    for line in log.replace("\r", "\n").splitlines():
        m = re.search(r"codetta: tuning (\S+) over \d+ configs", line)
        if m:
            cur = out[m.group(1)] = {}
            continue
        m = re.match(r"codetta:\s+(\S+)\s+([\d.]+) ms$", line.strip())
        if m and cur is not None:
            cur[m.group(1)] = float(m.group(2))
    return out


def main(argv=None) -> int:
    before_path, after_path, log_path = argv or sys.argv[1:]
    old = json.load(open(before_path))["entries"]
    new = json.load(open(after_path))["entries"]
    rows = []
    for key, times in sweeps(open(log_path).read()).items():
        for k in (key, key + "|no-pingpong"):
            if k not in new or k not in old:
                continue
            o, n = config_from_dict(old[k]).short(), config_from_dict(new[k]).short()
            if o != n:
                rows.append(
                    (k, o, n, times[o] / times[n] if o in times and n in times else None, times.get(n))
                )
    rows.sort(key=lambda r: -(r[3] or 9))
    for k, o, n, ratio, ms in rows:
        how = "dropped by the scout (> 1.10)" if ratio is None else f"{ratio:.3f}"
        print(f"{k:<62} {o:<24} -> {n:<24} old/new {how}  new {ms} ms")
    timed = sorted(r[3] for r in rows if r[3])
    median = f"{timed[len(timed) // 2]:.3f}" if timed else "-"
    print(f"{len(rows)} keys changed; {len(rows) - len(timed)} earlier picks dropped by the scout; "
          f"median old/new of the rest {median}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
