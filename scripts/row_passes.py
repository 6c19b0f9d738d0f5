"""The q/k/v operator's backward row passes under each launch shape (GPU machine).

RoPE's inverse rotation (``unrotate_half_rows``) and Qwen3's q/k-norm backward
(``qknorm_backward_rows``) are memory-bound passes over [tokens, q or k width]. Until
2026-12-01 their launches had 4 warps ("previous": 182-255 registers per thread for
sm_90a, the inverse rotation spilling 16-160 B), then 8 with the same rows and one head
per program ("8w-1h"); since c27276c two heads per program (``unrotate_launch``,
``qknorm_launch``; runs 147-148 in NOTES.md). This times every (rows per program, warps,
heads per program) choice, those launches and the default at the benchmark's shapes,
checks each launch's outputs against float64 (from the same float32 angles): within 2x
the error of the default launch with the polynomials' sines and cosines ("default-poly";
the q/k-norm pass's default takes them from the special-function unit since 2026-12-03,
the inverse rotation's keeps the polynomials: runs 160 and 163), and prints GB/s (bytes
read and written / time). These passes take 30-180 us; at the smaller widths their
paired times follow the host's launch time (~45 us a row kernel on the H200 machine's
host, run 162) more than the GPU's, and move 2x between machines (the 1B inverse
rotation: 85 us in run 160, 45 in run 163).

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
    unrotate_half,
    unrotate_half_rows,
    unrotate_launch,
)

# (label, q width, k width, head_dim)
CASES = [("llama3-1b", 2048, 512, 64), ("llama3-8b / qwen3-8b", 4096, 1024, 128)]


def choices(half: int) -> list[tuple[int, int, int, bool]]:
    """(rows per program, warps, heads per program: their rows' angles made once for them,
    the special-function unit's sines and cosines as the default's) with 2048, 4096 or 8192
    elements of each rotated half per program."""
    sizes = [(e, w, h) for e in (2048, 4096, 8192) for w in (4, 8) for h in (1, 2, 4, 8)]
    return [(max(1, e // (h * half)), w, h, True) for e, w, h in sizes]


def reference64(name: str, g, pre, w, pos, inv_freq, hd: int, eps: float = 1e-6):
    """The pass's outputs in float64 from the same float32 angles: dz, and for the q/k
    norm its weight gradient."""
    M, N = g.shape
    angle = (pos.to(torch.float32)[:, None] * inv_freq.repeat(2).repeat(N // hd)[None, :]).double()
    n = unrotate_half(g.double(), angle.cos(), angle.sin(), hd)
    if name == "unrotate":
        return (n,)
    n = n.reshape(M, N // hd, hd)
    z = pre.double().reshape(M, N // hd, hd)
    rho = (z.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
    h = z * rho
    gw = n * w.double()
    dz = rho * (gw - h * (gw * h).mean(-1, keepdim=True))
    return dz.reshape(M, N), (n * h).sum((0, 1))


def errors(got, ref) -> list[float]:
    got = got if isinstance(got, tuple) else (got,)
    return [(a.double() - b).abs().max().item() for a, b in zip(got, ref)]


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
            for name, (fn, streams) in passes.items():
                ref = reference64(name, g, pre, w, pos, inv_freq, hd)
                default = (unrotate_launch if name == "unrotate" else qknorm_launch)(hd // 2)
                # the launches before: rows as below, 4 warps (to 2026-12-01), then 8 (to
                # 02aa51b); the default launch with the polynomials' sines and cosines (to 2026-12-03)
                rows = (4096 if name == "unrotate" else 2048) // (hd // 2)
                named = {(rows, 4, 1, False): "previous", (rows, 8, 1, False): "8w-1h",
                         (*default[:3], False): "default-poly"}  # fmt: skip
                bound = [2 * e for e in errors(fn(launch=named_launch(named, "default-poly")), ref)]
                fns = {"default": partial(fn, launch=None)}
                print(f"   {name} default: max error {errors(fn(launch=None), ref)} (bound: 2x the "
                      f"polynomials' {[b / 2 for b in bound]})")  # fmt: skip
                for choice in [*named, *choices(hd // 2)]:
                    err = errors(fn(launch=choice), ref)
                    if any(e > b for e, b in zip(err, bound)):
                        print(f"   {name} {choice}: error {err} > 2x the polynomials' default's")
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
                    print(f"   {k:12s} {ms * 1e3:8.1f} us  {gb / ms * 1e3:6.0f} GB/s")


def named_launch(named: dict, label: str) -> tuple:
    return next(k for k, v in named.items() if v == label)


if __name__ == "__main__":
    main()
