"""The tile raster's row-group height (``Config.group_m``) on the LM head's logits, A/B
in one process (GPU machine).

The shipped configs raster 8 row-tiles per column sweep (GROUP_M 8; 16 lost to 8 at K1's
shapes, NOTES.md), but for the H100's LM-head e1 picks, 4 since this script's run 225. The
LM head's chunk is 4096 rows (32 row-tiles) by V 128256: with 8, each weight tile is read
from DRAM once per group of 8 row-tiles, 4 times a chunk (~2.1 GB at 1B width); with 32 a
column's 32 row-tiles run together and W is read once (~0.5 GB), A (16-32 MB) staying in L2.
On the H100, whose ce_logits is 1.2x cuBLAS where the H200's is ~1.0x (runs 221, 224), less
DRAM traffic may matter. For ce_logits and ce_logits_scaled at 1B and 8B width: the chosen
config at GROUP_M 4, 8, 16 and 32, with cuBLAS's GEMM of the same shape, paired and
sustained-block timing; every variant's outputs the chosen one's bits (the raster moves no
arithmetic).

Usage (repo root): PYTHONPATH=. python scripts/group_ab.py [--tokens 16384] [--out FILE]
    [--groups 4 8 16 32] [--only ce_logits ce_logits_scaled [residual_rms]]
"""

from __future__ import annotations

import dataclasses

import torch
from order_ab import ab_parser, calls, outputs, save_rows, time_against_cublas

from codetta.kernels import launch
from codetta.kernels.launch import gemm
from codetta.kernels.operands import make_call
from codetta.kernels.tuning import CHOOSER


def main() -> int:
    ap = ab_parser(__doc__, ["ce_logits", "ce_logits_scaled"])
    ap.add_argument("--groups", type=int, nargs="+", default=[4, 8, 16, 32])
    args = ap.parse_args()
    rows = []
    for spec, rec, a, w, ops in calls(args.tokens, args.only):
        prog = rec.program
        call = make_call(prog, a, w, ops)
        chosen = CHOOSER.choose(call, launch._prepare_for_tuning(call))
        print(f"== {spec} {prog.name} {rec.M}x{rec.N}x{rec.K}, chosen {chosen.short()} "
              "(ms, paired / sustained; / cuBLAS)", flush=True)  # fmt: skip
        fns = {"cublas": lambda a=a, w=w: a @ w.t()}
        for g in dict.fromkeys([chosen.group_m, *args.groups]):  # (the chosen one's: the reference)
            cfg = dataclasses.replace(chosen, group_m=g)
            fns[f"group_m {g}"] = lambda c=cfg, a=a, w=w, o=ops, p=prog: gemm(a, w, epilogue=p, config=c, **o)
        outs = outputs(fns)
        ref = outs[f"group_m {chosen.group_m}"]
        for k, got in outs.items():
            if k != "cublas" and not all(torch.equal(x, y) for x, y in zip(got, ref)):
                print(f"   MISMATCH {k} against group_m {chosen.group_m}", flush=True)
        p, s = time_against_cublas(fns, 12)
        rows.append(dict(widths=spec, program=prog.name, M=rec.M, N=rec.N, K=rec.K, chosen=chosen.short(),
                         paired=p, sustained=s))  # fmt: skip
    return save_rows(args.out, rows)


if __name__ == "__main__":
    raise SystemExit(main())
