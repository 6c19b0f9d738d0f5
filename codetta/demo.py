"""``python -m codetta demo``: the K1 program against float64, then a tiny Llama through
the Hugging Face drop-in, checked against the unpatched model, with its kernel plan.

On a CPU it runs the real kernels through the Triton interpreter (fp32 for the model,
fp16 for K1); on a GPU in bf16 at a larger size.
"""

from __future__ import annotations

import copy

import torch

ROLES = {
    ("residual_rms", "nn"): "o_proj / down_proj + residual; stores x, x*gamma and sum x^2 (K1)",
    ("rms_scale", "nn"): "next projection (v / LM head) x 1/rms(x) per row",
    ("rms_scale_bias", "nn"): "v x 1/rms(x) per row, + its bias (Qwen2)",
    ("swiglu_rms", "nn"): "gate and up (two weights, one GEMM) x 1/rms(x); stores g, u, silu(g)*u",
    ("dswiglu", "nt"): "down_proj's dX with the SwiGLU backward: dg, du",
    ("accumulate_f32", "tt"): "LM head weight gradient, summed over row chunks in fp32",
    ("store", "nt"): "input gradient dX = dY @ W",
    ("accumulate", "nt"): "input gradient of a fifth or later next GEMM, added in the epilogue",
    ("store_k2", "nt"): "input gradient over two next GEMMs (gate, up) in one GEMM: dg Wg + du Wu",
    ("store_k3", "nt"): "input gradient over three next GEMMs (q, k, v) in one GEMM: dq Wq + dk Wk + dv Wv",
    ("store_m3", "tt"): "q, k and v weight gradients in one GEMM (CODETTA_QKV_ONE_LAUNCH=1)",
    ("store", "tt"): "weight gradient dW = dY^T @ X",
    ("ce_logits", "nn"): "LM head: a chunk of logits and its rows' log-sum-exp",
    ("ce_logits_scaled", "nn"): "LM head on the final norm's h, x 1/rms(x) per row; logits' log-sum-exp",
    ("ce_probs", "nn"): "LM head: exp(logit - row reference) and its row sums (CODETTA_CE_PROBS)",
    ("ce_probs_scaled", "nn"): "LM head on h, x 1/rms(x): exp(logit - row reference), row sums (CE_PROBS)",
    ("ce_probs_dx", "nt"): "loss's dX from those: a row factor, minus the target's row of W",
    ("ce_probs_dw", "tt"): "loss's dW from those, one chunk: plus the target rows' fp32 sums, rounded once",
    ("finish_f32", "tt"): "LM head weight gradient: the last chunk's, added to the fp32 sum, rounded once",
    ("store_f32", "tt"): "LM head weight gradient: the first chunk's, stored in fp32",
}
for _hd in (16, 32, 64, 128, 256):
    ROLES[(f"rms_rope_{_hd}", "nn")] = "q, k x 1/rms(x), then RoPE (rotate-half, per-token positions)"
    ROLES[(f"rms_qknorm_rope_{_hd}", "nn")] = "q, k x 1/rms(x), per-head q/k norm, RoPE (Qwen3)"
    ROLES[(f"rms_rope_bias_{_hd}", "nn")] = "q, k x 1/rms(x), + their biases, then RoPE (Qwen2)"
    ROLES[(f"rms_rope_{_hd}_n3", "nn")] = "q, k, v in one GEMM x 1/rms(x), RoPE on q and k (QKV_ONE_LAUNCH)"


def _err(x, ref) -> float:
    return (x.double() - ref.double()).abs().max().item()


def k1(device: str) -> bool:
    import codetta
    from codetta import programs as pg
    from codetta import reference as ref

    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    M, N, K = (4096, 4096, 4096) if device == "cuda" else (200, 96, 128)
    print(
        f"K1 program (residual + RMSNorm statistics), M={M} N={N} K={K} {str(dtype).removeprefix('torch.')}"
    )
    torch.manual_seed(0)
    y = torch.randn(M, K, device=device).to(dtype)
    w = (torch.randn(N, K, device=device) * K**-0.5).to(dtype)
    r = torch.randn(M, N, device=device).to(dtype)
    g = torch.rand(N, device=device) + 0.5
    out = codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, residual=r, gamma=g)
    x64, h64, ss64 = ref.residual_rms_chain(y.double(), w.double(), r.double(), g.double())
    x_t = r + y @ w.t()
    ok = True
    for name, ours, want, theirs in [
        ("x", out.x, x64, x_t),
        ("h", out.h, h64, (x_t.float() * g).to(dtype)),
        ("sumsq", out.sumsq, ss64, x_t.float().pow(2).sum(-1)),
    ]:
        e_ours, e_torch = _err(ours, want), _err(theirs, want)
        good = e_ours <= 2 * e_torch + 1e-6 * want.abs().max().item()
        ok &= good
        print(
            f"  {name:<6} max error vs fp64: codetta {e_ours:.2e}, PyTorch {e_torch:.2e}  "
            + ("ok" if good else "FAIL")
        )
    return ok


def llama(device: str) -> bool | None:
    """None when transformers is not installed."""
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ImportError:
        print("tiny Llama: skipped (pip install 'codetta[hf]' for the Hugging Face drop-in)")
        return None
    import codetta
    from codetta.kernels.launch import recording

    gpu = device == "cuda"
    dtype = torch.bfloat16 if gpu else torch.float32
    d, f, layers, heads, kv, hd, vocab = (
        (1024, 2816, 4, 16, 4, 64, 32000) if gpu else (64, 96, 2, 4, 2, 16, 128)
    )
    B, S = (4, 1024) if gpu else (2, 12)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=d, intermediate_size=f, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
                      max_position_embeddings=max(S, 64), attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(device=device, dtype=dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) + 0.5)
    dt = str(dtype).removeprefix("torch.")
    print(f"tiny Llama ({layers} layers, d={d}, f={f}, V={vocab}, {B}x{S} tokens, {dt}):"
          " loss and gradients, patched vs unpatched, against float64")  # fmt: skip
    ids = torch.randint(0, vocab, (B, S), device=device)

    def step(m):
        m.zero_grad(set_to_none=True)
        out = m(input_ids=ids, labels=ids, use_cache=False)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad for n, p in m.named_parameters()}

    ref = step(copy.deepcopy(model).double())
    plain = step(copy.deepcopy(model))
    patched = codetta.apply_codetta(copy.deepcopy(model))
    with recording(compute=True) as calls:
        ours = step(patched)

    def ratio(n):  # our error / (2 x PyTorch's + a tiny absolute term), as the tests bound it
        bound = 2 * _err(plain[1][n], ref[1][n]) + 1e-6 * max(ref[1][n].abs().max().item(), 1.0)
        return _err(ours[1][n], ref[1][n]) / bound

    worst = max((ratio(n), n) for n in ref[1])
    e_loss, e_loss_t = _err(ours[0], ref[0]), _err(plain[0], ref[0])
    print(f"  loss {ours[0].item():.6f} (unpatched {plain[0].item():.6f}; "
          f"errors vs fp64 {e_loss:.1e} / {e_loss_t:.1e})")  # fmt: skip
    ok = worst[0] <= 1.0
    print(
        f"  gradients: worst error / (2 x PyTorch's) = {worst[0]:.2f} ({worst[1]})  "
        + ("ok" if ok else "FAIL")
    )
    _plan(calls, dtype)
    return ok


def _plan(calls, dtype) -> None:
    print("  kernel plan of one training step (codetta GEMMs; attention runs in PyTorch):")
    seen: dict = {}
    for c in calls:
        key = (c.program.name, ("t" if c.a_t else "n") + ("t" if c.b_t else "n"))
        seen.setdefault(key, []).append(c)
    for key, cs in seen.items():
        shapes = sorted({(c.M, c.N, c.K) for c in cs})
        shown = ", ".join(f"{m}x{n}x{k}" for m, n, k in shapes[:3]) + (" ..." if len(shapes) > 3 else "")
        print(f"    {len(cs):3d} x {key[0]:<20} {ROLES.get(key, ''):<72} {shown}")
    elt = torch.finfo(dtype).bits // 8
    k1s = [c for c in calls if c.program.name == "residual_rms"]
    saved = sum(3 * c.M * c.N * elt for c in k1s)
    print(f"  HBM traffic the forward saves against eager: {saved / 2**20:.1f} MiB per step")
    print("    (a model: per residual + norm boundary eager moves 7 [T, d] tensors between the GEMMs -")
    print("    o_proj output write, add 2 reads + 1 write, norm 1 read + 1 write, next GEMM reads n -")
    print("    codetta 4: residual read, x and h writes, h read)")


def main() -> int:
    import codetta

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mode = (
        "GPU"
        if device == "cuda"
        else ("Triton interpreter" if codetta.interpreting() else "PyTorch reference")
    )
    print(f"codetta {codetta.__version__} demo on {mode}")
    ok = k1(device)
    lm = llama(device)
    ok = ok and lm is not False
    print("demo passed" if ok else "demo FAILED")
    return 0 if ok else 1
