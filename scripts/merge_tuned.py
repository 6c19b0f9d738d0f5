"""Merge tuned picks from a codetta tuning cache into a shipped-format table (CPU).

The cache: ``bench --tuned-ab``'s ``<out>/ab-tuned/<variant>.json`` (each tuned A/B
variant's picks, brought back with the results) or a user cache (``tuning.json``).
Its entries replace the table's under the same keys, and leave its pending list.

Usage (repo root): python scripts/merge_tuned.py TABLE CACHE [--tail] [--only SUBSTR ...] [--new-only]
                   [--dry-run]
                   python scripts/merge_tuned.py TABLE --from-log LOG [...]

``--from-log``: the picks come from a run's log instead, its "codetta: tuned KEY: CONFIG"
lines (a run cut short before its cache was copied; the log must name the table's GPU
and Triton minor version). A portable pick stands for its "|no-pingpong" twin key too,
as the tuner's own would (``tuning.Chooser.picks``); a ping-pong pick for its key alone.

An entry is merged only where the launcher would use it: its key names a program
codetta has (its body's source hash too) and its configuration is among that program's
candidates under the default settings, so that a pick tuned with
``CODETTA_TAIL_LAUNCH=1`` (the ping-pong tail-split configurations) is reported and
skipped; ``--tail`` checks against the candidates with that setting on instead (a table
for runs with it). The cache must come from the table's GPU and Triton minor version.
Prints each key it changes (old -> new) and what it skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

# why an entry of a program codetta lacks is skipped (a cache's entry, a log's line)
GONE = "not a program codetta knows (an edited body, or gone)"


def merge(
    table: dict, cache: dict, programs: dict, tail: bool = False, only=(), new_only: bool = False
) -> tuple[dict, list, list]:
    """(the merged table, [(key, old, new) changed], [(key, why) skipped]). ``new_only``:
    add the keys the table lacks, leave its own entries as they are (and the "|no-pingpong"
    twin of a key it has: the pair is the table's)."""
    from codetta.kernels.configs import config_from_dict
    from codetta.kernels.settings import override
    from codetta.kernels.tuning import CACHE_FORMAT
    from codetta.tune import entry_usable

    if cache.get("format") != CACHE_FORMAT or table.get("format") != CACHE_FORMAT:
        raise ValueError(
            f"not format {CACHE_FORMAT} (cache {cache.get('format')}, table {table.get('format')})"
        )
    gpu, triton = cache.get("identity", {}).get("gpu"), str(cache.get("identity", {}).get("triton", ""))
    ident = table["identity"]
    if gpu != ident["gpu"] or triton.split(".")[:2] != str(ident["triton"]).split(".")[:2]:
        raise ValueError(f"the cache is from {gpu} with Triton {triton}, the table for {ident['gpu']} "
                         f"with Triton {ident['triton']}")  # fmt: skip
    entries, changed, skipped = dict(table["entries"]), [], []
    with override(tail_launch=tail):
        for key, raw in sorted(cache.get("entries", {}).items()):
            if only and not any(s in key for s in only):
                continue
            if new_only and (key in table["entries"] or key.removesuffix("|no-pingpong") in table["entries"]):
                continue
            cfg = config_from_dict(raw)
            program = programs.get(key.partition("|")[0])
            if program is None:
                skipped.append((key, GONE))
                continue
            if not entry_usable(program, cfg, not key.endswith("|no-pingpong")):
                skipped.append(
                    (key, f"{cfg.short()} is not a candidate" + ("" if tail else " (tail launch off)"))
                )
                continue
            old = entries.get(key)
            new = {**raw}
            if old != new:
                changed.append((key, old, new))
                entries[key] = new
    out = {**table, "entries": dict(sorted(entries.items()))}
    if "pending" in table:
        out["pending"] = sorted(set(table["pending"]) - set(entries))
    return out, changed, skipped


def cache_from_log(text: str, identity: dict, programs: dict) -> dict:
    """A cache (the tuner's format) of the picks a log's "codetta: tuned KEY: CONFIG (..."
    lines name. ``identity``: the table's; the log must name its GPU and Triton minor
    version (the env lines every device call prints), or ValueError. The keys of programs
    codetta no longer has (no configurations to read their lines by) are listed under
    "left_out", which ``main`` reports as skipped."""
    import re

    from codetta.kernels.settings import override
    from codetta.kernels.tuning import CACHE_FORMAT, program_candidates

    triton = ".".join(str(identity["triton"]).split(".")[:2])
    if identity["gpu"] not in text or not re.search(rf"triton {re.escape(triton)}(\.|\b)", text):
        raise ValueError(f"the log does not name {identity['gpu']} and Triton {triton}")
    entries, left_out = {}, []
    for key, short in re.findall(r"^codetta: tuned (\S+): (\S+) \(", text, re.MULTILINE):
        program = programs.get(key.partition("|")[0])
        if program is None:
            left_out.append(key)
            continue
        pp = not key.endswith("|no-pingpong")
        cands = []
        for tail in (False, True):
            with override(tail_launch=tail):
                cands += program_candidates(program, pp)
        cfg = next((c for c in cands if c.short() == short), None)
        if cfg is None:
            raise ValueError(f"{key}: {short} is none of its program's configurations")
        entries[key] = asdict(cfg)
        if pp and not cfg.pingpong:
            entries[key + "|no-pingpong"] = asdict(cfg)
    return {"format": CACHE_FORMAT, "identity": dict(identity), "entries": entries, "left_out": left_out}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("table", type=Path)
    p.add_argument("cache", type=Path, nargs="?")
    p.add_argument("--from-log", type=Path, help="the picks of a run's log (its 'codetta: tuned' lines)")
    p.add_argument(
        "--tail", action="store_true", help="check against the candidates of CODETTA_TAIL_LAUNCH=1"
    )
    p.add_argument("--only", nargs="+", default=(), help="merge only keys containing one of these")
    p.add_argument("--new-only", action="store_true", help="add the keys the table lacks, change none")
    p.add_argument("--dry-run", action="store_true", help="print what would change, write nothing")
    args = p.parse_args(argv)
    from codetta.kernels.configs import config_from_dict
    from codetta.tune import known_programs

    if (args.cache is None) == (args.from_log is None):
        p.error("give a CACHE or --from-log LOG, not both")
    table = json.loads(args.table.read_text())
    try:
        if args.from_log is None:
            cache = json.loads(args.cache.read_text())
        else:
            cache = cache_from_log(args.from_log.read_text(), table["identity"], known_programs())
        out, changed, skipped = merge(
            table, cache, known_programs(), tail=args.tail, only=args.only, new_only=args.new_only
        )
    except ValueError as exc:
        print(f"merge_tuned: {exc}", file=sys.stderr)
        return 2
    for key, old, new in changed:
        was = config_from_dict(old).short() if old else "(none)"
        print(f"  {key}: {was} -> {config_from_dict(new).short()}")
    skipped = [(k, GONE) for k in cache.get("left_out", ())] + skipped  # (a log's lines of such programs)
    for key, why in skipped:
        print(f"  skipped {key}: {why}")
    print(f"{len(changed)} entries changed, {len(skipped)} skipped" + (" (dry run)" if args.dry_run else ""))
    if not args.dry_run:
        args.table.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
