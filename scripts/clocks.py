"""The SM clock, power and energy per call of codetta's GEMM kernels against cuBLAS's,
each run back to back for a few seconds (GPU machine).

Sustained-block timing finds codetta's fused operators 1-5 % further from cuBLAS than
paired timing does, and a model step under codetta ran at a lower median SM clock than
under torch.compile (run 151, NOTES.md). This runs each kernel alone, back to back, with
``energy.py``'s measurement (nvidia-smi sampling the SM clock, the power and the active
clock event reasons every 20 ms) and prints per kernel: time per call, TFLOP/s, median
clock and power, the energy per call (median power x time per call) and the share of
samples with each reason (why the clock is below its maximum). Two sets of kernels:
``kernels`` (cuBLAS, codetta's plain GEMM on each mainloop, K1 and SwiGLU at 8B widths)
and ``bytes`` (one GEMM, 16384 x 4096 x 4096, with epilogues that move one to four bf16
tiles' worth of bytes, and cuBLAS's mm and addmm): what an epilogue's byte costs at the
cap. Every candidate configuration of a fused call: ``energy.py --program NAME``.

Usage (repo root): PYTHONPATH=. python scripts/clocks.py [seconds [set ...]]   (default 3 s,
both sets)
"""

from __future__ import annotations

import sys

import torch
from energy import measure
from profile_step import REASONS

from codetta import Config, gemm
from codetta.programs import ACCUMULATE, ACCUMULATE_F32, FINISH_F32, RESIDUAL_RMS, SWIGLU


def reasons(codes: list[int]) -> str:
    """The share of samples with each clock event reason, '-' with no samples."""
    if not codes:
        return "-"
    share = {lbl: sum(1 for x in codes if x & bit) / len(codes) for bit, lbl in REASONS.items()}
    return ", ".join(f"{lbl} {v:.0%}" for lbl, v in share.items() if v)


def med(v):
    v = sorted(v)
    return v[len(v) // 2] if v else float("nan")


def variants() -> dict:
    M, d, f = 16384, 4096, 14336
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s, sc=1.0: (torch.randn(*s, device="cuda", generator=g) * sc).bfloat16()  # noqa: E731
    x, w = r(M, d), r(d, d, sc=d**-0.5)
    wg, wu = r(f, d, sc=d**-0.5), r(f, d, sc=d**-0.5)
    res, gamma = r(M, d), torch.rand(d, device="cuda", generator=g).bfloat16() + 0.5
    wgu = torch.cat([wg, wu])
    portable = Config(block_m=128, block_n=256, block_k=64, num_stages=3, num_warps=8)
    pingpong = Config(
        block_m=128, block_n=128, block_k=64, num_stages=5, num_warps=4, epi_split=4, pingpong=True
    )
    fl = 2 * M * d * d
    return {
        "cuBLAS 16384x4096x4096": (lambda: x @ w.t(), fl),
        "codetta gemm (its pick)": (lambda: gemm(x, w), fl),
        "codetta gemm portable 128x256": (lambda: gemm(x, w, config=portable), fl),
        "codetta gemm ping-pong 128x128": (lambda: gemm(x, w, config=pingpong), fl),
        "codetta K1 (residual + norm stats)": (
            lambda: gemm(x, w, epilogue=RESIDUAL_RMS, residual=res, gamma=gamma),
            fl,
        ),  # fmt: skip
        "cuBLAS 16384x28672x4096": (lambda: x @ wgu.t(), 2 * M * 2 * f * d),
        "codetta SwiGLU 16384x(2x14336)x4096": (
            lambda: gemm(x, wg, epilogue=SWIGLU, up=wu),
            2 * M * 2 * f * d,
        ),  # fmt: skip
        "cuBLAS 16384x4096x4096 (again)": (lambda: x @ w.t(), fl),
        "torch add [28672, 4096] (memory-bound)": (lambda: torch.add(wgu, 1.0), 0),
    }


def byte_variants() -> dict:
    """One GEMM shape (16384 x 4096 x 4096, bf16 operands) with epilogues that move more
    or fewer bytes: the energy a byte of an epilogue costs when the GEMM runs at the
    power cap. Names end with the epilogue's HBM bytes beyond the operands (MB)."""
    M, N, K = 16384, 4096, 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s, sc=1.0: (torch.randn(*s, device="cuda", generator=g) * sc).bfloat16()  # noqa: E731
    x, w, c = r(M, K), r(N, K, sc=K**-0.5), r(M, N)
    c32, gamma = c.float(), torch.rand(N, device="cuda", generator=g).bfloat16() + 0.5
    out = torch.empty_like(c)
    fl = 2 * M * N * K
    mb = M * N * 2 // 2**20  # one bf16 [M, N] tensor
    return {
        f"cuBLAS mm, out bf16 ({mb})": (lambda: torch.mm(x, w.t(), out=out), fl),
        f"cuBLAS addmm, c bf16 + out bf16 ({2 * mb})": (lambda: torch.addmm(c, x, w.t(), out=out), fl),
        f"codetta store ({mb})": (lambda: gemm(x, w), fl),
        f"codetta accumulate, c bf16 ({2 * mb})": (lambda: gemm(x, w, epilogue=ACCUMULATE, c=c), fl),
        f"codetta finish_f32, c fp32 ({3 * mb})": (lambda: gemm(x, w, epilogue=FINISH_F32, c=c32), fl),
        f"codetta residual_rms ({3 * mb})": (
            lambda: gemm(x, w, epilogue=RESIDUAL_RMS, residual=c, gamma=gamma),
            fl,
        ),
        f"codetta accumulate_f32, c fp32 ({4 * mb})": (
            lambda: gemm(x, w, epilogue=ACCUMULATE_F32, c=c32),
            fl,
        ),
        f"cuBLAS mm, out bf16 ({mb}, again)": (lambda: torch.mm(x, w.t(), out=out), fl),
    }


SETS = {"kernels": variants, "bytes": byte_variants}


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    chosen = sys.argv[2:] or list(SETS)
    print(torch.cuda.get_device_name(), "torch", torch.__version__, f"{seconds:.0f} s per kernel")
    cols = f"{'ms/call':>8s} {'TFLOP/s':>8s} {'MHz':>6s} {'W':>6s} {'J/call':>7s}"
    print(f"{'kernel':44s} {cols}  clock held back by")
    todo = {k: v for name in chosen for k, v in SETS[name]().items()}
    for name, (fn, flops) in todo.items():
        try:
            ms, clocks = measure(fn, seconds)
        except Exception as exc:  # (a config this GPU refuses: say so, go on)
            print(f"{name:44s} failed: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        kept = clocks.samples[len(clocks.samples) // 4 :]  # past nvidia-smi's start-up
        clk, pw = med([c for c, _ in kept]), med([w for _, w in kept])
        why = reasons(clocks.reasons[len(clocks.reasons) // 4 :])
        tf = flops / ms / 1e9 if flops else float("nan")
        print(f"{name:44s} {ms:8.3f} {tf:8.1f} {clk:6.0f} {pw:6.0f} {pw * ms / 1e3:7.3f}  {why or 'nothing'} "
              f"({len(kept)} samples)")  # fmt: skip


if __name__ == "__main__":
    main()
