"""The ping-pong epilogue's store order, A/B in one process (GPU machine).

``Program.stores_first`` stores a sub-tile's tile outputs before its reductions (the
default forms the reductions first). CE_LOGITS_SCALED sets it (its whole-sub-tile e1
spilled 80 B otherwise); run 224 (an H100) found that the plain logits program and K1 do
not gain from it, and that it costs the scaled program's streaming splits 5-7 %. For the
LM head's logits chunk (4096 rows, V 128256) at 1B and 8B width and K1's o_proj call
(16384 x d x d): each program at each of its ping-pong epilogue splits in both orders (the
order that spills at e1 left out), with cuBLAS's GEMM of the same shape, under paired and
sustained-block timing in one run.

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
from codetta.tune import _probe, _probe_dims, _probe_loss, _scaled, call_inputs, rows_per_chunk

# (program, stores first, epi_split) that spill (sm_90a check, NOTES.md; residual_rms's
# candidates leave its e1 out in both orders)
_SPILLS = {("ce_logits_scaled", False, 1)}


def _tensors(out) -> list:
    return [out] if isinstance(out, torch.Tensor) else [t for t in out if isinstance(t, torch.Tensor)]


def time_against_cublas(fns: dict, width: int) -> tuple[dict, dict]:
    """Paired and sustained-block ms of each variant (``fns["cublas"]`` among them), each
    printed with its ratios to cuBLAS's."""
    p = paired_ms(fns, min_s=0.8, warm_s=0.3)
    s = sustained_ms(fns, block_ms=60.0, blocks=3, warm_s=0.2)
    for k in fns:
        ratio = f"{p[k] / p['cublas']:.3f} / {s[k] / s['cublas']:.3f}"
        print(f"  {k:<{width}} {p[k]:7.3f} / {s[k]:7.3f}   {ratio}")
    return p, s


def save_rows(path: str | None, rows: list) -> int:
    """The rows as JSON at ``path`` (none: nothing written); the scripts' exit status."""
    if path:
        with open(path, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


def ab_parser(doc: str, only: list) -> argparse.ArgumentParser:
    """The A/B scripts' common arguments: --tokens, --out (JSON rows), --only (programs)."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="+", default=only)
    return ap


def calls(tokens: int, only):
    """Each case's (model widths, probe record, A, W, operands), after the GPU's name."""
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    for spec, rec in cases(tokens, only):
        yield spec, rec, *call_inputs(rec)


def outputs(fns: dict) -> dict:
    """Each variant's output tensors, run once (the bit checks' material)."""
    outs = {k: _tensors(fn()) for k, fn in fns.items()}
    torch.cuda.synchronize()
    return outs


def cases(tokens: int, only=("ce_logits", "ce_logits_scaled", "residual_rms")):
    for spec in ("llama3-8b", "llama3-1b"):
        w = widths_of(spec)
        chunk = rows_per_chunk(tokens, w.vocab, 2)
        recs = [_scaled(c, _probe_dims(w), chunk, w.vocab) for c in _probe_loss(w, torch.bfloat16)]
        with override(ce_norm_factors=False):  # (the plain logits program: the norm's n formed)
            recs += [_scaled(c, _probe_dims(w), chunk, w.vocab) for c in _probe_loss(w, torch.bfloat16)]
        recs += [_scaled(c, _probe_dims(w), tokens) for c in _probe(w, torch.bfloat16)]
        seen = set()
        for rec in recs:
            name = rec.program.name
            if name not in only or name in seen:
                continue
            seen.add(name)
            yield spec, rec


def main() -> int:
    args = ab_parser(__doc__, ["ce_logits", "ce_logits_scaled", "residual_rms"]).parse_args()
    rows = []
    for spec, rec, a, w, ops in calls(args.tokens, args.only):
        prog = rec.program
        print(f"== {spec} {prog.name} {rec.M}x{rec.N}x{rec.K} (ms, paired / sustained; / cuBLAS)", flush=True)
        fns = {"cublas": lambda a=a, w=w: a @ w.t()}
        cands = PINGPONG.candidates(pg.CE_LOGITS_SCALED if prog.name.startswith("ce") else prog)
        cfgs = dict.fromkeys(c for c in cands if c.group_m == 8)  # (the raster: scripts/group_ab.py)
        for first in (False, True):
            variant = dataclasses.replace(prog, stores_first=first)
            for cfg in cfgs:
                if (prog.name, first, cfg.epi_split) in _SPILLS:
                    continue
                key = f"{'stores' if first else 'reduce'}-first {cfg.short()}"
                fns[key] = lambda v=variant, c=cfg, a=a, w=w, o=ops: gemm(a, w, epilogue=v, config=c, **o)
        outs = outputs(fns)
        # the order moves no arithmetic: both orders of a config give the same bits, and a
        # stores-first config the same bits as the reductions-first one of the same
        # tiles where that one exists (the first GPU check of the stores-first kernels)
        same = {}
        for cfg in cfgs:
            pair = [outs.get(f"{o}-first {cfg.short()}") for o in ("reduce", "stores")]
            if None not in pair:
                same[cfg.short()] = all(torch.equal(x, y) for x, y in zip(*pair))
        bad = [c for c, ok in same.items() if not ok]
        print(f"   {prog.name}: both orders the same bits at {len(same) - len(bad)} of {len(same)} configs"
              + (f"; DIFFER at {bad}" if bad else ""), flush=True)  # fmt: skip
        # every variant against the first (reductions first): the tile outputs the same bits
        # (the same K loop), the finished reductions within float32 rounding (their partials
        # come from other sub-tile widths); this covers CE_LOGITS_SCALED's e1, stored first only
        ref_key = next(k for k in outs if k != "cublas")
        ref = outs[ref_key]
        for k, got in outs.items():
            if k in ("cublas", ref_key):
                continue
            tiles = [torch.equal(x, y) for x, y in zip(got, ref) if x.dim() == 2 and x.shape[0] == a.shape[0]]
            close = [torch.allclose(x.float(), y.float(), rtol=1e-5, atol=1e-5) for x, y in zip(got, ref)]
            if not (all(tiles) and all(close)):
                print(f"   MISMATCH {k} against {ref_key}: tiles equal {tiles}, close {close}", flush=True)
        print(f"   every variant checked against {ref_key}", flush=True)
        p, s = time_against_cublas(fns, 36)
        rows.append(dict(widths=spec, program=prog.name, M=rec.M, N=rec.N, K=rec.K, paired=p, sustained=s,
                         same_bits=same))  # fmt: skip
    return save_rows(args.out, rows)


if __name__ == "__main__":
    raise SystemExit(main())
