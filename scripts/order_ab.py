"""The ping-pong epilogue's store order, A/B in one process (GPU machine).

``Program.stores_first`` stores a sub-tile's tile outputs before its reductions (the
default forms the reductions first). CE_LOGITS_SCALED sets it (its whole-sub-tile e1
spilled 80 B otherwise); whether the plain logits program, or K1, gains from it too was
not measured. For the LM head's logits chunk (4096 rows, V 128256) at 1B and 8B width
and K1's o_proj call (16384 x d x d): each program at each of its ping-pong epilogue
splits in both orders (the order that spills at e1 left out), with cuBLAS's GEMM of the
same shape, under paired and sustained-block timing in one run.

Usage (repo root): PYTHONPATH=. python scripts/order_ab.py [--tokens 16384] [--out FILE]
    [--only ce_logits ce_logits_scaled residual_rms]
"""

from __future__ import annotations

import argparse
import dataclasses
import json

import torch

from codetta import programs as pg
from codetta.kernels.engines import PINGPONG
from codetta.kernels.launch import gemm
from codetta.kernels.settings import override
from codetta.kernels.timing import paired_ms, sustained_ms
from codetta.models import widths_of
from codetta.tune import _probe, _probe_loss, _scaled, call_inputs, rows_per_chunk

# (program, epi_split) pairs whose e1 spills in one order (sm_90a check, NOTES.md)
_SPILLS = {("ce_logits_scaled", False, 1), ("residual_rms", False, 1), ("residual_rms", True, 1)}


def cases(tokens: int, only=("ce_logits", "ce_logits_scaled", "residual_rms")):
    for spec in ("llama3-8b", "llama3-1b"):
        w = widths_of(spec)
        chunk = rows_per_chunk(tokens, w.vocab, 2)
        recs = [_scaled(c, chunk, w.vocab) for c in _probe_loss(w, torch.bfloat16)]
        with override(ce_norm_factors=False):  # (the plain logits program: the norm's n formed)
            recs += [_scaled(c, chunk, w.vocab) for c in _probe_loss(w, torch.bfloat16)]
        recs += [_scaled(c, tokens) for c in _probe(w, torch.bfloat16)]
        seen = set()
        for rec in recs:
            name = rec.program.name
            if name not in only or name in seen:
                continue
            seen.add(name)
            yield spec, rec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="+", default=["ce_logits", "ce_logits_scaled", "residual_rms"])
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    rows = []
    for spec, rec in cases(args.tokens, args.only):
        a, w, ops = call_inputs(rec)
        prog = rec.program
        fns = {"cublas": lambda a=a, w=w: a @ w.t()}
        for first in (False, True):
            variant = dataclasses.replace(prog, stores_first=first)
            for cfg in dict.fromkeys(PINGPONG.candidates(pg.CE_LOGITS_SCALED) if prog.name.startswith("ce")
                                     else PINGPONG.candidates(prog)):  # fmt: skip
                if (prog.name, first, cfg.epi_split) in _SPILLS:
                    continue
                key = f"{'stores' if first else 'reduce'}-first e{cfg.epi_split}"
                fns[key] = lambda v=variant, c=cfg, a=a, w=w, o=ops: gemm(a, w, epilogue=v, config=c, **o)
        for fn in fns.values():
            fn()
        torch.cuda.synchronize()
        p = paired_ms(fns, min_s=0.8, warm_s=0.3)
        s = sustained_ms(fns, block_ms=60.0, blocks=3, warm_s=0.2)
        print(f"== {spec} {prog.name} {rec.M}x{rec.N}x{rec.K} (ms, paired / sustained; / cuBLAS)", flush=True)
        for k in fns:
            ratio = f"{p[k] / p['cublas']:.3f} / {s[k] / s['cublas']:.3f}"
            print(f"  {k:<18} {p[k]:7.3f} / {s[k]:7.3f}   {ratio}")
        rows.append(dict(widths=spec, program=prog.name, M=rec.M, N=rec.N, K=rec.K, paired=p, sustained=s))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
