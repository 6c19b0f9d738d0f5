"""Probe (GPU machine): is a transform of the A operand free inside a Hopper GEMM?

The question behind it (NOTES.md, "the CE gradient pass"): the LM head's backward GEMMs
read the stored logits chunk l [T, V] as their A operand anyway (dX = G @ W, dW = G^T @
X); if each formed G = exp(l - lse[t]) - [v == target[t]] from l as it loads A, the
separate gradient pass over the chunk (a read and a write of [T, V], ~2.2 ms a
Llama-3.2-1B step) would go. This times a small persistent TMA GEMM in Triton with and
without that transform, against cuBLAS, at the two layouts:

    dX: [T, d] = G [T, V] @ W [V, d]       (A row-major, K = V)
    dW: [V, d] = G^T [V, T] @ X [T, d]     (A a transposed view, K = T)

and checks the transformed GEMM against PyTorch's (G formed first, then the matmul).

    python scripts/prologue_probe.py [T V d]     (default 4096 128256 2048)
"""

import functools
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from codetta.kernels.mainloop import tile_coords
from codetta.kernels.timing import paired_ms

LOG2E = 1.4426950408889634


@triton.jit
def _probe_kernel(a_desc, b_desc, c_desc, lse_ptr, tgt_ptr, M, N, K, A_T: tl.constexpr, MODE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, NUM_SMS: tl.constexpr):  # fmt: skip
    """C = A' @ B, B stored [K, N]. MODE 0: A' = A. MODE 1: A' = exp(A - lse) - onehot,
    lse/target indexed by A's row (A_T False: the output row) or by K (A_T True)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    k_tiles = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), num_m * num_n, NUM_SMS, flatten=True):
        pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        rows = off_m + tl.arange(0, BLOCK_M)
        if MODE == 1 and not A_T:
            lse_r = tl.load(lse_ptr + rows, mask=rows < M, other=0.0) * 1.4426950408889634
            tgt_r = tl.load(tgt_ptr + rows, mask=rows < M, other=-1)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ki in range(k_tiles):
            off_k = ki * BLOCK_K
            if A_T:
                a = a_desc.load([off_k, off_m]).T
            else:
                a = a_desc.load([off_m, off_k])
            if MODE == 1:
                ks = off_k + tl.arange(0, BLOCK_K)
                if A_T:
                    lse_k = tl.load(lse_ptr + ks, mask=ks < K, other=0.0) * 1.4426950408889634
                    tgt_k = tl.load(tgt_ptr + ks, mask=ks < K, other=-1)
                    p = tl.exp2(a.to(tl.float32) * 1.4426950408889634 - lse_k[None, :])
                    p = p - tl.where(rows[:, None] == tgt_k[None, :], 1.0, 0.0)
                else:
                    p = tl.exp2(a.to(tl.float32) * 1.4426950408889634 - lse_r[:, None])
                    p = p - tl.where(ks[None, :] == tgt_r[:, None], 1.0, 0.0)
                a = p.to(a_desc.dtype)
            b = b_desc.load([off_k, off_n])
            acc = tl.dot(a, b, acc)
        c_desc.store([off_m, off_n], acc.to(c_desc.dtype))


def probe(a, b, lse, tgt, a_t: bool, mode: int, cfg):
    """C = transform(A) @ B with a the stored A ([M, K], or [K, M] when a_t)."""
    BM, BN, BK, stages, warps = cfg
    K, N = b.shape
    M = a.shape[1] if a_t else a.shape[0]
    c = torch.empty(M, N, device=a.device, dtype=a.dtype)
    a_desc = TensorDescriptor.from_tensor(a, [BK, BM] if a_t else [BM, BK])
    b_desc = TensorDescriptor.from_tensor(b, [BK, BN])
    c_desc = TensorDescriptor.from_tensor(c, [BM, BN])
    sms = torch.cuda.get_device_properties(a.device).multi_processor_count
    grid = (min(sms, triton.cdiv(M, BM) * triton.cdiv(N, BN)),)
    _probe_kernel[grid](a_desc, b_desc, c_desc, lse, tgt, M, N, K, A_T=a_t, MODE=mode, BLOCK_M=BM, BLOCK_N=BN,
                        BLOCK_K=BK, GROUP_M=8, NUM_SMS=sms, num_stages=stages, num_warps=warps)  # fmt: skip
    return c


CONFIGS = ((128, 256, 64, 3, 8), (128, 256, 64, 4, 8), (128, 128, 64, 4, 8), (128, 128, 64, 5, 4),
           (128, 128, 64, 4, 4), (64, 256, 64, 4, 4))  # fmt: skip


def main(argv):
    T, V, d = [int(x) for x in argv[:3]] or [4096, 128256, 2048]
    torch.manual_seed(0)
    dt = torch.bfloat16
    logits = (torch.randn(T, V, device="cuda") * 2).to(dt)
    lse = logits.float().logsumexp(1)
    tgt = torch.randint(0, V, (T,), device="cuda", dtype=torch.int32)
    w = torch.randn(V, d, device="cuda", dtype=dt) * 0.02
    x = torch.randn(T, d, device="cuda", dtype=dt)
    g = torch.exp(logits.float() - lse[:, None])
    g[torch.arange(T, device="cuda"), tgt.long()] -= 1.0
    g = g.to(dt)
    cases = {
        "dX": (logits, w, False, lambda: g @ w, lambda: logits @ w, lambda gg: gg @ w),
        "dW": (logits, x, True, lambda: g.T @ x, lambda: logits.T @ x, lambda gg: gg.T @ x),
    }
    print(f"T {T} V {V} d {d}, {torch.cuda.get_device_name()}, triton {triton.__version__}")
    rows = []
    for name, (a, b, a_t, want, plain_ref, _) in cases.items():
        ref = want().float()
        pref = plain_ref().float()
        fns = {"cublas": lambda a=a, b=b, a_t=a_t: (a.T if a_t else a) @ b}
        for cfg in CONFIGS:
            for mode in (0, 1):
                try:
                    out = probe(a, b, lse, tgt, a_t, mode, cfg).float()
                except Exception as exc:  # noqa: BLE001 - a config the compiler refuses: skipped
                    print(f"  {name} {cfg} mode {mode}: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                r = ref if mode else pref
                err = ((out - r).norm() / r.norm()).item()
                if err > 2e-2:
                    print(f"  {name} {cfg} mode {mode}: WRONG, relative error {err:.2e}")
                    continue
                fns[(cfg, mode)] = functools.partial(probe, a, b, lse, tgt, a_t, mode, cfg)
        t = paired_ms(fns, min_s=3.0)
        cub = t.pop("cublas")
        best = {m: min((ms, cfg) for (cfg, mm), ms in t.items() if mm == m) for m in (0, 1) if
                any(mm == m for _, mm in t)}  # fmt: skip
        for (cfg, mode), ms in sorted(t.items(), key=lambda kv: (kv[0][1], kv[1])):
            how = "transform" if mode else "plain"
            print(f"  {name} {str(cfg):<26} {how:<9} {ms:8.3f} ms  {ms / cub:.3f}x cuBLAS")
        rows.append((name, cub, best))
    print("\ncase   cuBLAS ms   plain best (x cuBLAS)   transform best (x cuBLAS, x plain)")
    for name, cub, best in rows:
        p = best.get(0, (float("nan"), None))
        q = best.get(1, (float("nan"), None))
        print(f"{name:<5} {cub:9.3f}   {p[0]:8.3f} ({p[0] / cub:.3f}) {p[1]}   {q[0]:8.3f} "
              f"({q[0] / cub:.3f}, {q[0] / p[0]:.3f}) {q[1]}")  # fmt: skip
    print(
        "gradient pass it would replace: one read + one write of [T, V] =",
        f"{2 * T * V * 2 / 1e9:.2f} GB (~{2 * T * V * 2 / 3.8e12 * 1e3:.2f} ms at 3.8 TB/s)",
    )


if __name__ == "__main__":
    main(sys.argv[1:])
