"""Where a layer's GEMM time over cuBLAS goes, call by call (GPU machine).

For every GEMM call of one decoder layer as the Hugging Face drop-in makes it (forward
and backward, plus the LM head + loss chunk), at the given token count: the time of
codetta's call with its program (the configuration the step would pick: shipped table,
user cache, nearest entry or rule), of codetta's plain GEMM of the same shape and
layout (no program: mainloop alone), and of cuBLAS's GEMM (through torch; a paired
weight as one concatenated [2N, K] weight), under paired and sustained-block timing.
``--tune`` adds the best configuration found by tuning the call now.

Usage (repo root): PYTHONPATH=. python scripts/call_ratios.py [--widths llama3-1b llama3-8b]
    [--tokens 16384] [--dtype bf16|fp16] [--tune] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from codetta.kernels import launch
from codetta.kernels.launch import gemm
from codetta.kernels.operands import make_call
from codetta.kernels.program import Kind
from codetta.kernels.timing import paired_ms, sustained_ms
from codetta.kernels.tuning import CHOOSER, candidates, pingpong_allowed
from codetta.models import widths_of
from codetta.tune import _probe, _probe_dims, _probe_loss, _scaled, call_inputs, rows_per_chunk


def _source(call) -> str:
    pp = pingpong_allowed(call)
    cfg, where = CHOOSER.known(call, pp, candidates(call, pingpong=pp))
    return where or "rule/nearest"


def plain_operands(prog, a, w, ops) -> tuple:
    """The operands of the same products as one plain GEMM: the weights (paired, N parts)
    or A operands (M parts) concatenated, or (K parts) both along K."""
    pair = next((op.name for op in prog.inputs if op.kind is Kind.PAIRED_WEIGHT), None)
    slot = {op.name: op.kind for op in prog.inputs}
    of = lambda kind: [v for k, v in ops.items() if slot.get(k) is kind]  # noqa: E731
    ac, wc = a, w
    if pair or of(Kind.N_PART):
        wc = torch.cat([w, *([ops[pair]] if pair else of(Kind.N_PART))])
    if of(Kind.M_PART):
        ac = torch.cat([a, *of(Kind.M_PART)])
    if of(Kind.K_PART_A):
        ac, wc = torch.cat([a, *of(Kind.K_PART_A)], 1), torch.cat([w, *of(Kind.K_PART_B)], 1)
    return ac, wc


def measure(rec, tune: bool) -> dict:
    a, w, ops = call_inputs(rec)
    prog = rec.program
    call = make_call(prog, a, w, ops)
    cfg = CHOOSER.choose(call, launch._prepare_for_tuning(call))
    ac, wc = plain_operands(prog, a, w, ops)
    fns = {
        "codetta": lambda: gemm(a, w, epilogue=prog, **ops),
        "plain": lambda: gemm(ac, wc),
        "cublas": lambda: ac @ wc.t(),
    }
    row = dict(program=prog.name, layout=("t" if rec.a_t else "n") + ("t" if rec.b_t else "n"),
               M=rec.M, N=rec.N, K=rec.K, config=cfg.short(), source=_source(call))  # fmt: skip
    if tune:
        best, _ = launch.tune(a, w, epilogue=prog, force=True, seconds=0.3, **ops)
        row["tuned"] = best.short()
        fns["tuned"] = lambda: gemm(a, w, epilogue=prog, config=best, **ops)
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    row["paired"] = paired_ms(fns, min_s=0.6, warm_s=0.3)
    row["sustained"] = sustained_ms(fns, block_ms=60.0, blocks=3, warm_s=0.2)
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", nargs="+", default=["llama3-1b", "llama3-8b"])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--only", nargs="+", default=None, help="program names to time (default: every call)")
    args = ap.parse_args()
    rows = []
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    for spec in args.widths:
        w = widths_of(spec)
        chunk = rows_per_chunk(args.tokens, w.vocab, 2)
        calls = [_scaled(c, _probe_dims(w), args.tokens) for c in _probe(w, dtype)]
        calls += [_scaled(c, _probe_dims(w), chunk, w.vocab) for c in _probe_loss(w, dtype)]
        if args.only:
            calls = [c for c in calls if c.program.name in args.only]
            calls = list({(c.program.name, c.a_t, c.b_t, c.M, c.N, c.K): c for c in calls}.values())
        print(f"== {w.name}, {args.tokens} tokens, {args.dtype}: {len(calls)} calls a layer (+ head chunk)")
        head = f"{'program':<16} {'lay':<3} {'M':>6} {'N':>6} {'K':>6}  {'config':<22} {'source':<16}"
        head += f" {'cuBLAS':>7} {'plain':>7} {'ours':>7}  ours/cuBLAS p / s   excess ms"
        print(head + ("  tuned/cuBLAS" if args.tune else ""))
        for rec in calls:
            r = measure(rec, args.tune)
            r["widths"], r["dtype"] = w.name, args.dtype
            rows.append(r)
            p, s = r["paired"], r["sustained"]
            line = (f"{r['program']:<16} {r['layout']:<3} {r['M']:>6} {r['N']:>6} {r['K']:>6}  "
                    f"{r['config']:<22} {r['source']:<16} "
                    f"{p['cublas']:7.3f} {p['plain']:7.3f} {p['codetta']:7.3f}  "
                    f"{p['codetta'] / p['cublas']:6.3f} / {s['codetta'] / s['cublas']:6.3f}   "
                    f"{p['codetta'] - p['cublas']:+7.3f}")  # fmt: skip
            if args.tune:
                line += f"  {p['tuned'] / p['cublas']:6.3f} ({r['tuned']})"
            print(line, flush=True)
        mine = [r for r in rows if r["widths"] == w.name]
        if not mine:
            continue
        for how in ("paired", "sustained"):
            tot = {k: sum(r[how][k] for r in mine) for k in mine[0][how]}
            print(f"   total {how}: " + ", ".join(f"{k} {v:.3f} ms" for k, v in tot.items()))
    if args.out:
        with open(f"{args.out}/call_ratios_{args.dtype}.json", "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
