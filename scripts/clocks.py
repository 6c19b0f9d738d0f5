"""The SM clock, power and energy per call of codetta's GEMM kernels against cuBLAS's,
each run back to back for a few seconds (GPU machine).

Sustained-block timing finds codetta's fused operators 1-5 % further from cuBLAS than
paired timing does, and a model step under codetta ran at a lower median SM clock than
under torch.compile (run 151, NOTES.md). This runs each kernel alone, back to back,
for ``SECONDS`` while nvidia-smi samples every 20 ms the SM clock, the power (the
driver's average and, where it has one, its instant reading) and the active clock event
reasons (why the clock is below its maximum), and prints per kernel: time per call,
TFLOP/s, median clock and power, the share of samples with each reason, and the energy
per call (median average power x time per call). Same shapes, same data: the energy
column says whether codetta's kernels spend more joules than cuBLAS's on the same work,
the reasons column which limit sets the clock.

Usage (repo root): PYTHONPATH=. python scripts/clocks.py [seconds [set ...]]   (default 3 s,
the first two sets: ``kernels`` (codetta's mainloops and fused programs against cuBLAS),
``bytes`` (one GEMM with epilogues that move more bytes); ``configs``: every candidate
configuration of K1 and SwiGLU)
"""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from codetta import Config, gemm
from codetta.programs import ACCUMULATE, ACCUMULATE_F32, FINISH_F32, RESIDUAL_RMS, SWIGLU

REASONS = {0x1: "idle", 0x2: "app clocks", 0x4: "SW power cap", 0x8: "HW slowdown", 0x20: "SW thermal",
           0x40: "HW thermal", 0x80: "HW power brake"}  # fmt: skip
FIELDS = ("clocks.sm,power.draw", "power.draw.instant", "clocks_event_reasons.active")


class Sampler:
    """nvidia-smi every 20 ms, one process per query (a field an older driver lacks fails
    only its own process)."""

    def __enter__(self):
        self.procs = [
            subprocess.Popen(
                ["nvidia-smi", f"--query-gpu={f}", "--format=csv,noheader,nounits", "-lms", "20"],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )  # fmt: skip
            for f in FIELDS
        ]
        return self

    def __exit__(self, *exc):
        outs = []
        for p in self.procs:
            p.terminate()
            outs.append(p.communicate()[0].splitlines())
        # the first second: nvidia-smi's start-up and the kernel's own ramp
        skip = lambda rows: rows[min(len(rows) // 3, 50) :]  # noqa: E731
        self.clk, self.pw = [], []
        for line in skip(outs[0]):
            try:
                c, w = (float(x) for x in line.split(","))
            except ValueError:
                continue
            self.clk.append(c)
            self.pw.append(w)
        self.inst = [float(x) for x in skip(outs[1]) if x.strip().replace(".", "", 1).isdigit()]
        self.why = []
        for line in skip(outs[2]):
            try:
                self.why.append(int(line.strip(), 16))
            except ValueError:
                pass


def reasons(codes: list[int]) -> str:
    """The share of samples with each clock event reason, '-' with no samples."""
    if not codes:
        return "-"
    share = {lbl: sum(1 for x in codes if x & bit) / len(codes) for bit, lbl in REASONS.items()}
    return ", ".join(f"{lbl} {v:.0%}" for lbl, v in share.items() if v)


def med(v):
    v = sorted(v)
    return v[len(v) // 2] if v else float("nan")


def run(fn, seconds: float) -> tuple[float, Sampler]:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    n = max(10, int(seconds * 1e3 / max(s.elapsed_time(e), 1e-3)))
    with Sampler() as smp:
        time.sleep(0.3)  # nvidia-smi started
        s.record()
        for _ in range(n):
            fn()
        e.record()
        e.synchronize()
    return s.elapsed_time(e) / n, smp


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


def config_variants() -> dict:
    """Every candidate configuration of two fused calls (K1 at 16384 x 4096 x 4096, the
    8B SwiGLU at 16384 x 2 x 14336 x 4096), the chosen one marked: which mainloop and tile
    spend the fewest joules at the cap (the time a step's GEMMs take)."""
    from codetta.kernels import launch
    from codetta.kernels.operands import make_call
    from codetta.kernels.tuning import CHOOSER, candidates

    M, d, f = 16384, 4096, 14336
    g = torch.Generator(device="cuda").manual_seed(0)
    r = lambda *s, sc=1.0: (torch.randn(*s, device="cuda", generator=g) * sc).bfloat16()  # noqa: E731
    x, w, res = r(M, d), r(d, d, sc=d**-0.5), r(M, d)
    gamma = torch.rand(d, device="cuda", generator=g).bfloat16() + 0.5
    wg, wu = r(f, d, sc=d**-0.5), r(f, d, sc=d**-0.5)
    out = {}
    for label, prog, a, wt, ops, fl in (
        ("K1", RESIDUAL_RMS, x, w, {"residual": res, "gamma": gamma}, 2 * M * d * d),
        ("SwiGLU", SWIGLU, x, wg, {"up": wu}, 4 * M * f * d),
    ):
        call = make_call(prog, a, wt, ops)
        chosen = CHOOSER.choose(call, launch._prepare_for_tuning(call))
        for cfg in candidates(call):
            mark = " (chosen)" if cfg == chosen else ""
            fn = lambda a=a, wt=wt, ops=ops, cfg=cfg, prog=prog: gemm(a, wt, epilogue=prog, config=cfg, **ops)  # noqa: E731
            out[f"{label} {cfg.short()}{mark}"] = (fn, fl)
    return out


SETS = {"kernels": variants, "bytes": byte_variants, "configs": config_variants}


def main() -> None:
    seconds = float(sys.argv[1]) if len(sys.argv) > 1 else 3.0
    chosen = sys.argv[2:] or ["kernels", "bytes"]
    print(torch.cuda.get_device_name(), "torch", torch.__version__, f"{seconds:.0f} s per kernel")
    print(f"{'kernel':44s} {'ms/call':>8s} {'TFLOP/s':>8s} {'MHz':>6s} {'W avg':>6s} {'W inst':>6s} "
          f"{'J/call':>7s}  clock held back by")  # fmt: skip
    todo = {k: v for name in chosen for k, v in SETS[name]().items()}
    for name, (fn, flops) in todo.items():
        try:
            ms, smp = run(fn, seconds)
        except Exception as exc:  # (a config this GPU refuses: say so, go on)
            print(f"{name:44s} failed: {type(exc).__name__}: {str(exc)[:100]}")
            continue
        why = reasons(smp.why)
        tf = flops / ms / 1e9 if flops else float("nan")
        print(f"{name:44s} {ms:8.3f} {tf:8.1f} {med(smp.clk):6.0f} {med(smp.pw):6.0f} {med(smp.inst):6.0f} "
              f"{med(smp.pw) * ms / 1e3:7.3f}  {why or 'nothing'} ({len(smp.clk)} samples)")  # fmt: skip


if __name__ == "__main__":
    main()
