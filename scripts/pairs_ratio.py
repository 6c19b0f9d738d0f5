"""The q projection's GEMM with each RoPE epilogue against cuBLAS's GEMM (GPU machine).

Times, at 16384 x 4096 x 4096 (Llama-3-8B's q projection), head_dim 128: cuBLAS's
GEMM, codetta's plain GEMM, the rotate-half RoPE program (Hugging Face's convention)
and the interleaved-pairs one (Meta's original Llama code), each with the norm's row
scale; paired and sustained, each with the configuration codetta picks (shipped or
rule). The two RoPE programs write the same bytes; their difference is the rotation's
arithmetic and layout shuffles.

Usage: python scripts/pairs_ratio.py [M N K]
"""

import sys

import torch

import codetta
from codetta.kernels.timing import paired_ms, sustained_ms
from codetta.ops.rope import column_freq
from codetta.programs.rope import RMS_ROPE_128, RMS_ROPE_PAIRS_128


def main(M: int = 16384, N: int = 4096, K: int = 4096, hd: int = 128) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = torch.randn(M, K, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, device="cuda", generator=g) * K**-0.5).to(torch.bfloat16)
    sumsq = torch.rand(M, device="cuda", generator=g) * K + 1
    pos = torch.arange(M, device="cuda") % 4096
    inv_freq = 1.0 / 500000 ** (torch.arange(0, hd, 2, device="cuda").float() / hd)
    common = {"sumsq": sumsq, "inv_d": 1.0 / K, "eps": 1e-5, "pos": pos, "scaling": 1.0}
    halves = column_freq(inv_freq.repeat(2), N, keep=False)  # as the operator forms them (ops/rope.py)
    pairs = column_freq(inv_freq.repeat_interleave(2), N, keep=False)
    fns = {
        "cublas": lambda: h @ w.t(),
        "codetta store": lambda: codetta.gemm(h, w),
        "rope rotate-half": lambda: codetta.gemm(h, w, epilogue=RMS_ROPE_128, freq=halves, **common),
        "rope pairs": lambda: codetta.gemm(h, w, epilogue=RMS_ROPE_PAIRS_128, freq=pairs, **common),
    }
    for fn in fns.values():
        fn()
    torch.cuda.synchronize()
    paired, sustained = paired_ms(fns), sustained_ms(fns)
    print(f"== {M} x {N} x {K}, head_dim {hd}: ms, x cuBLAS (paired / sustained)")
    for k in fns:
        print(f"  {k:18s} {paired[k]:.4f} / {sustained[k]:.4f}  x{paired[k] / paired['cublas']:.3f} / "
              f"x{sustained[k] / sustained['cublas']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main(*map(int, sys.argv[1:4]))
