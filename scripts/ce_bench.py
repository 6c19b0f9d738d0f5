"""The LM head + cross-entropy, forward + backward, against its floor and Liger (GPU).

Times ``linear_cross_entropy`` (mean over 16384 tokens, V = 128256) at several chunk
sizes against Liger's fused linear cross-entropy and the floor (the three cuBLAS GEMMs
of the head: logits, dX, dW, on a whole [T, V] logits tensor), paired and sustained,
with each variant's peak memory beyond its inputs. Then the logits GEMM's epilogue
taken apart at one chunk (row LSE only, target pick only, both, none) to show what
each reduction costs. (Each variant runs the configuration the launcher picks for it,
so compare like with like: ``call_ratios.py --tune`` shows the picks.)

Usage (repo root): PYTHONPATH=. python scripts/ce_bench.py [--widths 2048 4096] [--chunks 1024 2048 4096]
"""

from __future__ import annotations

import argparse
import sys

import torch
import triton
import triton.language as tl

from codetta.bench import ce
from codetta.bench.harness import peak_memory_gb
from codetta.kernels.configs import BACKWARD_CANDIDATES, PLAIN_CANDIDATES
from codetta.kernels.launch import gemm
from codetta.kernels.program import DType, PerRow, Program, RowLogSumExp, RowPick, Tile
from codetta.kernels.timing import paired_ms, sustained_ms
from codetta.ops import linear_cross_entropy
from codetta.programs.ce import CE_LOGITS, CE_LOGITS_EXT

V, T = 128256, 16384
_CONFIGS = tuple(BACKWARD_CANDIDATES) + tuple(c for c in PLAIN_CANDIDATES if c.occupancy == 2)


@triton.jit
def _lse_only(acc, elem):
    logit = acc.to(elem.dtype).to(tl.float32)
    return logit, logit


@triton.jit
def _pick_only(acc, target, elem):
    logit = acc.to(elem.dtype).to(tl.float32)
    return logit, logit


@triton.jit
def _lse_pick(acc, target, elem):
    logit = acc.to(elem.dtype).to(tl.float32)
    return logit, logit, logit


LSE_ONLY = Program("bisect_lse", _lse_only, inputs=(DType("elem"),),
                   outputs=(Tile("logits"), RowLogSumExp("lse")), configs=_CONFIGS)  # fmt: skip
PICK_ONLY = Program("bisect_pick", _pick_only, inputs=(PerRow("target", index=True), DType("elem")),
                    outputs=(Tile("logits"), RowPick("picked", index="target")),
                    configs=_CONFIGS)  # fmt: skip
LSE_PICK = Program("bisect_lse_pick", _lse_pick, inputs=(PerRow("target", index=True), DType("elem")),
                   outputs=(Tile("logits"), RowLogSumExp("lse"), RowPick("picked", index="target")),
                   configs=_CONFIGS)  # fmt: skip


def head(d: int, chunks) -> None:
    """The head at several chunk sizes against Liger and the floor (the bench's ce part
    times the default chunk against every peer)."""
    p = ce.problem(T, d, V)
    (x, w), tgt = p["leaves"], p["target"]
    fns = {
        f"codetta chunk {rows}": lambda rows=rows: torch.autograd.grad(
            linear_cross_entropy(x, w, tgt, chunk_rows=rows), (x, w)
        )
        for rows in chunks
    }  # fmt: skip
    liger = ce.liger_fn()
    if liger is not None:
        fns["liger"] = lambda: torch.autograd.grad(liger(x, w, tgt), (x, w))
    fns["floor"] = ce.cublas_gemms(p, backward=True)
    mem = {}
    for k, fn in fns.items():
        fn()
        mem[k] = peak_memory_gb(fn) if k != "floor" else 0.0
    pt = paired_ms(fns, min_s=1.5)
    st = sustained_ms(fns, block_ms=150.0, blocks=3)
    print(f"== LM head + CE fwd+bwd, T {T}, d {d}, V {V}")
    print("   (ms paired, time / floor paired / sustained, peak GB beyond the inputs)")
    for k in fns:
        ratio = f"{pt[k] / pt['floor']:6.3f} / {st[k] / st['floor']:6.3f}"
        print(f"  {k:<22} {pt[k]:8.3f} ms  {ratio}   {mem[k]:6.2f} GB")


def bisect(d: int, rows: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(1)
    x = (torch.randn(rows, d, device="cuda", generator=g) * 0.5).bfloat16()
    w = (torch.randn(V, d, device="cuda", generator=g) * d**-0.5).bfloat16()
    tgt = torch.randint(0, V, (rows,), device="cuda", generator=g)
    zero = torch.zeros(V, device="cuda", dtype=torch.bfloat16)
    fns = {
        "plain": lambda: gemm(x, w),
        "lse only": lambda: gemm(x, w, epilogue=LSE_ONLY),
        "pick only": lambda: gemm(x, w, epilogue=PICK_ONLY, target=tgt),
        "ce_logits": lambda: gemm(x, w, epilogue=CE_LOGITS),  # LSE only since run 48
        "lse + pick": lambda: gemm(x, w, epilogue=LSE_PICK, target=tgt),
        "ext (bias)": lambda: gemm(x, w, epilogue=CE_LOGITS_EXT, bias=zero, softcap=0.0),
        "cuBLAS": lambda: x @ w.t(),
    }
    for fn in fns.values():
        fn()
    p = paired_ms(fns, min_s=1.0)
    print(f"== logits GEMM epilogue parts, [{rows}, {V}, {d}] (ms, / cuBLAS)")
    for k in fns:
        print(f"  {k:<12} {p[k]:7.3f}  {p[k] / p['cuBLAS']:6.3f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--chunks", type=int, nargs="+", default=[1024, 2048, 4096])
    args = ap.parse_args()
    print(torch.cuda.get_device_name())
    for d in args.widths:
        bisect(d, 1024)
        head(d, args.chunks)
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
