"""The loss's gradient without a gradient pass, simulated in PyTorch (CPU, no kernels): a
per-row reference c chosen before the logits GEMM, q = exp(l - c) stored in bf16, and
p = exp(c - lse) q as a row factor s of the dX and dW GEMMs (NOTES.md, "A lead for the
loss"). Compares its dX and dW error against float64 with PyTorch's own bf16 path (logits
rounded to bf16, dlogits = bf16(p - onehot)), for the target's -1 folded into q by a
fix-up after the row finish, and for it kept exact (-g W[t] in the dX epilogue, -g x
scattered into the float32 dW).

Usage: python scripts/ce_reference_sim.py [--rows 512] [--d 256] [--vocab 8192] [--trials 4]
"""

from __future__ import annotations

import argparse

import torch

BF = torch.bfloat16


def rb(t: torch.Tensor) -> torch.Tensor:
    """Rounded to bf16, back in float32."""
    return t.to(BF).float()


def trial(M: int, d: int, V: int, scale: float, seed: int, sample: int = 256, margin: float = 20.0):
    g = torch.Generator().manual_seed(seed)
    x = rb(torch.randn(M, d, generator=g))
    w = rb(torch.randn(V, d, generator=g) * d**-0.5 * scale)
    t = torch.randint(0, V, (M,), generator=g)
    gout = 1.0 / M  # (the mean's incoming gradient)
    onehot = torch.nn.functional.one_hot(t, V)
    l64 = x.double() @ w.double().T
    dl64 = (torch.softmax(l64, -1) - onehot.double()) * gout
    dx64, dw64 = dl64 @ w.double(), dl64.T @ x.double()
    # PyTorch's bf16 path
    dl = rb((torch.softmax(rb(x @ w.T), -1) - onehot.float()) * gout)
    dx_t, dw_t = rb(dl @ w), rb(dl.T @ x)
    # the reference: the max over a sample of the vocabulary plus a margin
    acc = x @ w.T  # (the GEMM's float32 accumulator)
    c = acc[:, torch.randperm(V, generator=g)[:sample]].amax(1) + margin
    q32 = torch.exp(acc - c[:, None])
    lse = c + torch.log(q32.sum(1))
    s = torch.exp(c - lse) * gout
    rows = torch.arange(M)
    # (a) the target folded into q by a fix-up: q_t - g / s
    q = rb(q32)
    q[rows, t] = rb(q[rows, t] - gout / s)
    dx_a, dw_a = rb(s[:, None] * (q @ w)), rb(q.T @ rb(s[:, None] * x))
    # (b) the target's term exact: -g W[t] in dX's epilogue, -g x scattered into dW's float32 sum
    q = rb(q32)
    dx_b = rb(s[:, None] * (q @ w) - gout * w[t])
    dw_b = rb(q.T @ rb(s[:, None] * x) - torch.zeros(V, d).index_add_(0, t, gout * x))

    def err(a, ref):
        return (a.double() - ref).abs().max().item()

    et = err(dx_t, dx64), err(dw_t, dw64)
    gap = (l64.amax(1) - c).max().item()  # (overflow needs it below ~75)
    ratios = [err(a, r) / e for a, r, e in ((dx_a, dx64, et[0]), (dw_a, dw64, et[1]), (dx_b, dx64, et[0]),
                                            (dw_b, dw64, et[1]))]  # fmt: skip
    return (*ratios, gap)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--trials", type=int, default=4)
    args = ap.parse_args()
    print("error / PyTorch bf16's error against float64 (max over elements), per trial")
    for scale in (1.0, 3.0, 8.0):
        rs = [trial(args.rows, args.d, args.vocab, scale, s) for s in range(args.trials)]
        col = [[f"{r[i]:.2f}" for r in rs] for i in range(4)]
        print(f"logit scale {scale}: fix-up dX {col[0]} dW {col[1]}; exact target dX {col[2]} dW {col[3]}; "
              f"max logit - c up to {max(r[4] for r in rs):.1f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
