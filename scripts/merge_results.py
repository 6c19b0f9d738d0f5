"""Merge benchmark results of one commit (several runs' JSON, one table each) into one
table and plot: every case of every input, in order, as one ``Results``.

The device calls of one session often time a benchmark part in several runs (the cases
that fit one call's time or one GPU's memory together): docs/performance.md's table of them is
this merge. Inputs must share the GPU and the commit (their ratios each come from one run
of their own; a merged table mixes runs, never GPUs or code). A case in two inputs is
refused.

Usage: python scripts/merge_results.py [--baseline LABEL] OUT_DIR RESULTS.json [RESULTS.json ...]
(--baseline: the label of what the ratios divide by, for files written before it was stored
in them, e.g. "floor (cuBLAS GEMMs + SDPA fwd+bwd)" for the model part's)
"""

import sys

from codetta.bench.harness import Results


def merge(paths: list[str], baseline: str | None = None) -> Results:
    parts = [Results.load(p) for p in paths]
    if baseline:
        for res in parts:
            res.baseline = baseline
    first = parts[0]
    for p, res in zip(paths, parts):
        for key in ("gpu", "commit"):
            if res.env.get(key) != first.env.get(key):
                raise ValueError(f"{p}: {key} {res.env.get(key)!r}, not {first.env.get(key)!r} as {paths[0]}")
        if res.baseline != first.baseline:
            raise ValueError(f"{p}: baseline {res.baseline!r}, not {first.baseline!r}")
    out = Results(first.name, first.baseline)
    out.env = dict(first.env)
    seen = set()
    for p, res in zip(paths, parts):
        cases = {r.case for r in res.rows}
        if cases & seen:
            raise ValueError(f"{p}: case {sorted(cases & seen)[0]!r} is in an earlier input too")
        seen |= cases
        out.rows.extend(res.rows)
    return out


def main(*args: str) -> None:
    baseline = None
    if args[:1] == ("--baseline",):
        baseline, args = args[1], args[2:]
    if len(args) < 2:
        raise SystemExit(__doc__)
    out_dir, *paths = args
    res = merge(paths, baseline)
    res.write(out_dir)
    print(res.table())


if __name__ == "__main__":
    main(*sys.argv[1:])
