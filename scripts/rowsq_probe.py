"""Probe (GPU machine; a small check on the CPU through the interpreter): can a Hopper GEMM
form its A rows' RMSNorm statistics while its K loop streams them, for free?

The question behind it (NOTES.md, section "Session 53", issue 14's forward bar): the
norm + q/k/v operator runs a statistics pass over x (rstd per row, ~0.066 ms at 8B
width, ~5 % of its forward) before its GEMMs, whose epilogues then scale rows by rstd
(gamma folded into the weights: n @ W^T = rstd * (x @ (W * gamma)^T)). Every output tile's
K loop already brings all of its rows' x through shared memory; if the consumer summed
x^2 from the same tiles beside the MMA (the MMA's operand untouched), the pass would go.
This times a persistent TMA GEMM in Triton, y = rstd * (x @ W^T), W stored [N, K]:

    pass + scale:  rstd from a row kernel first, the GEMM scales by the loaded rstd
    in-loop 1D:    the GEMM sums x^2 per row each K step (a row reduction each step)
    in-loop 2D:    the same into a [BM, BK] float32 accumulator, reduced once at the end

against cuBLAS's x @ W^T (the bar's denominator) and checks each against float64.

    python scripts/rowsq_probe.py [M N K ...]   (default: 16384 6144 4096 and 16384 3072 2048:
                                               the 8B and 1B q|k|v widths)
    TRITON_INTERPRET=1 python scripts/rowsq_probe.py --check   (CPU: small shapes, float16)
"""

import functools
import os
import sys

if __name__ == "__main__" and "--check" in sys.argv:  # (as a program only: see autocast_ratios.py)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from codetta.kernels.mainloop import tile_coords  # noqa: E402

EPS = 1e-5


@triton.jit
def _gemm_kernel(a_desc, b_desc, c_desc, rstd_ptr, M, N, K, eps, MODE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):  # fmt: skip
    """C = rstd[:, None] * (A @ B^T), B stored [N, K]. MODE 0: no scale (plain). MODE 1:
    rstd loaded. MODE 2: rstd from sum(A^2) per row, reduced each K step. MODE 3: the same
    summed into a [BM, BK] accumulator, reduced after the K loop."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        ss = tl.zeros((BLOCK_M,), dtype=tl.float32)
        ss2 = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            a = a_desc.load([off_m, off_k])
            b = b_desc.load([off_n, off_k]).T
            acc = tl.dot(a, b, acc)
            if MODE == 2:
                af = a.to(tl.float32)
                ss += tl.sum(af * af, axis=1)
            if MODE == 3:
                af = a.to(tl.float32)
                ss2 += af * af
        if MODE == 1:
            rows = off_m + tl.arange(0, BLOCK_M)
            acc = acc * tl.load(rstd_ptr + rows, mask=rows < M, other=0.0)[:, None]
        if MODE == 3:
            ss = tl.sum(ss2, axis=1)
        if MODE >= 2:
            acc = acc * tl.rsqrt(ss / K + eps)[:, None]
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


@triton.jit
def _rstd_kernel(x_ptr, rstd_ptr, M, K, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """rstd of ROWS rows a program, the row in BLOCK-wide pieces (the statistics pass)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    ss = tl.zeros((ROWS,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        cols = k0 + tl.arange(0, BLOCK)
        m = (rows[:, None] < M) & (cols[None, :] < K)
        x = tl.load(x_ptr + rows[:, None] * K + cols[None, :], mask=m, other=0.0).to(tl.float32)
        ss += tl.sum(x * x, axis=1)
    tl.store(rstd_ptr + rows, tl.rsqrt(ss / K + eps), mask=rows < M)


def rstd_pass(x, rows: int = 16, block: int = 512):
    M, K = x.shape
    rstd = torch.empty(M, device=x.device, dtype=torch.float32)
    _rstd_kernel[(triton.cdiv(M, rows),)](
        x, rstd, M, K, EPS, ROWS=rows, BLOCK=min(block, triton.next_power_of_2(K)), num_warps=4
    )
    return rstd


def gemm(x, w, mode: int, cfg, rstd=None, sms=None):
    BM, BN, BK, stages, warps = cfg
    M, K = x.shape
    N = w.shape[0]
    c = torch.empty(M, N, device=x.device, dtype=x.dtype)
    a_desc = TensorDescriptor.from_tensor(x, [BM, BK])
    b_desc = TensorDescriptor.from_tensor(w, [BN, BK])
    c_desc = TensorDescriptor.from_tensor(c, [BM, BN])
    if sms is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count
    grid = (min(sms, triton.cdiv(M, BM) * triton.cdiv(N, BN)),)
    rs = rstd if rstd is not None else c  # (an unused pointer where the mode loads none)
    _gemm_kernel[grid](a_desc, b_desc, c_desc, rs, M, N, K, EPS, MODE=mode, BLOCK_M=BM, BLOCK_N=BN,
                       BLOCK_K=BK, GROUP_M=8, NUM_SMS=sms, num_stages=stages, num_warps=warps)  # fmt: skip
    return c


def pass_and_scale(x, w, cfg, sms=None):
    return gemm(x, w, 1, cfg, rstd=rstd_pass(x), sms=sms)


def reference(x, w):
    x64 = x.double()
    return (x64 * torch.rsqrt(x64.pow(2).mean(1, keepdim=True) + EPS)) @ w.double().T


def rel_err(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


VARIANTS = {"pass + scale": None, "in-loop 1D": 2, "in-loop 2D": 3}


def check() -> int:
    """CPU (TRITON_INTERPRET=1): every variant against float64 at small odd shapes, float16;
    each within 2x the error of PyTorch's own float16 chain (norm, then the matmul)."""
    torch.manual_seed(0)
    bad = 0
    for M, N, K in ((48, 40, 72), (64, 32, 128)):
        x = torch.randn(M, K, dtype=torch.float16) * 3
        w = torch.randn(N, K, dtype=torch.float16) * K**-0.5
        want = reference(x, w)
        xf = x.float()
        eager = (xf * torch.rsqrt(xf.pow(2).mean(1, keepdim=True) + EPS)).half() @ w.T
        bound = 2 * rel_err(eager, want)
        for name, mode in VARIANTS.items():
            cfg = (16, 16, 16, 2, 4)
            got = pass_and_scale(x, w, cfg, sms=4) if mode is None else gemm(x, w, mode, cfg, sms=4)
            err = rel_err(got, want)
            ok = err <= bound
            bad += not ok
            verdict = "ok" if ok else "FAIL"
            print(f"  {M}x{N}x{K} {name:<13} relative error {err:.2e} (bound {bound:.2e}) {verdict}")
    return bad


CONFIGS = ((128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 8), (128, 128, 64, 5, 4),
           (128, 128, 64, 4, 4), (64, 256, 64, 4, 4))  # fmt: skip


def main(argv) -> int:
    if "--check" in argv:
        return 1 if check() else 0
    from codetta.kernels.timing import paired_ms, sustained_ms

    nums = [int(v) for v in argv] or [16384, 6144, 4096, 16384, 3072, 2048]
    shapes = [tuple(nums[i : i + 3]) for i in range(0, len(nums), 3)]
    print(f"{torch.cuda.get_device_name()}, torch {torch.version.__version__}, triton {triton.__version__}")
    summary = []
    for M, N, K in shapes:
        torch.manual_seed(0)
        x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * 2
        w = (torch.randn(N, K, device="cuda") * K**-0.5).to(torch.bfloat16)
        want = reference(x, w)
        fns = {"cublas": lambda x=x, w=w: x @ w.T, "rstd pass alone": functools.partial(rstd_pass, x)}
        for cfg in CONFIGS:
            for name, mode in VARIANTS.items():
                fn = (functools.partial(pass_and_scale, x, w, cfg) if mode is None
                      else functools.partial(gemm, x, w, mode, cfg))  # fmt: skip
                try:
                    err = rel_err(fn(), want)
                except Exception as exc:  # noqa: BLE001 - a config the compiler refuses: skipped
                    print(f"  {M}x{N}x{K} {cfg} {name}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                if err > 2e-2:
                    print(f"  {M}x{N}x{K} {cfg} {name}: WRONG, relative error {err:.2e}")
                    continue
                fns[(name, cfg)] = fn
        paired = paired_ms(fns, min_s=3.0)
        best = {}
        for key, ms in paired.items():
            if isinstance(key, tuple) and (key[0] not in best or ms < paired[best[key[0]]]):
                best[key[0]] = key
        finals = {"cublas": fns["cublas"], "rstd pass alone": fns["rstd pass alone"]}
        finals.update({k: fns[k] for k in best.values()})
        sus = sustained_ms(finals)
        cub_p, cub_s = paired["cublas"], sus["cublas"]
        print(f"== {M}x{N}x{K}: cuBLAS {cub_p:.3f} ms paired, {cub_s:.3f} sustained; "
              f"the rstd pass alone {paired['rstd pass alone']:.3f} ms")  # fmt: skip
        for key, ms in sorted(paired.items(), key=lambda kv: kv[1]):
            if isinstance(key, tuple):
                print(f"  {key[0]:<13} {str(key[1]):<24} {ms:8.3f} ms  {ms / cub_p:.3f}x cuBLAS (paired)")
        for name, key in best.items():
            summary.append((f"{M}x{N}x{K}", name, key[1], paired[key] / cub_p, sus[key] / cub_s))
    print("\nshape              variant        best config               x cuBLAS paired / sustained")
    for shape, name, cfg, p, s in summary:
        print(f"{shape:<18} {name:<14} {str(cfg):<25} {p:.3f} / {s:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
