"""Random-shape check of residual_rmsnorm_linear (interpreter, fp16) against float64.

Usage (repo root, CPU): TRITON_INTERPRET=1 PYTHONPATH=. python scripts/fuzz/fuzz_op.py START COUNT
(GPU: FUZZ_DEVICE=cuda FUZZ_DTYPE=bfloat16 PYTHONPATH=. python scripts/fuzz/fuzz_op.py START COUNT)
(seeds START .. START+COUNT-1; one line a seed: "ok", or the case and what exceeded twice
PyTorch's own fp16 error against float64, or the exception). At one or a few rows the
max-of-errors statistic is noisy: ratios of 2-3.4 showed up there with medians <= 1
(NOTES.md, runs 171-177 section); a failure at many rows, or an exception, is a finding.
Biases (Qwen2's, ``bias=``) are drawn from a generator of their own (seed + 13), where the
programs add them (no q/k norms, no interleaved pairs), so earlier seeds keep their cases.
"""

import random

import torch
from fuzz_common import DTYPE, ON_GPU, compare, drawn_settings, grow, leaves_as, run_seeds, start

from codetta.ops import RoPE, residual_rmsnorm_linear, rmsnorm_linear


def rot_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), -1)


def rope_ref(z, pos, inv_freq, scaling, hd, pairs):
    lead = z.shape[:-1]
    zh = z.reshape(*lead, -1, hd)
    # float32 angles as codetta forms them; their cos and sin in float64 for the float64
    # reference, else in float32 and rounded to z's dtype (as Hugging Face's rotary embedding)
    ang = pos.to(torch.float32)[..., None] * inv_freq.float()
    ang = ang.double() if z.dtype == torch.float64 else ang
    cos, sin = (ang.cos() * scaling).to(z.dtype), (ang.sin() * scaling).to(z.dtype)
    if pairs:
        c = cos.repeat_interleave(2, -1)[..., None, :]
        s = sin.repeat_interleave(2, -1)[..., None, :]
        a, b = zh[..., 0::2], zh[..., 1::2]
        rot = torch.stack((-b, a), -1).reshape(zh.shape)
    else:
        c = cos.repeat(*([1] * (ang.dim() - 1)), 2)[..., None, :]
        s = sin.repeat(*([1] * (ang.dim() - 1)), 2)[..., None, :]
        rot = rot_half(zh)
    return (zh * c + rot * s).reshape(z.shape)


def reference(y, w_o, res, gamma, ws, eps, rope, bs=()):
    x = res + y @ w_o.t()
    n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma
    n = n.to(ws[0].dtype)
    zs = [n @ w.t() for w in ws]
    if bs:
        zs = [z if b is None else z + b.to(z.dtype) for z, b in zip(zs, bs)]
    if rope is not None:
        hd = 2 * rope.inv_freq.shape[0]
        for i in range(rope.n_weights):
            z = zs[i]
            if rope.qk_norm_weights:
                zh = z.reshape(*z.shape[:-1], -1, hd)
                zh = (
                    zh
                    * torch.rsqrt(zh.pow(2).mean(-1, keepdim=True) + rope.qk_norm_eps)
                    * rope.qk_norm_weights[i]
                )
                z = zh.reshape(z.shape)
            zs[i] = rope_ref(
                z,
                rope.position_ids.expand(z.shape[:-1]),
                rope.inv_freq,
                rope.attention_scaling,
                hd,
                rope.interleaved,
            )
    return x, zs


def run_case(seed):
    rng = start(seed)
    dt = DTYPE
    gr, gw = grow(seed)
    lead = rng.choice([(rng.randint(1, 70),), (rng.randint(1, 3), rng.randint(1, 33)), (1, 1)])
    lead = (*lead[:-1], lead[-1] * gr)
    K = 8 * rng.randint(1, 8) * gw
    hd = rng.choice([16, 32])
    if ON_GPU:
        hd = random.Random(seed + 7).choice([16, 32, 64, 128, 256])
    d = 8 * rng.randint(2, 10) * gw
    use_rope = rng.random() < 0.6
    nw = rng.randint(1, 3)
    ns = (
        [hd * rng.randint(1, 3) * min(gw, 8) for _ in range(nw)]
        if use_rope
        else [8 * rng.randint(1, 10) * gw for _ in range(nw)]
    )
    first = rng.random() < 0.25  # rmsnorm_linear (no o-projection)
    eps = rng.choice([1e-5, 1e-6, None])
    gamma_dt = rng.choice([torch.float32, dt])
    y = torch.randn(*lead, K).to(dt)
    w_o = (torch.randn(d, K) * K**-0.5).to(dt)
    res = torch.randn(*lead, d).to(dt)
    gamma = (torch.rand(d) + 0.5).to(gamma_dt)
    ws = [(torch.randn(n, d) * d**-0.5).to(dt) for n in ns]
    rope = None
    desc = dict(lead=lead, K=K, d=d, ns=ns, first=first, gamma=str(gamma_dt), eps=eps)
    # a residual stream of large magnitude (a deep model's grows to 10-100s), drawn apart so
    # that the other draws of a seed stay what they were
    big = random.Random(seed + 17).choice([1.0, 1.0, 1.0, 8.0, 64.0, 300.0])
    if big != 1.0:
        y, res = (y.float() * big).to(dt), (res.float() * big).to(dt)
        desc.update(stream_scale=big)
    if use_rope:
        n_rope = rng.randint(1, min(2, nw))
        pairs = rng.random() < 0.4
        qk = rng.random() < 0.3
        scaling = rng.choice([1.0, 0.8])
        # (on a GPU: positions as far as Llama 3's 131072, and sometimes past it)
        top = random.Random(seed + 11).choice([131072, 131072, 1 << 20]) if ON_GPU else 500
        pos = (
            torch.randint(0, top, lead) if rng.random() < 0.5 else torch.arange(lead[-1]).expand(lead).clone()
        )
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        qkw = tuple((torch.rand(hd) + 0.5).to(dt) for _ in range(n_rope)) if qk else ()
        rope = RoPE(pos, inv_freq, scaling, n_rope, qkw, 1e-6, pairs)
        desc.update(n_rope=n_rope, pairs=pairs, qk=qk, scaling=scaling)
    brng = random.Random(seed + 13)
    plain_rope = rope is None or not (rope.qk_norm_weights or rope.interleaved)
    slots = []  # each output's bias: None, or its index among the leaves' biases
    if plain_rope and brng.random() < 0.35:
        slots = [None if brng.random() < 0.2 else i for i in range(nw)]
        b_dt = brng.choice([torch.float32, dt])
        desc.update(bias=[s is not None for s in slots], bias_dt=str(b_dt))
    biases = [torch.randn(n).to(b_dt) for n, s in zip(ns, slots) if s is not None]
    slots = [None if s is None else sum(t is not None for t in slots[:i]) for i, s in enumerate(slots)]
    nq = len(rope.qk_norm_weights) if rope else 0
    leaves = [y, w_o, res, gamma, *ws, *(rope.qk_norm_weights if rope else ()), *biases]
    leaves = [t.clone().requires_grad_() for t in leaves]
    Ly, Lwo, Lres, Lg, *rest = leaves
    Lws, Lqk, Lb = rest[:nw], rest[nw : nw + nq], rest[nw + nq :]
    bias = [None if s is None else Lb[s] for s in slots] if slots else None
    r = rope._replace(qk_norm_weights=tuple(Lqk)) if rope else None
    eps_v = torch.finfo(dt).eps if eps is None else eps
    options = dict(qkv_one_launch=[False, True], overwrite_saved=[True, False], poison_outputs=[False, True])
    with drawn_settings(seed, desc, **options):
        if first:
            zs = rmsnorm_linear(Lres, Lg, list(Lws), eps, rope=r, bias=bias)
            outs = list(zs)
            used = [Lres, Lg, *Lws, *Lqk, *Lb]
        else:
            x, zs = residual_rmsnorm_linear(Ly, Lwo, Lres, Lg, list(Lws), eps, rope=r, bias=bias)
            outs = [x, *zs]
            used = leaves
        gs = [torch.randn(o.shape).to(dt) for o in outs]
        grads = torch.autograd.grad(outs, used, gs, allow_unused=True)

    # float64 reference and PyTorch's own fp16 math
    def chain(ts, dtype):
        ty, two, tres, tg, *trest = ts
        tws, tqk, tb = trest[:nw], trest[nw : nw + nq], trest[nw + nq :]
        rr = rope._replace(qk_norm_weights=tuple(tqk)) if rope else None
        if first:
            two = torch.zeros(d, K, dtype=ty.dtype)
            ty = torch.zeros(*lead, K, dtype=ty.dtype)
        tbs = [None if s is None else tb[s] for s in slots]
        x, z = reference(ty, two, tres, tg, tws, eps_v, rr, tbs)
        return ([] if first else [x]) + z

    def ref_with(dtype):
        ts = leaves_as(leaves, dtype)
        o = chain(ts, dtype)
        u = [ts[2], ts[3], *ts[4:]] if first else ts
        g = torch.autograd.grad(o, u, [gg.to(o_.dtype) for gg, o_ in zip(gs, o)], allow_unused=True)
        return o, g

    o64, g64 = ref_with(torch.float64)
    o16, g16 = ref_with(dt)
    names = [f"out{i}" for i in range(len(outs))] + [f"grad{i}" for i in range(len(grads))]
    return desc, compare(names, [*outs, *grads], [*o64, *g64], [*o16, *g16])


if __name__ == "__main__":
    run_seeds(run_case)
