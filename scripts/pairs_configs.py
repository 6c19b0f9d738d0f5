"""The interleaved-pairs RoPE programs' configurations on this GPU: what a user gets without
a tuned entry (the nearest entry or the shape rule) against the tuned best (GPU machine).

Hugging Face's models rotate halves, so until run 185 the shipped table had no entry for
the q and k projections' programs in the interleaved-pairs convention
(``RoPE(interleaved=True)``: Meta's original Llama code, torchtitan); their calls took
``tuning.rule_config``. "untuned" is what a call takes without tuning here: the shipped
entry, else the nearest one or the rule ("known before" says which). For each
such key of the Llama 3 widths at ``--tokens`` (default 16384; a key several models share is timed at the
first model's shape: 8B before 3B), this tunes the candidates
(``both``: the worse of the paired and sustained ratios to the best), then times the
untuned pick, the tuned best, the rotate-half program of the same shape at its shipped
configuration and cuBLAS's plain GEMM of the same shape, under paired and sustained-block
timing apart (a ratio counts only if it holds under both). The picks are written as a
table in the shipped format (``$OUT/pairs-tuned.json``; ``scripts/merge_tuned.py`` merges
them) and put in the user's tuning cache, so a benchmark later in the same call uses them.

Usage (repo root, GPU): python scripts/pairs_configs.py [MODEL ...] [--tokens N] [--seconds S]
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import replace
from pathlib import Path

import torch

from codetta import tune as T
from codetta.kernels import device, launch, timing, tuning
from codetta.kernels.operands import make_call
from codetta.kernels.settings import override
from codetta.models import KNOWN
from codetta.programs.rope import RMS_ROPE


def pairs_calls(models, tokens: int) -> dict:
    """{key: RecordedCall} of the pairs programs the models' steps run at ``tokens``."""
    calls = {}
    for name in models:
        w = replace(KNOWN[name], rope_interleaved=True)
        for key, call in T.model_calls(w, (tokens,)).items():
            if "_pairs_" in call.program.name:
                calls.setdefault(key, call)
    return calls


def measure_key(key: str, rc, seconds: float, cache) -> tuple[dict, dict]:
    """Tune one key (its picks into ``cache``) and time the untuned pick, the tuned one, the
    rotate-half program and cuBLAS: ({key: Config} picked, the row of results)."""
    a, weight, ops = T.call_inputs(rc)
    call = make_call(rc.program, a, weight, ops)
    pp = tuning.pingpong_allowed(call)
    cands = tuning.candidates(call, pingpong=pp)
    known, source = tuning.CHOOSER.known(call, pp, cands)
    untuned = known or tuning.CHOOSER.untuned(call, pp, cands)
    prepare = launch._prepare_for_tuning(call)
    with override(tune_method="both"):
        measure = lambda fns: tuning._measure(fns, seconds)  # noqa: E731
        times = tuning.tune_times(key, cands, prepare, measure, tuning._scout)
    best = min(times, key=times.get)
    picks = tuning.CHOOSER.picks(call, pp, times)
    for k, cfg in picks.items():
        cache.put(k, cfg)
    sib = RMS_ROPE[rc.program.sub_tile_width]  # the rotate-half program, as Hugging Face's path runs it
    fns = {
        "untuned": prepare(untuned),
        "tuned": prepare(best),
        "rotate-half": lambda: launch.gemm(a, weight, epilogue=sib, **ops),
        "cublas": lambda: torch.matmul(a, weight.t()),
    }
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    paired = timing.paired_ms(fns, min_s=1.0, min_cycles=20, warm_s=0.5)
    sustained = timing.sustained_ms(fns, block_ms=60.0, blocks=3, warm_s=0.1, settle_ms=120.0)
    print(f"== {key}\n   untuned {untuned.short()} (known before: {source or 'none'}), tuned {best.short()}")
    for how, t in (("paired", paired), ("sustained", sustained)):
        ratios = (f"untuned/tuned {t['untuned'] / t['tuned']:.3f}, "
                  f"tuned/cublas {t['tuned'] / t['cublas']:.3f}, "
                  f"rotate-half/cublas {t['rotate-half'] / t['cublas']:.3f}")  # fmt: skip
        print(f"   {how:9s} " + "  ".join(f"{k} {v:.4f}" for k, v in t.items()) + "  | " + ratios, flush=True)
    row = {
        "key": key, "untuned": untuned.short(), "tuned": best.short(), "known_before": source or "none",
        "paired_ms": {k: round(v, 4) for k, v in paired.items()},
        "sustained_ms": {k: round(v, 4) for k, v in sustained.items()},
    }  # fmt: skip
    return picks, row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("models", nargs="*", default=["llama3-8b", "llama3-1b", "llama3-3b"])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--seconds", type=float, default=0.5)
    args = ap.parse_args()
    cache = tuning.CHOOSER.cache(0)
    picks, rows = {}, []
    for key, rc in sorted(pairs_calls(args.models, args.tokens).items()):
        got, row = measure_key(key, rc, args.seconds, cache)
        picks.update(got)
        rows.append(row)
    out = Path(os.environ.get("OUT", "."))
    table = T.table(picks, device.name(0), device.capability(0), device.num_sms(0), picks)
    (out / "pairs-tuned.json").write_text(json.dumps(table, indent=1) + "\n")
    (out / "pairs-configs.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"wrote {len(picks)} picks to {out / 'pairs-tuned.json'}")


if __name__ == "__main__":
    main()
