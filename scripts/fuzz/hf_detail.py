"""One drop-in case of ``fuzz_hf.py`` in detail, on a GPU: where a NaN first shows (the
forward's first module with one, in padded rows or not; the backward's first node, by
anomaly detection), and the logits' and the loss's errors against float64, patched and
unpatched.

Usage (repo root, GPU):
FUZZ_DEVICE=cuda FUZZ_DTYPE=bfloat16 PYTHONPATH=. python scripts/fuzz/hf_detail.py SEED..."""

import sys

import torch
import torch.nn.functional as F
from fuzz_common import DEVICE, DTYPE
from fuzz_hf import case, on_device, predicted, step


def first_nan_forward(m, kw):
    """The first module (in call order) whose output holds a NaN, and whether only rows
    the attention mask drops hold them."""
    names, found = {mod: n for n, mod in m.named_modules()}, []
    mask = kw.get("attention_mask")

    def hook(mod, inp, out):
        o = out[0] if isinstance(out, tuple) else out
        if found or not torch.is_tensor(o) or not o.is_floating_point() or not torch.isnan(o).any():
            return
        where = "?"
        if mask is not None and o.dim() >= 3 and o.shape[:2] == mask.shape:
            bad_rows = torch.isnan(o).flatten(2).any(-1)
            where = "padded rows only" if not (bad_rows & (mask != 0)).any() else "real rows too"
        found.append((names[mod], tuple(o.shape), where))

    hs = [mod.register_forward_hook(hook) for mod in names]
    try:
        m.train()
        out = m(**kw)
    finally:
        for h in hs:
            h.remove()
    return out, found


def main(seeds):
    print("device", DEVICE, "dtype", DTYPE, "torch", torch.__version__, flush=True)
    for seed in seeds:
        desc, base, kw = case(seed)
        ref, plain, patched, kw = on_device(base, kw)
        print("seed", seed, desc, flush=True)
        for name, m in (("float64", ref), ("unpatched", plain), ("patched", patched)):
            out, found = first_nan_forward(m, kw)
            print(f"  {name}: loss {out.loss.item():.6f}; first NaN in the forward: {found or 'none'}")
            _, g = step(m, kw)
            nan = [n for n, t in g.items() if torch.isnan(t).any()]
            print(f"  {name}: gradients with a NaN: {len(nan)} of {len(g)} {nan[:3]}")
            if nan:
                m.zero_grad(set_to_none=True)
                with torch.autograd.detect_anomaly(check_nan=True):
                    try:
                        m(**kw).loss.backward()
                        print("  anomaly detection: no NaN raised")
                    except RuntimeError as e:
                        print("  anomaly detection:", str(e)[:400])
        # logits without labels, and the loss from them, against float64's
        rows64, t = predicted(ref, kw)
        ce64 = F.cross_entropy(rows64, t)
        for n, m in (("un", plain), ("pa", patched)):
            rows, _ = predicted(m, kw)
            e = (rows - rows64).abs()
            print(f"  logits {n}: max err {e.max().item():.3e} mean err {e.mean().item():.3e}; "
                  f"CE from them err {abs(F.cross_entropy(rows, t) - ce64).item():.3e}")  # fmt: skip
            # the loss's error per token: its log-sum-exp's and its target logit's, and each
            # row's mean logit error (a shift common to a row cancels in the loss)
            d_lse = torch.logsumexp(rows, -1) - torch.logsumexp(rows64, -1)
            d_t = (rows - rows64).gather(1, t[:, None])[:, 0]
            d_mean = (rows - rows64).mean(-1)
            for what, v in (
                ("lse", d_lse),
                ("target", d_t),
                ("row mean", d_mean),
                ("lse-target", d_lse - d_t),
            ):
                print(f"    {n} {what}: mean {v.mean().item():+.3e} std {v.std().item():.3e}")
            print(f"    {n} logits: std {rows64.std().item():.3e}, rows {rows.shape[0]}")
        for name, m in (("unpatched", plain), ("patched", patched)):
            losses = [m(**kw).loss.item() for _ in range(2)]
            print(f"  {name} fused loss twice: {losses}; float64 {ref(**kw).loss.item():.7f}", flush=True)


if __name__ == "__main__":
    main([int(s) for s in sys.argv[1:]])
