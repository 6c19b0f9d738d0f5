"""A norm's dX over several next weights, dh = sum_i dz_i @ W_i, four ways (one H200):

- ``k-parts``: one launch, ``gemm(dz_0, W_0.t(), epilogue=STORE_Kn, a1=dz_1, w1=W_1.t(), ...)``
  (K parts: each part's K loop after the previous one's, one rounding);
- ``chain``: the previous way, a plain GEMM then one ACCUMULATE per further weight
  (dh read and written once more per weight, rounded each time);
- ``cublas``: PyTorch's own, dz_0 @ W_0 + dz_1 @ W_1 + ... (separate GEMMs and adds);
- ``cublas:concat``: one cuBLAS GEMM over the concatenated K (the floor: operands
  concatenated before timing).

Shapes: the q/k/v projections' dX (Llama-3.2-1B at 8192 and 16384 tokens, Llama-3-8B
at 16384) and the gate/up pair's (the MLP's norm). Prints time per call (paired /
sustained, ``codetta.kernels.timing``) and each variant's ratio to ``cublas:concat``,
and the error of each against float64.

    python scripts/k_parts.py
"""

from __future__ import annotations

import torch

from codetta import gemm
from codetta.kernels.timing import paired_ms, sustained_ms
from codetta.programs import ACCUMULATE, STORE_K2, STORE_K3, STORE_K4

CASES = [
    ("1B q/k/v, 8192 tok", 8192, 2048, (2048, 512, 512)),
    ("1B q/k/v, 16384 tok", 16384, 2048, (2048, 512, 512)),
    ("8B q/k/v, 16384 tok", 16384, 4096, (4096, 1024, 1024)),
    ("1B gate/up, 8192 tok", 8192, 2048, (8192, 8192)),
    ("8B gate/up, 16384 tok", 16384, 4096, (14336, 14336)),
]
SUMS = {2: STORE_K2, 3: STORE_K3, 4: STORE_K4}


def variants(dzs, ws):
    parts = {}
    for i, (dz, w) in enumerate(zip(dzs[1:], ws[1:]), 1):
        parts[f"a{i}"], parts[f"w{i}"] = dz, w.t()
    cat_dz, cat_w = torch.cat(dzs, 1), torch.cat(ws, 0)

    def chain():
        dh = gemm(dzs[0], ws[0].t())
        for dz, w in zip(dzs[1:], ws[1:]):
            dh = gemm(dz, w.t(), epilogue=ACCUMULATE, c=dh)
        return dh

    def eager():
        dh = dzs[0] @ ws[0]
        for dz, w in zip(dzs[1:], ws[1:]):
            dh = dh + dz @ w
        return dh

    return {
        "k-parts": lambda: gemm(dzs[0], ws[0].t(), epilogue=SUMS[len(ws)], **parts),
        "chain": chain,
        "cublas": eager,
        "cublas:concat": lambda: cat_dz @ cat_w,
    }


def main() -> None:
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for name, M, d, widths in CASES:
        g = torch.Generator(device="cuda").manual_seed(0)
        dzs = [torch.randn(M, n, device="cuda", generator=g).to(torch.bfloat16) for n in widths]
        ws = [(torch.randn(n, d, device="cuda", generator=g) * n**-0.5).to(torch.bfloat16) for n in widths]
        fns = variants(dzs, ws)
        ref = sum(dz.double() @ w.double() for dz, w in zip(dzs, ws))
        errs = {k: ((fn().double() - ref).norm() / ref.norm()).item() for k, fn in fns.items()}
        torch.cuda.synchronize()
        paired = paired_ms(fns, min_s=1.0, warm_s=0.3)
        sustained = sustained_ms(fns, block_ms=60.0)
        base_p, base_s = paired["cublas:concat"], sustained["cublas:concat"]
        for k in fns:
            print(f"  {name:<22} {k:<14} {paired[k]:7.3f} / {sustained[k]:7.3f} ms   "
                  f"x{paired[k] / base_p:.3f} / x{sustained[k] / base_s:.3f}   rel err {errs[k]:.2e}",
                  flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
