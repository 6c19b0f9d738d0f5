"""Why the LM head's weight gradient is summed over row chunks in float32 (any machine).

``linear_cross_entropy`` forms dW = sum over row chunks of dlogits_c^T x_c. Summed in a
float32 [V, d] buffer and rounded once, it costs 4 V d bytes (4 GiB at V 262144, d 4096:
issue 15's 512 MiB bar is out of reach with it); added into the bf16 gradient chunk by
chunk (what Liger's fused loss does) it costs nothing, but rounds once per chunk. This
measures that rounding against the project's bound (every gradient within 2x PyTorch's
own error in the same dtype, max abs error against float64): dW's error over PyTorch's
bf16 error (``F.cross_entropy(F.linear(x, w).float(), t)``), for the float32 sum and for
the bf16 one, by chunk count, with codetta's per-chunk math emulated in PyTorch (bf16
logits stored, softmax from them, dlogits rounded to bf16, each chunk's product in
float32).

Usage: python scripts/ce_bf16_sum.py [M d V]   (default 4096 512 8192; CPU, a few minutes)
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

CHUNKS = (1, 2, 4, 8, 16, 32)


def ratios(M: int, d: int, V: int, scale: float, reduction: str, seed: int) -> dict[str, float]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, d, generator=g) * scale).bfloat16()
    w = (torch.randn(V, d, generator=g) * d**-0.5).bfloat16()
    t = torch.randint(0, V, (M,), generator=g)
    xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
    F.cross_entropy(F.linear(xd, wd), t, reduction=reduction).backward()
    wt = w.clone().requires_grad_()
    F.cross_entropy(F.linear(x, wt).float(), t, reduction=reduction).backward()
    err = lambda dw: (dw.double() - wd.grad).abs().max().item()  # noqa: E731
    e_torch = err(wt.grad)
    s = 1.0 / M if reduction == "mean" else 1.0
    out = {}
    for n in CHUNKS:
        rows = M // n
        acc32 = torch.zeros(V, d)
        acc16 = torch.zeros(V, d, dtype=torch.bfloat16)
        for c in range(n):
            xc, tc = x[c * rows : (c + 1) * rows], t[c * rows : (c + 1) * rows]
            logits = (xc.float() @ w.float().T).bfloat16().float()
            p = torch.softmax(logits, 1)
            p[torch.arange(rows), tc] -= 1
            prod = (p * s).bfloat16().float().T @ xc.float()
            acc32 += prod
            acc16 = (acc16.float() + prod).bfloat16()
        out[f"f32 {n}"] = err(acc32.bfloat16()) / e_torch
        out[f"bf16 {n}"] = err(acc16) / e_torch
    return out


def main() -> None:
    M, d, V = (int(a) for a in sys.argv[1:4]) if len(sys.argv) > 3 else (4096, 512, 8192)
    print(f"dW max error / PyTorch bf16's, M {M}, d {d}, V {V}; chunks: {' '.join(map(str, CHUNKS))}")
    for scale in (1.0, 4.0):
        for reduction in ("mean", "sum"):
            for seed in (0, 1):
                r = ratios(M, d, V, scale, reduction, seed)
                f32 = " ".join(f"{r[f'f32 {n}']:.2f}" for n in CHUNKS)
                b16 = " ".join(f"{r[f'bf16 {n}']:.2f}" for n in CHUNKS)
                head = f"x scale {scale}, {reduction}, seed {seed}"
                print(f"{head}: float32 sum {f32} | bf16 sum {b16}", flush=True)


if __name__ == "__main__":
    main()
