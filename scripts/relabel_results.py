"""Rewrite benchmark results (JSON -> JSON, CSV, TXT, PNG) with a corrected commit label.

The GPU machine's copy of the tree can carry a stale .git, so the commit comes from
CODETTA_COMMIT; when that was given wrong, this fixes the record without re-running.

Usage: python scripts/relabel_results.py DIR OLD_COMMIT NEW_COMMIT
"""

import glob
import json
import os
import sys

from codetta.bench.harness import Results


def main(folder: str, old: str, new: str) -> None:
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        data = json.load(open(path))
        if "rows" not in data or data.get("env", {}).get("commit") != old:
            continue
        # (every field of a row, the sustained times too: this script once kept only the
        # paired ones, and the tables it rewrote lost their sustained columns)
        res = Results.load(path)
        res.env["commit"] = new
        res.write(folder)
        print(f"{path}: commit {old} -> {new}")


if __name__ == "__main__":
    main(*sys.argv[1:4])
