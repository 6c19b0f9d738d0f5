"""Operators III (first part): RoPE in the q/k projections' epilogues after the residual +
RMSNorm (Hugging Face's rotate-half convention), forward and backward."""

import math

import pytest
import torch
from conftest import ON_GPU
from util import assert_within, check_compile_matches_eager, rand

import codetta
from codetta.kernels.launch import recording
from codetta.ops import RoPE, residual_rmsnorm_linear, rmsnorm_linear
from codetta.ops.residual_rmsnorm import residual_rmsnorm_linear_variant
from codetta.programs import RMS_ROPE

EPS = 1e-6
QK_EPS = 1e-6
# (batch, seq, d, q heads, kv heads, head_dim): GQA ratios 1 and 4 (8 on the GPU)
CASES = (
    [(2, 19, 48, 4, 4, 16), (1, 37, 64, 4, 1, 32)]
    if not ON_GPU
    else [(2, 500, 2048, 32, 8, 64), (1, 777, 4096, 32, 4, 128), (3, 100, 1024, 8, 1, 128)]
)


def _rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _head_norm(z4, w, dt):
    """Qwen3RMSNorm over each head of [B, S, H, hd]: statistics in fp32 (fp64 for the
    reference), rounded to the input dtype, times the weight."""
    zf = z4.float() if dt != torch.float64 else z4
    return (zf * torch.rsqrt(zf.pow(2).mean(-1, keepdim=True) + QK_EPS)).to(dt) * w.to(dt)


def _rotate_pairs(x):
    return torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).reshape(x.shape)


def _chain(y, w_o, res, gamma, wq, wk, wv, *qk, pos, inv_freq, hd, dt, interleaved=False, biases=False):
    """The unfused chain in ``dt``: residual, RMSNorm (fp32 statistics), projections (with
    ``biases``: the last three of ``qk`` are q's, k's and v's biases, F.linear's), and
    Hugging Face's apply_rotary_pos_emb on [B, H, S, hd] with cos/sin in ``dt`` (as
    LlamaRotaryEmbedding returns them). ``interleaved``: the interleaved-pairs rotation,
    GPT-J's form in ``dt``; in float64 Meta's (complex multiplication), an independent
    statement of the same convention."""
    x = res + y @ w_o.t()
    xf = x.float() if dt != torch.float64 else x
    n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * gamma.to(xf.dtype)).to(dt)
    B, S = pos.shape
    angle = pos.to(torch.float64 if dt == torch.float64 else torch.float32)[..., None] * inv_freq.to(
        torch.float64 if dt == torch.float64 else torch.float32
    )
    emb = angle.repeat_interleave(2, dim=-1) if interleaved else torch.cat([angle, angle], dim=-1)
    cos, sin = emb.cos().to(dt)[:, None], emb.sin().to(dt)[:, None]  # [B, 1, S, hd]
    outs = []
    bs = qk[-3:] if biases else (None, None, None)
    qk = qk[:-3] if biases else qk
    for i, (w, rotate) in enumerate(((wq, True), (wk, True), (wv, False))):
        z = torch.nn.functional.linear(n, w, bs[i])
        if rotate:
            z4 = z.view(B, S, -1, hd)
            if qk:
                z4 = _head_norm(z4, qk[i], dt)
            z4 = z4.transpose(1, 2)
            if interleaved and dt == torch.float64:
                turn = torch.polar(torch.ones_like(angle), angle)[:, None]  # [B, 1, S, hd / 2]
                pairs = torch.view_as_complex(z4.reshape(*z4.shape[:-1], hd // 2, 2).contiguous())
                z4 = torch.view_as_real(pairs * turn).reshape(z4.shape)
            elif interleaved:
                z4 = z4 * cos + _rotate_pairs(z4) * sin
            else:
                z4 = z4 * cos + _rotate_half(z4) * sin
            z = z4.transpose(1, 2).reshape(B, S, -1)
        outs.append(z)
    return x, outs


def _positions(B, S, packed, device):
    pos = torch.arange(S, device=device).repeat(B, 1)
    if packed:  # two sequences packed in each row: positions restart
        cut = S // 3
        pos[:, cut:] = torch.arange(S - cut, device=device)
    return pos


# each shape with both position kinds and both norm kinds, crossed rather than multiplied
# (the CPU suite's time): on the GPU every combination
_COMBOS = [(c, packed, qk) for c in CASES for packed in (False, True) for qk in (False, True)]
if not ON_GPU:
    _COMBOS = [
        (CASES[0], False, False),
        (CASES[0], True, True),
        (CASES[1], True, False),
        (CASES[1], False, True),
    ]


@pytest.mark.parametrize("case,packed,qk_norm", _COMBOS, ids=lambda v: str(v))
def test_qkv_rope_matches_hf(case, packed, qk_norm, dtype, device):
    B, S, d, hq, hkv, hd = case
    _qkv_rope_matches_hf(B, S, d, hq, hkv, hd, packed, qk_norm, dtype, device)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_first_layer_norm_qkv_rope(qk_norm, dtype, device):
    """``rmsnorm_linear`` (a first layer: no o-projection before the norm) against the
    unfused chain: q, k, v and the gradients of x, gamma and the weights (and the q/k norm
    weights), within 2x PyTorch's own error vs fp64."""
    B, S, d, hq, hkv, hd = CASES[1] if ON_GPU else CASES[0]
    _qkv_rope_matches_hf(B, S, d, hq, hkv, hd, True, qk_norm, dtype, device, first_layer=True)


def _qkv_rope_matches_hf(B, S, d, hq, hkv, hd, packed, qk_norm, dtype, device, first_layer=False,
                         interleaved=False, biases=False):  # fmt: skip
    """x, q, k, v and every gradient against fp64, within 2x PyTorch's own error in the
    same dtype (Hugging Face's own rotary code in that dtype); with Qwen3's per-head q/k
    norms before RoPE too (their weights' gradients included), or with Qwen2's q, k and v
    biases (``biases``: theirs included)."""
    K = 0 if first_layer else d  # the first layer: no o-projection (y @ w_o^T = 0)
    y = rand(B, S, K, dtype=dtype, device=device)
    w_o = rand(d, K, dtype=dtype, device=device, scale=max(K, 1) ** -0.5)
    res = rand(B, S, d, dtype=dtype, device=device)
    gamma = torch.rand(d, device=device) + 0.5
    ws = [rand(h * hd, d, dtype=dtype, device=device, scale=d**-0.5) for h in (hq, hkv, hkv)]
    leaves = [y, w_o, res, gamma, *ws]
    if qk_norm:
        leaves += [torch.rand(hd, device=device).to(dtype) + 0.5 for _ in range(2)]
    if biases:  # (a trained bias is of the outputs' size: Qwen2's reach ~10 on some k columns)
        leaves += [rand(w.shape[0], dtype=dtype, device=device) for w in ws]
    pos = _positions(B, S, packed, device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
    grads_in = [rand(B, S, d, dtype=dtype, device=device)] + [
        rand(B, S, w.shape[0], dtype=dtype, device=device) for w in ws
    ]

    def run(fn, ts):
        ts = [t.detach().clone().requires_grad_() for t in ts]
        x, zs = fn(*ts)
        outs = [x, *zs]
        sum((o.double() * g.double()).sum() for o, g in zip(outs, grads_in)).backward()
        return outs + [t.grad for t in ts]

    def ours(y, w_o, res, gamma, wq, wk, wv, *qk):
        bias = qk[-3:] if biases else None
        qk = qk[:-3] if biases else qk
        rope = RoPE(pos, inv_freq, qk_norm_weights=tuple(qk), qk_norm_eps=QK_EPS, interleaved=interleaved)
        if first_layer:
            return res, rmsnorm_linear(res, gamma, [wq, wk, wv], EPS, rope=rope, bias=bias)
        return residual_rmsnorm_linear(y, w_o, res, gamma, [wq, wk, wv], EPS, rope=rope, bias=bias)

    def chain(dt):
        return lambda *ts: _chain(*ts, pos=pos, inv_freq=inv_freq, hd=hd, dt=dt, interleaved=interleaved,
                                  biases=biases)  # fmt: skip

    got = run(ours, leaves)
    ref = run(chain(torch.float64), [t.double() for t in leaves])
    same = run(chain(dtype), leaves)
    names = ["x", "q", "k", "v", "dy", "dw_o", "dres", "dgamma", "dwq", "dwk", "dwv"]
    names += ["dq_norm", "dk_norm"] * qk_norm + ["dbq", "dbk", "dbv"] * biases
    assert len(got) == len(names)
    for name, a, b, c in zip(names, got, ref, same):
        if first_layer and name in ("dy", "dw_o"):
            assert a is None or a.numel() == 0
            continue
        assert_within(name, a, b, c)


@pytest.mark.parametrize("first_layer,packed,one_launch", [(False, True, False), (True, False, False),
                                                            (False, False, True)])  # fmt: skip
def test_qkv_rope_biases(first_layer, packed, one_launch, dtype, device):
    """Qwen2's q, k and v biases (``bias=``): added in the GEMMs' epilogues before RoPE
    (RMS_ROPE_BIAS, RMS_SCALE_BIAS), their gradients the column sums of the outputs'
    gradients before the rotation; x, q, k, v and every gradient (the biases' too) against
    fp64 within 2x PyTorch's own error, after an o-projection and as a first layer; with
    CODETTA_QKV_ONE_LAUNCH on too (biases take the three launches: the one-launch program
    has none)."""
    from codetta.kernels import settings

    B, S, d, hq, hkv, hd = CASES[1] if ON_GPU or not first_layer else CASES[0]
    with settings.override(qkv_one_launch=one_launch), recording(compute=True) as calls:
        _qkv_rope_matches_hf(B, S, d, hq, hkv, hd, packed, False, dtype, device, first_layer, biases=True)
    names = [c.program.name for c in calls]
    assert names.count(f"rms_rope_bias_{hd}") == 2 and names.count("rms_scale_bias") == 1, names


@pytest.mark.parametrize("qk_norm,first_layer", [(False, False), (True, True)] + [(True, False)] * ON_GPU)
def test_interleaved_pairs(qk_norm, first_layer, dtype, device):
    """``RoPE(interleaved=True)`` (columns 2i, 2i + 1 rotate together) against Meta's
    complex-number form in float64: q, k, v and every gradient within 2x PyTorch's own
    error (GPT-J's form in the same dtype); packed positions."""
    B, S, d, hq, hkv, hd = CASES[1] if ON_GPU else CASES[0]
    _qkv_rope_matches_hf(B, S, d, hq, hkv, hd, True, qk_norm, dtype, device, first_layer, interleaved=True)


def test_interleaved_pairs_head_dim_64(dtype, device):
    """The interleaved pairs at head dim 64, whose program runs the body the ping-pong
    mainloop takes (``rms_rope_pairs``; head dims 16 and 32 run the portable-only one):
    q, k, v and every gradient within 2x PyTorch's own error of the float64 form."""
    _qkv_rope_matches_hf(1, 21, 128, 2, 1, 64, True, False, dtype, device, interleaved=True)


def test_interleaved_pairs_programs():
    """The interleaved convention runs in its own programs, forward and backward; the
    two conventions differ (the test above would pass with either if they did not)."""
    B, S, d, hq, hkv, hd = CASES[0]
    x = rand(B * S, d, dtype=torch.float16, device="cpu")
    ws = [rand(h * hd, d, dtype=torch.float16, device="cpu", scale=0.1) for h in (hq, hkv, hkv)]
    rope = RoPE(torch.arange(B * S), torch.rand(hd // 2) + 0.5, interleaved=True)
    with recording(compute=True) as calls:
        q_pairs = rmsnorm_linear(x, torch.ones(d), ws, EPS, rope=rope)[0]
    names = [c.program.name for c in calls]
    assert names == [f"rms_rope_pairs_{hd}", f"rms_rope_pairs_{hd}", "rms_scale"], names
    q_half = rmsnorm_linear(x, torch.ones(d), ws, EPS, rope=rope._replace(interleaved=False))[0]
    assert (q_pairs.float() - q_half.float()).abs().max() > 0.1
    with pytest.raises(TypeError, match="interleaved"):
        rmsnorm_linear(x, torch.ones(d), ws, EPS, rope=rope._replace(interleaved="yes"))


def _k1_name(dtype):
    """K1's program over a stream of ``dtype``: bf16 stores h = x gamma (RESIDUAL_RMS);
    float16 normalizes first, so K1 stores x and sumsq alone and a row pass (not a GEMM,
    not recorded) writes n (ops/residual_rmsnorm._k1)."""
    return "residual_sumsq" if dtype == torch.float16 else "residual_rms"


def test_rope_runs_in_the_epilogue():
    """q and k come from the RMS_ROPE program (fails if the rotation moves to PyTorch)."""
    B, S, d, hq, hkv, hd = CASES[0]
    t = [rand(B * S, d, dtype=torch.float16, device="cpu") for _ in range(2)]
    ws = [rand(h * hd, d, dtype=torch.float16, device="cpu", scale=0.1) for h in (hq, hkv, hkv)]
    inv_freq = torch.rand(hd // 2)
    w_o = rand(d, d, dtype=torch.float16, device="cpu", scale=0.1)
    with recording(compute=True) as calls:
        residual_rmsnorm_linear(
            t[0], w_o, t[1], torch.ones(d), ws, EPS, rope=RoPE(torch.arange(B * S), inv_freq)
        )
    names = [c.program.name for c in calls]
    assert names == [_k1_name(torch.float16), f"rms_rope_{hd}", f"rms_rope_{hd}", "rms_scale"], names


def test_rope_tables_follow_inv_freq(dtype, device):
    """The column tables made from rope.inv_freq are kept with it between calls (no launch
    per call), and an in-place change of inv_freq (its version counter) remakes them: the
    output after ``inv_freq.mul_`` equals that from a fresh tensor of the new values."""
    from codetta.ops import _eager

    B, S, d, hq, hkv, hd = CASES[0]
    x = rand(B, S, d, dtype=dtype, device=device)
    gamma = torch.rand(d, device=device) + 0.5
    ws = [rand(h * hd, d, dtype=dtype, device=device, scale=d**-0.5) for h in (hq, hkv, hkv)]
    pos = _positions(B, S, False, device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
    with torch.no_grad():
        first = rmsnorm_linear(x, gamma, ws, EPS, rope=RoPE(pos, inv_freq))
        kept = _eager.derived_tables(inv_freq)
        assert kept is not None and "halves" in kept, "the tables were not kept with inv_freq"
        halves = kept["halves"]
        again = rmsnorm_linear(x, gamma, ws, EPS, rope=RoPE(pos, inv_freq))
        assert _eager.derived_tables(inv_freq)["halves"] is halves
        inv_freq.mul_(1.7)
        assert _eager.derived_tables(inv_freq) is None  # (a new version: nothing kept for it yet)
        moved = rmsnorm_linear(x, gamma, ws, EPS, rope=RoPE(pos, inv_freq))
        fresh = rmsnorm_linear(x, gamma, ws, EPS, rope=RoPE(pos, inv_freq.clone()))
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    for a, b in zip(moved, fresh):
        assert torch.equal(a, b)
    assert not torch.equal(moved[0], first[0])  # q rotated by the new angles


def test_derived_tables_die_with_their_source(device):
    """A table kept with a tensor goes when the tensor does (no entry left behind), and a
    tensor that requires grad gets a fresh table each call (nothing kept)."""
    import gc

    from codetta.ops import _eager

    made = []

    def twice(t):
        made.append(1)
        return t * 2

    src = torch.rand(8, device=device)
    ident = id(src)
    table = _eager.derived(src, "twice", lambda: twice(src))
    assert _eager.derived(src, "twice", lambda: twice(src)) is table and len(made) == 1
    assert ident in _eager._DERIVED
    del table
    src = None  # (the last reference)
    gc.collect()
    assert ident not in _eager._DERIVED
    leaf = torch.rand(8, device=device, requires_grad=True)
    first = _eager.derived(leaf, "twice", lambda: twice(leaf))
    assert _eager.derived(leaf, "twice", lambda: twice(leaf)) is not first and len(made) == 3
    assert _eager.derived_tables(leaf) is None


@pytest.mark.parametrize("case", CASES[:2] if ON_GPU else CASES[1:2], ids=str)
def test_qkv_one_launch(case, dtype, device):
    """CODETTA_QKV_ONE_LAUNCH: q, k and v from one GEMM over the three weights (N parts, v's
    columns rotated by angle 0), each its own tensor: the same bits as the three launches,
    forward and backward; within 2x PyTorch's error of float64 (the Hugging Face chain)."""
    from codetta.kernels import settings

    B, S, d, hq, hkv, hd = case
    y, res = rand(B, S, d, dtype=dtype, device=device), rand(B, S, d, dtype=dtype, device=device)
    w_o = rand(d, d, dtype=dtype, device=device, scale=d**-0.5)
    gamma = torch.rand(d, device=device) + 0.5
    ws = [rand(h * hd, d, dtype=dtype, device=device, scale=d**-0.5) for h in (hq, hkv, hkv)]
    rope = RoPE(
        _positions(B, S, True, device), 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=device) / hd))
    )
    grads_in = [rand(B, S, n, dtype=dtype, device=device) for n in (d, *(w.shape[0] for w in ws))]

    def run():
        ts = [t.detach().clone().requires_grad_() for t in (y, w_o, res, gamma, *ws)]
        x, zs = residual_rmsnorm_linear(*ts[:4], ts[4:], EPS, rope=rope)
        sum((o.float() * g.float()).sum() for o, g in zip((x, *zs), grads_in)).backward()
        return [x, *zs] + [t.grad for t in ts]

    with settings.override(qkv_one_launch=True):
        if device == "cuda" or dtype == torch.float16:
            _qkv_rope_matches_hf(B, S, d, hq, hkv, hd, True, False, dtype, device)
        if device == "cuda":  # (other tile configs than the three launches': other bits)
            return
        got = run()
        with recording(compute=True) as calls:
            residual_rmsnorm_linear(y, w_o, res, gamma, ws, EPS, rope=rope)
    assert [c.program.name for c in calls] == [_k1_name(dtype), f"rms_rope_{hd}_n3"]
    for i, (a, b) in enumerate(zip(got, run())):
        assert torch.equal(a, b), i


def test_attention_scaling_and_one_rotated_weight(device):
    """attention_scaling multiplies cos and sin; n_weights=1 rotates only the first output."""
    T, d, hd = 24, 32, 16
    dt = torch.float16 if ON_GPU else torch.float32  # (the GPU serves 16-bit GEMMs only)
    y, res = rand(T, d, dtype=dt, device=device), rand(T, d, dtype=dt, device=device)
    w_o = rand(d, d, dtype=dt, device=device, scale=0.2)
    ws = [rand(2 * hd, d, dtype=dt, device=device, scale=0.2) for _ in range(2)]
    pos, inv_freq = torch.arange(T, device=device), torch.rand(hd // 2, device=device)
    _, (q1, k1) = residual_rmsnorm_linear(y, w_o, res, torch.ones(d, device=device), ws, EPS,
                                          rope=RoPE(pos, inv_freq, 1.0, n_weights=1))  # fmt: skip
    _, (q2, k2) = residual_rmsnorm_linear(y, w_o, res, torch.ones(d, device=device), ws, EPS,
                                          rope=RoPE(pos, inv_freq, 0.5, n_weights=1))  # fmt: skip
    _, (q0, k0) = residual_rmsnorm_linear(y, w_o, res, torch.ones(d, device=device), ws, EPS)
    torch.testing.assert_close(q2, 0.5 * q1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k1, k0)
    assert not torch.allclose(q1, q0)


@pytest.mark.parametrize("n", [1, 3])
def test_rotated_outputs_other_than_two(n, device):
    """RoPE(n_weights=n) rotates the first n outputs: for n other than 2 without q/k norms
    each rotated output's gradient is turned back before the GEMMs (n = 3 rotated all
    three forward, and the backward turned back only the first: k's and v's weight
    gradients 0.94 off, an audit's find). Every gradient within 2x PyTorch's error."""
    T, d, hd = 24, 32, 16
    dt = torch.float16 if ON_GPU else torch.float32
    leaves = [rand(T, d, dtype=dt, device=device), torch.rand(d, device=device) + 0.5]
    leaves += [rand(2 * hd, d, dtype=dt, device=device, scale=d**-0.5) for _ in range(3)]
    pos, inv_freq = torch.arange(T, device=device), 1.0 / 100 ** (torch.arange(hd // 2, device=device) / 8)
    dout = [rand(T, 2 * hd, dtype=dt, device=device) for _ in range(3)]

    def run(ts, ours):
        x, gamma, *ws = ts
        if ours:
            outs = rmsnorm_linear(x, gamma, ws, EPS, rope=RoPE(pos, inv_freq, n_weights=n))
        else:
            xf = x.float() if x.dtype != torch.float64 else x
            nrm = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * gamma.to(xf.dtype)).to(x.dtype)
            ang = pos.to(torch.float64 if x.dtype == torch.float64 else torch.float32)[:, None] * inv_freq.to(
                torch.float64 if x.dtype == torch.float64 else torch.float32
            )
            emb = torch.cat([ang, ang], -1)
            cos, sin = emb.cos().to(x.dtype)[:, None], emb.sin().to(x.dtype)[:, None]
            outs = []
            for i, w in enumerate(ws):
                z = nrm @ w.t()
                if i < n:
                    z4 = z.view(T, -1, hd)
                    z = (z4 * cos + _rotate_half(z4) * sin).reshape(T, -1)
                outs.append(z)
        loss = sum((o.double() * g.double()).sum() for o, g in zip(outs, dout))
        return torch.autograd.grad(loss, ts)

    def leaves_in(dtype):
        return [t.detach().to(dtype if t.dtype != torch.float32 or dtype == torch.float64 else t.dtype)
                .requires_grad_() for t in leaves]  # fmt: skip

    ours, same, ref = (
        run(leaves_in(dt), True),
        run(leaves_in(dt), False),
        run(leaves_in(torch.float64), False),
    )
    for name, a, b, r in zip(("x", "gamma", "wq", "wk", "wv"), ours, same, ref):
        assert_within(name, a, r, b)


@pytest.mark.parametrize(
    "case,exc,match",
    [
        ("pos_float", TypeError, "position_ids must be int32 or int64"),
        ("freq_fp16", TypeError, "inv_freq must be a 1-D float32"),
        ("head_dim", ValueError, "head_dim 12"),
        ("n_weights", ValueError, "rope.n_weights must be an int in"),
        ("pos_shape", ValueError, "must broadcast to the tokens' shape"),
        ("not_whole_heads", ValueError, "not whole heads"),
        ("variant", ValueError, "rope takes the default backward"),
    ],
)
def test_bad_rope(case, exc, match, device):
    T, d, hd = 16, 32, 16
    y = rand(T, d, dtype=torch.float16, device=device)
    w_o = rand(d, d, dtype=torch.float16, device=device)
    ws = [rand(2 * hd, d, dtype=torch.float16, device=device)]
    pos, inv_freq = torch.arange(T, device=device), torch.rand(hd // 2, device=device)
    kw = {}
    if case == "pos_float":
        pos = pos.float()
    elif case == "freq_fp16":
        inv_freq = inv_freq.half()
    elif case == "head_dim":
        inv_freq = torch.rand(6, device=device)
    elif case == "n_weights":
        kw["n_weights"] = 3
    elif case == "pos_shape":
        pos = torch.arange(T + 1, device=device)
    elif case == "not_whole_heads":
        ws = [rand(24, d, dtype=torch.float16, device=device)]
    rope = RoPE(pos, inv_freq, **{"n_weights": 1, **kw})
    with pytest.raises(exc, match=match):
        if case == "variant":
            residual_rmsnorm_linear_variant(
                y, w_o, y, torch.ones(d, device=device), ws[0], backward="folded", rope=rope
            )
        else:
            residual_rmsnorm_linear(y, w_o, y, torch.ones(d, device=device), ws, rope=rope)


def test_rope_program_needs_whole_heads():
    assert RMS_ROPE[64].sub_tile_width == 64
    a, w = torch.randn(8, 16), torch.randn(40, 16)
    with pytest.raises(ValueError, match="multiple of head_dim 32|groups of 32 columns"):
        codetta.gemm(a, w, epilogue=RMS_ROPE[32], sumsq=torch.ones(8), inv_d=1.0, eps=0.0,
                     pos=torch.arange(8), freq=torch.ones(40), scaling=1.0)  # fmt: skip


@pytest.mark.parametrize("qk_norm,interleaved", [(False, False), (True, True)])
def test_module(qk_norm, interleaved, dtype, device):
    """``codetta.nn.RMSNormQKVRoPE`` computes what the functional op computes with its
    parameters (bit for bit: the op's own tests hold it to fp64), returns SDPA-ready
    [B, H, S, hd] views without a copy, and trains every parameter."""
    from codetta.nn import RMSNormQKVRoPE

    B, S, d, hq, hkv, hd = CASES[0]
    m = RMSNormQKVRoPE(d, hq, hkv, hd, rope_theta=500.0, eps=EPS, qk_norm=qk_norm, interleaved=interleaved,
                       device=device, dtype=dtype)  # fmt: skip
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.rand_like(p) + 0.5 if p.dim() == 1 else torch.randn_like(p) * d**-0.5)
    keys = {"norm.weight", "q_proj.weight", "k_proj.weight", "v_proj.weight"}
    assert set(m.state_dict()) == keys | ({"q_norm.weight", "k_norm.weight"} if qk_norm else set())
    x = rand(B, S, d, dtype=dtype, device=device).requires_grad_()
    pos = _positions(B, S, True, device)
    q, k, v = m(x, pos)
    assert q.shape == (B, hq, S, hd) and k.shape == v.shape == (B, hkv, S, hd)
    assert q.transpose(1, 2).is_contiguous() and v.transpose(1, 2).is_contiguous()  # views, no copy
    qk = (m.q_norm.weight, m.k_norm.weight) if qk_norm else ()
    rope = RoPE(pos, m.inv_freq, qk_norm_weights=qk, qk_norm_eps=EPS, interleaved=interleaved)
    ws = [m.q_proj.weight, m.k_proj.weight, m.v_proj.weight]
    want = rmsnorm_linear(x, m.norm.weight, ws, EPS, rope=rope)
    for got, w in zip((q, k, v), want):
        assert torch.equal(got.transpose(1, 2).reshape(w.shape), w)
    out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(hq // hkv, 1),
                                                           v.repeat_interleave(hq // hkv, 1))  # fmt: skip
    out.float().pow(2).sum().backward()
    for name, p in [("x", x), *m.named_parameters()]:
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name


@pytest.mark.parametrize("fused_qkv", [False, True])
def test_module_with_biases(fused_qkv, device):
    """``RMSNormQKVRoPE(bias=True)`` (Qwen2's q, k and v biases; one ``qkv_proj`` bias with
    ``fused_qkv``): the same tensors as ``rmsnorm_linear(..., bias=...)`` and gradients
    reaching every bias; refused with q/k norms or the interleaved rotation."""
    from codetta.nn import RMSNormQKVRoPE

    B, S, d, hq, hkv, hd = CASES[0]
    dt = torch.bfloat16 if device == "cuda" else torch.float32  # (the GPU serves no float32 GEMM)
    m = RMSNormQKVRoPE(d, hq, hkv, hd, eps=EPS, fused_qkv=fused_qkv, bias=True, device=device, dtype=dt)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.rand_like(p) + 0.5 if p.dim() == 1 else torch.randn_like(p) * d**-0.5)
    x = rand(B, S, d, dtype=dt, device=device).requires_grad_()
    pos = _positions(B, S, False, device)
    q, k, v = m(x, pos)
    if fused_qkv:
        ws, bs = m.qkv_proj.weight.split(m.widths), m.qkv_proj.bias.split(m.widths)
    else:
        projs = (m.q_proj, m.k_proj, m.v_proj)
        ws, bs = [p.weight for p in projs], [p.bias for p in projs]
    want = rmsnorm_linear(x, m.norm.weight, list(ws), EPS, rope=RoPE(pos, m.inv_freq), bias=list(bs))
    for got, w in zip((q, k, v), want):
        assert torch.equal(got.transpose(1, 2).reshape(w.shape), w)
    sum(t.float().pow(2).sum() for t in (q, k, v)).backward()
    for name, p in m.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert "bias=True" in repr(m)
    for bad in ({"qk_norm": True}, {"interleaved": True}):
        with pytest.raises(ValueError, match="bias=True: not with qk_norm or interleaved"):
            RMSNormQKVRoPE(d, hq, hkv, hd, bias=True, **bad)


def test_bias_argument_errors(device):
    """Bad ``bias=`` arguments are refused naming the argument: a count or a shape that
    does not match the weights, a dtype other than float32 or the weights', a sequence
    beside one weight, a bias with q/k norms or the interleaved rotation; None entries
    add nothing (the output equals the one with that bias zero)."""
    B, S, d, hq, hkv, hd = CASES[0]
    dt = torch.bfloat16 if device == "cuda" else torch.float32  # (the GPU serves no float32 GEMM)
    x = rand(B, S, d, dtype=dt, device=device)
    gamma = torch.rand(d, device=device) + 0.5
    ws = [rand(h * hd, d, dtype=dt, device=device, scale=d**-0.5) for h in (hq, hkv, hkv)]
    bs = [rand(w.shape[0], dtype=dt, device=device) for w in ws]
    pos = _positions(B, S, False, device)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
    rope = RoPE(pos, inv_freq)
    cases = [
        (bs[:2], ValueError, "bias has 2 entries for 3 weights"),
        ([bs[0], bs[1][:-8], bs[2]], ValueError, rf"bias\[1\] must have shape \({ws[1].shape[0]},\)"),
        ([bs[0], bs[1].long(), bs[2]], TypeError, r"bias\[1\]"),
        (bs[0], TypeError, "bias must be a sequence as long as weight's"),
    ]
    for bias, exc, match in cases:
        with pytest.raises(exc, match=match):
            rmsnorm_linear(x, gamma, ws, EPS, rope=rope, bias=bias)
    with pytest.raises(TypeError, match="bias must be one \\[N\\] tensor beside one weight"):
        rmsnorm_linear(x, gamma, ws[0], EPS, bias=bs)
    qk = RoPE(pos, inv_freq, qk_norm_weights=(gamma[:hd], gamma[:hd]))
    with pytest.raises(ValueError, match="not with q/k norms"):
        rmsnorm_linear(x, gamma, ws, EPS, rope=qk, bias=bs)
    with pytest.raises(ValueError, match="not with the interleaved-pairs RoPE"):
        rmsnorm_linear(x, gamma, ws, EPS, rope=RoPE(pos, inv_freq, interleaved=True), bias=bs)
    # one next weight: the research backwards and fold_gamma take no bias
    y, w_o = rand(B, S, d, dtype=dt, device=device), rand(d, d, dtype=dt, device=device)
    for kw in ({"fold_gamma": True}, {"backward": "folded"}):
        with pytest.raises(ValueError, match="bias takes the default backward"):
            residual_rmsnorm_linear_variant(y, w_o, x, gamma, ws[0], EPS, bias=bs[0], **kw)
    # the custom op itself refuses what its programs cannot add (its callers check first)
    flat = [t.reshape(-1, d) for t in (y, x)]
    with pytest.raises(ValueError, match="biases: only with next weights"):
        pairs = [pos.reshape(-1), inv_freq.repeat_interleave(2)]  # (interleaved pairs: rope_pairs=True)
        args = ("rowwise", False, [], False, pairs, 1.0, 2, 0.0, True, False, False, bs)
        torch.ops.codetta.residual_rmsnorm_linear(flat[0], w_o, flat[1], gamma, ws, EPS, *args)
    some = rmsnorm_linear(x, gamma, ws, EPS, rope=rope, bias=[bs[0], None, bs[2]])
    zero = rmsnorm_linear(x, gamma, ws, EPS, rope=rope, bias=[bs[0], torch.zeros_like(bs[1]), bs[2]])
    assert all(torch.equal(a, b) for a, b in zip(some, zero))


def test_module_errors():
    from codetta.nn import RMSNormQKVRoPE

    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        RMSNormQKVRoPE(64, 6, 4, 16)
    with pytest.raises(ValueError, match="head_dim must be even"):
        RMSNormQKVRoPE(64, 4, 4, 15)
    with pytest.raises(ValueError, match="num_heads must be a positive int"):
        RMSNormQKVRoPE(64, 0, 4, 16)
    with pytest.raises(ValueError, match="eps must be"):
        RMSNormQKVRoPE(64, 4, 4, 16, eps=-1.0)
    with pytest.raises(ValueError, match="inv_freq must have shape"):
        RMSNormQKVRoPE(64, 4, 4, 16, inv_freq=torch.ones(5))
    with pytest.raises(ValueError, match=r"\[batch, seq, hidden\]"):
        RMSNormQKVRoPE(64, 4, 4, 16)(torch.zeros(3, 64))
    with pytest.raises(ValueError, match="hidden 64 .this module's., got shape .2, 3, 40."):
        RMSNormQKVRoPE(64, 4, 4, 16)(torch.zeros(2, 3, 40))
    with pytest.raises(ValueError, match=r"head_dim must be one of \[16, 32, 64, 128, 256\]"):
        RMSNormQKVRoPE(64, 4, 4, 8)  # (at construction, not at the first forward)
    with pytest.raises(TypeError, match="must have x's dtype"):  # (named as the caller names it)
        RMSNormQKVRoPE(64, 4, 4, 16)(torch.zeros(2, 3, 64, dtype=torch.float16))
    # an empty batch or sequence: empty q, k, v of the right shapes
    m = RMSNormQKVRoPE(64, 4, 2, 16)
    for B, S in ((0, 5), (2, 0)):
        q, k, v = m(torch.randn(B, S, 64))
        assert q.shape == (B, 4, S, 16) and k.shape == v.shape == (B, 2, S, 16)


def test_rmsnorm_linear_errors_name_x():
    """``rmsnorm_linear`` names its own arguments (x, gamma, weight), not the general
    operator's (residual, y) it calls."""
    x, g, w = torch.randn(8, 32), torch.rand(32) + 0.5, torch.randn(16, 32)
    with pytest.raises(TypeError, match=r"weight \(torch.float32\) must have x's dtype \(torch.float16\)"):
        rmsnorm_linear(x.half(), g, w)
    with pytest.raises(TypeError, match="x must be bfloat16 or float16"):
        rmsnorm_linear(x.double(), g, w)
    with pytest.raises(ValueError, match=r"gamma \(32,\) and x \[..., 40\] disagree"):
        rmsnorm_linear(torch.randn(8, 40), g, w)


def test_module_compiles_fullgraph(device):
    """torch.compile(fullgraph=True) of the module (q/k norms, interleaved pairs) traces
    the custom ops and gives eager's output and gradients."""
    from codetta.nn import RMSNormQKVRoPE

    B, S, d, hq, hkv, hd = CASES[0]
    m = RMSNormQKVRoPE(d, hq, hkv, hd, qk_norm=True, interleaved=True, device=device, dtype=torch.float16)
    x = rand(B, S, d, dtype=torch.float16, device=device)
    pos = _positions(B, S, True, device)
    leaves = [x, m.norm.weight, m.q_proj.weight, m.k_proj.weight, m.v_proj.weight, m.q_norm.weight,
              m.k_norm.weight]  # fmt: skip

    def f(x, g, wq, wk, wv, qn, kn):
        rope = RoPE(pos, m.inv_freq, qk_norm_weights=(qn, kn), qk_norm_eps=1e-6, interleaved=True)
        q, k, v = rmsnorm_linear(x, g, [wq, wk, wv], 1e-6, rope=rope)
        return q.float().pow(2).sum() + k.float().sum() + v.float().sum()

    check_compile_matches_eager(f, [t.detach() for t in leaves], ON_GPU)


def test_qk_norm_eps_traced_as_a_symbolic_float(device):
    """Under torch.compile(dynamic=True) a float argument is traced as a symbolic float:
    the q/k norms' eps check compares it (math.isfinite broke the graph there, and a break
    between the drop-in's gate/up and down GEMMs failed Qwen3's every compiled step)."""
    B, S, d, hq, hkv, hd = CASES[0]
    x = rand(B, S, d, dtype=torch.float16, device=device)
    g = torch.rand(d, device=device) + 0.5
    ws = [rand(n * hd, d, dtype=torch.float16, device=device, scale=d**-0.5) for n in (hq, hkv, hkv)]
    qn, kn = torch.rand(hd, device=device) + 0.5, torch.rand(hd, device=device) + 0.5
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=device).float() / hd))
    pos = _positions(B, S, False, device)

    def f(x, qk_eps):
        rope = RoPE(pos, inv_freq, qk_norm_weights=(qn, kn), qk_norm_eps=qk_eps)
        return rmsnorm_linear(x, g, ws, 1e-6, rope=rope)

    torch._dynamo.reset()
    got = torch.compile(f, backend="eager", fullgraph=True, dynamic=True)(x, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, f(x, 1e-6)))
    torch._dynamo.reset()
    for bad in (math.nan, math.inf, -1e-6):
        with pytest.raises(ValueError, match="qk_norm_eps must be a finite number >= 0"):
            f(x, bad)


def test_module_fused_qkv(device):
    """``fused_qkv=True``: one [q + k + v rows, d] weight used as three row blocks in place
    gives the three-weight module's outputs bit for bit, and its gradient is theirs
    stacked (no copy of the parameter per step)."""
    from codetta.nn import RMSNormQKVRoPE

    B, S, d, hq, hkv, hd = CASES[0]
    kw = dict(qk_norm=True, device=device, dtype=torch.float16)
    three, fused = RMSNormQKVRoPE(d, hq, hkv, hd, **kw), RMSNormQKVRoPE(d, hq, hkv, hd, fused_qkv=True, **kw)
    assert "qkv_proj.weight" in fused.state_dict() and "q_proj.weight" not in fused.state_dict()
    with torch.no_grad():
        for name in ("norm.weight", "q_norm.weight", "k_norm.weight"):
            three.get_parameter(name).copy_(torch.rand_like(three.get_parameter(name)) + 0.5)
            fused.get_parameter(name).copy_(three.get_parameter(name))
        parts = [three.q_proj.weight, three.k_proj.weight, three.v_proj.weight]
        fused.qkv_proj.weight.copy_(torch.cat(parts))
    x = rand(B, S, d, dtype=torch.float16, device=device)
    outs = []
    for m in (three, fused):
        q, k, v = m(x)
        (q.float().sum() + 2 * k.float().sum() + 3 * v.float().sum()).backward()
        outs.append((q, k, v))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    stacked = torch.cat([three.q_proj.weight.grad, three.k_proj.weight.grad, three.v_proj.weight.grad])
    assert torch.equal(fused.qkv_proj.weight.grad, stacked)


@pytest.mark.skipif(not ON_GPU, reason="register spills are a GPU compile's")
def test_first_call_is_final():
    """A tail-split configuration whose kernel spills runs unsplit, decided before its
    first launch: the first call's output is bit-equal to every later one's (the
    interleaved program's 128x256 tail-split kernel spills; its first call ran split
    and differed by a rounding from the second, run 86 in NOTES.md)."""
    from codetta.kernels.engines import TRITON
    from codetta.programs import RMS_ROPE_PAIRS

    prog = RMS_ROPE_PAIRS[64]
    M, N, K = 1001, 2048, 2048  # every tile a tail tile; a shape no other test plans
    y = rand(M, K, dtype=torch.bfloat16, device="cuda")
    w = rand(N, K, dtype=torch.bfloat16, device="cuda", scale=K**-0.5)
    f32 = dict(device="cuda", dtype=torch.float32)
    pos = torch.randint(0, 4096, (M,), device="cuda")
    ops = {"sumsq": torch.rand(M, **f32) * K + 1, "inv_d": 1 / K, "eps": 1e-6, "scaling": 1.0, "pos": pos,
           "freq": torch.rand(N, **f32) * 0.1}  # fmt: skip
    split = [c for c in TRITON.candidates(prog) if c.tail_split > 1]
    for cfg in split:
        first = codetta.gemm(y, w, epilogue=prog, config=cfg, **ops)
        second = codetta.gemm(y, w, epilogue=prog, config=cfg, **ops)
        assert torch.equal(first, second), cfg.short()
    if not any(key[:2] == (prog, c) for key in TRITON._tail_spills for c in split):
        pytest.skip("no tail-split kernel of this program spills with this Triton")


@pytest.mark.parametrize("pairs", [False, True])
def test_unrotate_two_rows(pairs, device):
    """q's and k's inverse rotations in one launch give, bit for bit, what two launches
    give: heads of q (6) and k (2) with two heads per program (the heads per program come
    to a divisor of both counts), rows not a multiple of the row block, non-contiguous
    inputs; mismatched rows raise."""
    from codetta.programs.rope import unrotate_half_rows, unrotate_two_rows

    M, hd = 37, 16
    dt = torch.float16 if device == "cpu" else torch.bfloat16
    dq = rand(6 * hd, M, dtype=dt, device=device).t()  # (a transposed view: copied first)
    dk = rand(M, 2 * hd, dtype=dt, device=device)
    pos = torch.randint(0, 100, (M,), device=device)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, hd, 2, device=device).float() / hd)
    for launch in (None, (8, 4, 2), (16, 4, 4)):
        q1, k1 = unrotate_two_rows(dq, dk, pos, inv_freq, 0.9, pairs, launch=launch)
        assert torch.equal(q1, unrotate_half_rows(dq, pos, inv_freq, 0.9, pairs, launch=launch))
        assert torch.equal(k1, unrotate_half_rows(dk, pos, inv_freq, 0.9, pairs, launch=launch))
    # and against the rotation's transpose in float64 (PyTorch's same math in dt beside it)
    q1, k1 = unrotate_two_rows(dq, dk, pos, inv_freq, 0.9, pairs)
    angle = pos.float()[:, None, None] * inv_freq  # [M, 1, hd / 2], float32 as the forward's

    def transpose(g, c, s):  # d1 = g1 c + g2 s, d2 = g2 c - g1 s per head
        g = g.reshape(M, -1, hd)
        g1, g2 = (g[..., 0::2], g[..., 1::2]) if pairs else (g[..., : hd // 2], g[..., hd // 2 :])
        d1, d2 = g1 * c + g2 * s, g2 * c - g1 * s
        return (torch.stack((d1, d2), -1) if pairs else torch.cat((d1, d2), -1)).reshape(M, -1)

    for name, got, g in (("dq", q1, dq), ("dk", k1, dk)):
        ref = transpose(g.double(), angle.double().cos() * 0.9, angle.double().sin() * 0.9)
        same = transpose(g, (angle.cos() * 0.9).to(dt), (angle.sin() * 0.9).to(dt))
        assert_within(name, got, ref, same)
    with pytest.raises(ValueError, match="share rows"):
        unrotate_two_rows(dq, dk[:-1], pos, inv_freq, 0.9, pairs)


@pytest.mark.parametrize("pairs", [False, True])
def test_row_pass_launch_shapes(pairs, device):
    """The backward row passes give the same dz under any launch shape (each element's
    math is its own, a head's norm included: run 148 found every launch's dz bit-equal on
    the H200 too; scripts/row_passes.py times the shapes), and the q/k-norm weight
    gradient the same up to its partial sums' order."""
    from codetta.programs.rope import qknorm_backward_rows, unrotate_half_rows

    M, hd, heads = 37, 16, 6
    dt = torch.float16 if device == "cpu" else torch.bfloat16
    g, pre = (rand(M, heads * hd, dtype=dt, device=device) for _ in range(2))
    w = torch.rand(hd, device=device) + 0.5
    pos = torch.randint(0, 100, (M,), device=device)
    inv_freq = 1.0 / 10000 ** (torch.arange(0, hd, 2, device=device).float() / hd)
    base = unrotate_half_rows(g, pos, inv_freq, 0.9, pairs, launch=(8, 4, 1))
    dz, dw = qknorm_backward_rows(g, pre, w, pos, inv_freq, 0.9, 1e-6, pairs, launch=(8, 4, 1))
    # several heads per program share their rows' angles (3 brought to 1, 4 to 2: powers of 2 dividing 6)
    for launch in ((4, 2), (16, 8), (8, 4, 3), (16, 4, 4), (16, 4, 2, False)):
        assert torch.equal(unrotate_half_rows(g, pos, inv_freq, 0.9, pairs, launch=launch), base)
        dz2, dw2 = qknorm_backward_rows(g, pre, w, pos, inv_freq, 0.9, 1e-6, pairs, launch=launch)
        assert torch.equal(dz2, dz)
        torch.testing.assert_close(dw2, dw, rtol=1e-5, atol=1e-5)
    # the special-function unit's sines and cosines (a launch's 4th field, the default
    # launches' choice; on the CPU the interpreter's polynomials, so equal there): within
    # an ulp of the polynomials' on the GPU
    for launch in ((8, 4, 1, True), (16, 4, 2, True), None):
        un = unrotate_half_rows(g, pos, inv_freq, 0.9, pairs, launch=launch)
        torch.testing.assert_close(un, base, rtol=2**-7, atol=1e-5)
        dz2, dw2 = qknorm_backward_rows(g, pre, w, pos, inv_freq, 0.9, 1e-6, pairs, launch=launch)
        torch.testing.assert_close(dz2, dz, rtol=2**-7, atol=1e-5)
        torch.testing.assert_close(dw2, dw, rtol=1e-4, atol=1e-4)
