"""SDPA on the q/k/v layout codetta's operator returns, against contiguous tensors (GPU).

codetta's q, k and v are [B, S, H * head_dim] GEMM outputs; the operator (and
``codetta.nn.RMSNormQKVRoPE``) hands them to attention as [B, H, S, head_dim] transposed
views, with no copy. Hugging Face's attention makes the same views of its projections.
This times ``F.scaled_dot_product_attention`` forward and forward + backward (causal,
GQA through ``enable_gqa``) on those views and on contiguous [B, H, S, head_dim] copies,
under each SDPA backend that takes the inputs, paired and sustained-block timing; and
checks that the outputs agree. (Issue 14: "say which layout, and measure SDPA on it".)

Usage (repo root): PYTHONPATH=. python scripts/sdpa_layout.py [B S heads kv_heads head_dim ...]
(default: the bench's 1B and 8B cases, 4 x 4096 tokens)
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from codetta.kernels.timing import paired_ms, sustained_ms

CASES = [(4, 4096, 32, 8, 64), (4, 4096, 32, 8, 128)]
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}  # fmt: skip


def inputs(B, S, H, KV, hd, layout: str):
    """q, k, v [B, H(KV), S, hd] as codetta returns them ("views") or contiguous."""
    g = torch.Generator(device="cuda").manual_seed(0)
    made = [torch.randn(B, S, h * hd, device="cuda", generator=g, dtype=torch.bfloat16) for h in (H, KV, KV)]
    views = [t.view(B, S, -1, hd).transpose(1, 2) for t in made]
    ts = views if layout == "views" else [t.contiguous() for t in views]
    return [t.detach().requires_grad_() for t in ts]


def run_case(B, S, H, KV, hd) -> None:
    print(f"== B {B}, S {S}, heads {H}/{KV}, head_dim {hd}")
    grad = torch.randn(B, H, S, hd, device="cuda", dtype=torch.bfloat16)
    for bname, backend in BACKENDS.items():
        fns, outs = {}, {}
        for layout in ("views", "contiguous"):
            q, k, v = inputs(B, S, H, KV, hd, layout)

            def fwd(q=q, k=k, v=v):
                with torch.no_grad():
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

            def fwd_bwd(q=q, k=k, v=v):
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                torch.autograd.grad(out, (q, k, v), grad)

            try:
                with sdpa_kernel(backend):
                    outs[layout] = fwd()
                    fwd_bwd()
            except RuntimeError as exc:
                print(f"   {bname:<10} {layout:<11} not available: {str(exc).splitlines()[0][:90]}")
                continue
            fns[f"{layout} fwd"], fns[f"{layout} fwd+bwd"] = fwd, fwd_bwd
        if len(outs) == 2:
            diff = (outs["views"].float() - outs["contiguous"].float()).abs().max().item()
            print(f"   {bname:<10} outputs of the two layouts differ by at most {diff:.2e}")
        if not fns:
            continue

        def under(fn, backend=backend):
            def run():
                with sdpa_kernel(backend):
                    fn()

            return run

        timed = {name: under(fn) for name, fn in fns.items()}
        paired = paired_ms(timed, min_s=0.6, warm_s=0.3)
        sustained = sustained_ms(timed, block_ms=60.0, blocks=3, warm_s=0.2)
        for name in timed:
            p, s = paired[name], sustained[name]
            print(f"   {bname:<10} {name:<22} {p:8.3f} ms paired {s:8.3f} ms sustained")


def main() -> None:
    args = [int(a) for a in sys.argv[1:]]
    cases = [tuple(args[i : i + 5]) for i in range(0, len(args), 5)] if args else CASES
    print(torch.cuda.get_device_name(), "torch", torch.__version__)
    for case in cases:
        run_case(*case)


if __name__ == "__main__":
    main()
