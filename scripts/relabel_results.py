"""Rewrite benchmark results (JSON -> JSON, CSV, TXT, PNG) with a corrected commit label.

The GPU machine's copy of the tree can carry a stale .git, so the commit comes from
CODETTA_COMMIT; when that was given wrong, this fixes the record without re-running.

Usage: python scripts/relabel_results.py DIR OLD_COMMIT NEW_COMMIT
"""

import glob
import json
import os
import sys

from codetta.bench.harness import Results, Row

ROW_FIELDS = {"case", "variant", "ms", "flops", "baseline_ms", "peak_mem_gb", "extra"}


def main(folder: str, old: str, new: str) -> None:
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        data = json.load(open(path))
        if "rows" not in data or data.get("env", {}).get("commit") != old:
            continue
        res = Results(os.path.basename(path)[: -len(".json")])
        res.env = {**data["env"], "commit": new}
        for r in data["rows"]:
            res.rows.append(Row(**{k: v for k, v in r.items() if k in ROW_FIELDS}))
        res.write(folder)
        print(f"{path}: commit {old} -> {new}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
