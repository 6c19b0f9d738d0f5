"""The q/k/v operator's backward row passes under each launch shape (GPU machine).

RoPE's inverse rotation (``unrotate_half_rows``) and Qwen3's q/k-norm backward
(``qknorm_backward_rows``) are memory-bound passes over [tokens, q or k width]. Until
2026-12-01 their launches had 4 warps ("previous": 182-255 registers per thread for
sm_90a, the inverse rotation spilling 16-160 B), then 8 with the same rows and one head
per program ("8w-1h"); since c27276c two heads per program (``unrotate_launch``,
``qknorm_launch``; runs 147-148 in NOTES.md). This times every (rows per program, warps,
heads per program) choice, those launches and the default at the benchmark's shapes,
checks each output against the default's (dz bit for bit, or for the q/k norm and the
launches with the special-function unit's sines and cosines, "default-approx", within an
ulp: its per-head sums may add in another order; the q/k-norm weight gradient's partial
sums follow the row blocks: within 2x the default's error against a float64 sum), and
prints GB/s (bytes read and written / time).

Usage (repo root): PYTHONPATH=. python scripts/row_passes.py [tokens]   (default 16384)
"""

from __future__ import annotations

import sys
from functools import partial

import torch

from codetta.kernels.timing import paired_ms
from codetta.programs.rope import (
    qknorm_backward_rows,
    qknorm_launch,
    rope_tables,
    unrotate_half,
    unrotate_half_rows,
    unrotate_launch,
)

# (label, q width, k width, head_dim)
CASES = [("llama3-1b", 2048, 512, 64), ("llama3-8b / qwen3-8b", 4096, 1024, 128)]


def choices(half: int) -> list[tuple[int, int, int]]:
    """(rows per program, warps, heads per program: their rows' angles made once for them)
    with 2048, 4096 or 8192 elements of each rotated half per program."""
    return [(max(1, e // (h * half)), w, h) for e in (2048, 4096, 8192) for w in (4, 8) for h in (1, 2, 4, 8)]


def qknorm_dw64(g, pre, pos, inv_freq, hd: int, eps: float = 1e-6) -> torch.Tensor:
    """The q/k-norm weight gradient summed in float64 (the per-element math as the pass's)."""
    M, N = g.shape
    cos, sin = rope_tables(pos, inv_freq.repeat(2).repeat(N // hd), 1.0)
    n = unrotate_half(g.double(), cos.double(), sin.double(), hd).reshape(M, N // hd, hd)
    z = pre.double().reshape(M, N // hd, hd)
    h = z * (z.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    return (n * h).sum((0, 1))


def main() -> None:
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 16384
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "tokens", tokens)
    for label, nq, nk, hd in CASES:
        inv_freq = 1.0 / 500000 ** (torch.arange(0, hd, 2, device="cuda").float() / hd)
        pos = torch.arange(tokens, device="cuda") % 4096
        for width in (nq, nk):
            g = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
            pre = torch.randn(tokens, width, device="cuda", dtype=torch.bfloat16)
            w = torch.rand(hd, device="cuda", dtype=torch.bfloat16) + 0.5
            passes = {
                "unrotate": (partial(unrotate_half_rows, g, pos, inv_freq, 1.0), 2),
                "qknorm": (partial(qknorm_backward_rows, g, pre, w, pos, inv_freq, 1.0, 1e-6), 3),
            }
            dw64 = qknorm_dw64(g, pre, pos, inv_freq, hd)
            for name, (fn, streams) in passes.items():
                # the launches before: rows as below, 4 warps (to 2026-12-01), then 8 (to 02aa51b)
                rows = (4096 if name == "unrotate" else 2048) // (hd // 2)
                named = {(rows, 4, 1): "previous", (rows, 8, 1): "8w-1h"}
                want = fn(launch=None)
                fns = {"default": partial(fn, launch=None)}
                default = (unrotate_launch if name == "unrotate" else qknorm_launch)(hd // 2)
                # the default launch with the special-function unit's sines and cosines
                named[(*default, True)] = "default-approx"
                for choice in [*named, *choices(hd // 2)]:
                    got = fn(launch=choice)
                    got = got if isinstance(got, tuple) else (got,)
                    ref = want if isinstance(want, tuple) else (want,)
                    same = torch.equal(got[0], ref[0])
                    # (other sines and cosines, or a head's norm summed in another order)
                    near = (name == "qknorm" or len(choice) > 3) and torch.allclose(
                        got[0], ref[0], rtol=2**-7, atol=1e-6
                    )
                    if not same and not near:
                        print(f"   {name} {choice}: dz differs from the default's")
                        continue
                    if not same:
                        diff = (got[0] != ref[0]).float().mean().item()
                        print(f"   {name} {choice}: dz within an ulp of the default's ({diff:.1e} differ)")
                    # the weight gradient: fp32 partial sums in another order, so within 2x the
                    # default's error against a float64 sum
                    if (
                        len(got) > 1
                        and (got[1].double() - dw64).abs().max()
                        > 2 * (ref[1].double() - dw64).abs().max() + 1e-7 * dw64.abs().max()
                    ):
                        print(f"   {name} {choice}: weight gradient error > 2x the default's")
                        continue
                    key = named.get(choice) or f"{choice[0]}x{choice[1]}wx{choice[2]}h"
                    fns[key] = partial(fn, launch=choice)
                times = paired_ms(fns, min_s=1.0)
                gb = streams * tokens * width * 2 / 1e9
                best = min(times, key=times.get)
                print(f"== {label} {name} [{tokens}, {width}]: default {times['default'] * 1e3:.1f} us "
                      f"({gb / times['default'] * 1e3:.0f} GB/s), best {best} {times[best] * 1e3:.1f} us "
                      f"({gb / times[best] * 1e3:.0f} GB/s)")  # fmt: skip
                for k, ms in sorted(times.items(), key=lambda kv: kv[1]):
                    print(f"   {k:10s} {ms * 1e3:8.1f} us  {gb / ms * 1e3:6.0f} GB/s")


if __name__ == "__main__":
    main()
