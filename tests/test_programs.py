"""Every shipped program and every operand kind, against fp64 references.

On a CPU the programs run through the Triton interpreter on the portable
mainloop; the ping-pong mainloop runs the very same body (``test_pingpong.py``
on an sm_90 GPU; compiled for sm_90a on any machine in ``test_sass.py``).
"""

import math

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from conftest import ON_GPU
from sincos_ptx import sincos_kernel
from util import SHAPES, assert_within, rand

import codetta
from codetta import programs as pg
from codetta import reference as ref
from codetta.kernels import configs, settings
from codetta.kernels import primitives as P
from codetta.kernels.engines import PINGPONG, TRITON


def _inputs(M, N, K, dtype, device):
    return rand(M, K, dtype=dtype, device=device), rand(N, K, dtype=dtype, device=device, scale=K**-0.5)


def _acc(y, w):
    return y.double() @ w.double().t(), (y @ w.t()).float()


def check_residual_rms(out, y, w, res, gamma, dtype):
    x64, h64, _ = ref.residual_rms_chain(y.double(), w.double(), res.double(), gamma.double())
    # PyTorch in the same dtype: the unfused chain, the norm statistics in fp32
    x_t = res + y @ w.t()
    assert_within("x", out.x, x64, x_t)
    assert_within("h", out.h, h64, (x_t.float() * gamma).to(dtype))
    # sumsq is the sum of squares of the stream as stored (out.x), summed in fp32
    assert out.sumsq.dtype == torch.float32 and out.sumsq.shape == (y.shape[0],)
    assert_within("sumsq", out.sumsq, out.x.double().pow(2).sum(-1), out.x.float().pow(2).sum(-1))


@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_residual_rms(M, N, K, dtype, device):
    """K1: seeding tile + tile stores + per-column vector + row sum."""
    y, w = _inputs(M, N, K, dtype, device)
    res = rand(M, N, dtype=dtype, device=device)
    gamma = rand(N, dtype=torch.float32, device=device)
    out = codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, residual=res, gamma=gamma)
    check_residual_rms(out, y, w, res, gamma, dtype)


@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_row_scale_and_rms_scale(M, N, K, dtype, device):
    """Per-row vectors and scalars: out = acc * scale[m];  out = acc * rsqrt(sumsq[m] / d + eps)."""
    y, w = _inputs(M, N, K, dtype, device)
    scale = torch.rand(M, device=device) + 0.5
    acc64, acc_t = _acc(y, w)
    out = codetta.gemm(y, w, epilogue=pg.ROW_SCALE, scale=scale)
    assert_within("row_scale", out, acc64 * scale.double()[:, None], (acc_t * scale[:, None]).to(dtype))
    sumsq = torch.rand(M, device=device) * 50
    out = codetta.gemm(y, w, epilogue=pg.RMS_SCALE, sumsq=sumsq, inv_d=1 / 40, eps=1e-5)
    r64 = (sumsq.double() / 40 + 1e-5).rsqrt()
    assert_within(
        "rms_scale", out, acc64 * r64[:, None], (acc_t * (sumsq / 40 + 1e-5).rsqrt()[:, None]).to(dtype)
    )


@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_mul_colsum(M, N, K, dtype, device):
    """Tile input + column sum over all rows."""
    y, w = _inputs(M, N, K, dtype, device)
    other = rand(M, N, dtype=dtype, device=device)
    out = codetta.gemm(y, w, epilogue=pg.MUL_COLSUM, other=other)
    acc64, acc_t = _acc(y, w)
    assert_within("out", out.out, acc64, y @ w.t())
    assert out.colsum.shape == (N,)
    assert_within("colsum", out.colsum, (acc64 * other.double()).sum(0), (acc_t * other.float()).sum(0))


@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_row_lse(M, N, K, dtype, device):
    """Running max / sum-exp over all N columns of each row."""
    y, w = _inputs(M, N, K, dtype, device)
    out = codetta.gemm(y, w, epilogue=pg.ROW_LSE, scale=3.0)
    acc64, acc_t = _acc(y, w)
    assert out.shape == (M,)
    assert_within("lse", out, torch.logsumexp(acc64 * 3.0, dim=1), torch.logsumexp(acc_t * 3.0, dim=1))


@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_rotate_pairs(M, N, K, dtype, device):
    """Pairwise transform of adjacent columns, with a per-row angle."""
    y, w = _inputs(M, N, K, dtype, device)
    angle = torch.rand(M, device=device, dtype=torch.float64) * 6.28
    cos, sin = angle.cos().float(), angle.sin().float()
    out = codetta.gemm(y, w, epilogue=pg.ROTATE_PAIRS, cos=cos, sin=sin)
    acc64, acc_t = _acc(y, w)
    want = ref.rotate_pairs(acc64, cos.double(), sin.double())
    assert_within("out", out, want, ref.rotate_pairs(acc_t, cos, sin).to(dtype))


# ---- operand kinds no shipped program uses yet, through small test programs


@triton.jit
def _pick_lse(acc, target):
    """What cross-entropy needs of a logits tile: the row's LSE and its target logit."""
    return acc, acc


PICK_LSE = codetta.Program(
    "test_pick_lse",
    _pick_lse,
    inputs=(codetta.PerRow("target", index=True),),
    outputs=(codetta.RowLogSumExp("lse"), codetta.RowPick("picked", index="target")),
    reference=lambda acc, target: {
        "lse": acc.logsumexp(1),
        "picked": torch.where(
            (target >= 0) & (target < acc.shape[1]),
            acc.gather(1, target.clamp(0, acc.shape[1] - 1).long()[:, None])[:, 0],
            torch.zeros((), dtype=acc.dtype),
        ),
    },
)


@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_row_pick_and_lse(M, N, K, dtype, device):
    """A gathered element per row (ignored indices give 0) next to a row LSE."""
    y, w = _inputs(M, N, K, dtype, device)
    target = torch.randint(0, N, (M,), device=device)
    target[::3] = -100  # ignore_index
    out = codetta.gemm(y, w, epilogue=PICK_LSE, target=target)
    acc64, acc_t = _acc(y, w)
    keep = target >= 0
    want = torch.where(keep, acc64.gather(1, target.clamp(min=0)[:, None])[:, 0], 0.0)
    same = torch.where(keep, acc_t.gather(1, target.clamp(min=0)[:, None])[:, 0], 0.0)
    assert_within("picked", out.picked, want, same)
    assert_within("lse", out.lse, acc64.logsumexp(1), acc_t.logsumexp(1))


def _picked(acc, target):
    return {"picked": PICK_LSE.reference(acc, target)["picked"]}


SPLIT_LSE = codetta.Program(
    "test_split_lse",
    _pick_lse,
    inputs=(codetta.PerRow("target", index=True),),
    outputs=(codetta.RowLogSumExp("lse", split=True), codetta.RowPick("picked", index="target")),
    reference=lambda acc, target: {"lse": acc.double().logsumexp(1), **_picked(acc, target)},
)


@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_split_row_lse(M, N, K, dtype, device):
    """``RowLogSumExp(split=True)``: [2, M], row 0 the log-sum-exp rounded (what the [M]
    form gives), row 1 the remainder (under half an ulp of row 0)."""
    y, w = _inputs(M, N, K, dtype, device)
    target = torch.randint(0, N, (M,), device=device)
    out = codetta.gemm(y, w, epilogue=SPLIT_LSE, target=target)
    plain = codetta.gemm(y, w, epilogue=PICK_LSE, target=target)
    assert out.lse.shape == (2, M) and out.lse.dtype == torch.float32
    hi, lo = out.lse.double()
    acc64, acc_t = _acc(y, w)
    assert_within("lse", hi + lo, acc64.logsumexp(1), acc_t.logsumexp(1))
    assert ((hi + lo).float() == hi.float()).all()
    ulp = 2.0**-23 * plain.lse.abs().max().item()
    torch.testing.assert_close(out.lse[0], plain.lse, rtol=0, atol=ulp)  # (the same up to the finish's order)


@triton.jit
def _offset(acc):
    """The product moved to ~1000 (one float32 ulp there: 6.1e-5), kept in float32."""
    v = acc + 1000.0
    return v, v


OFFSET_LSE = codetta.Program(
    "test_offset_lse",
    _offset,
    outputs=(codetta.Tile("values", dtype=torch.float32), codetta.RowLogSumExp("lse", split=True)),
    reference=lambda acc: {"values": acc + 1000.0, "lse": (acc.double() + 1000.0).logsumexp(1)},
)


@pytest.mark.parametrize("M,N,K", SHAPES, ids=str)
def test_split_row_lse_carries_what_hi_rounds_off(M, N, K, dtype, device):
    """hi + lo is the log-sum-exp of the values the kernel formed to the small log term's
    precision (a few 1e-7), not to hi's half ulp (3e-5 at ~1000): lo carries the rest."""
    y, w = _inputs(M, N, K, dtype, device)
    out = codetta.gemm(y, w, epilogue=OFFSET_LSE)
    hi, lo = out.lse.double()
    want = out.values.double().logsumexp(1)
    assert (hi + lo - want).abs().max().item() <= 8 * 2.0**-24 * max(1.0, math.log(N))
    assert (hi - want).abs().max().item() > 0  # (hi alone is off: the test can fail)


@triton.jit
def _table_scale(acc, pos, cos):
    """out = acc * cos_table[pos[m], n % W]."""
    return acc * cos


TABLE_SCALE = codetta.Program(
    "test_table_scale",
    _table_scale,
    inputs=(codetta.PerRow("pos", index=True), codetta.RowTable("cos", index="pos")),
    outputs=(codetta.Tile("out"),),
    reference=lambda acc, pos, cos: {
        "out": acc * cos.float()[pos.long()].repeat(1, acc.shape[1] // cos.shape[1])
    },
)


@pytest.mark.parametrize("W", [8, 16])
def test_row_table(W, dtype, device):
    """A per-row table read by position: row m, column n reads table[pos[m], n % W]."""
    M, N, K = 77, 96, 40
    y, w = _inputs(M, N, K, dtype, device)
    table = torch.randn(300, W, device=device)
    pos = torch.randint(0, 300, (M,), device=device, dtype=torch.int32)
    out = codetta.gemm(y, w, epilogue=TABLE_SCALE, pos=pos, cos=table)
    acc64, acc_t = _acc(y, w)
    full = table[pos.long()].repeat(1, N // W)
    assert_within("out", out, acc64 * full.double(), (acc_t * full).to(dtype))
    with pytest.raises(ValueError, match="width W divides N"):
        codetta.gemm(y, w, epilogue=TABLE_SCALE, pos=pos, cos=torch.randn(300, 7, device=device))


@triton.jit
def _swiglu_pairs(acc):
    """Adjacent columns (gate, up) -> y = silu(gate) * up, half as many columns."""
    g, u = P.even_odd(acc)
    return P.silu(g) * u


SWIGLU_PAIRS = codetta.Program(
    "test_swiglu_pairs",
    _swiglu_pairs,
    outputs=(codetta.HalfTile("y"),),
    reference=lambda acc: {"y": F.silu(acc[:, 0::2]) * acc[:, 1::2]},
)


@pytest.mark.parametrize("M,N,K", [s for s in SHAPES if s[1] % 16 == 0], ids=str)
def test_half_tile(M, N, K, dtype, device):
    """A half-width output: [M, N] accumulator -> [M, N/2] result."""
    y, w = _inputs(M, N, K, dtype, device)
    out = codetta.gemm(y, w, epilogue=SWIGLU_PAIRS)
    acc64, acc_t = _acc(y, w)
    assert out.shape == (M, N // 2)
    assert_within(
        "y", out, F.silu(acc64[:, 0::2]) * acc64[:, 1::2], (F.silu(acc_t[:, 0::2]) * acc_t[:, 1::2]).to(dtype)
    )


@triton.jit
def _activations(acc):
    """gelu = gelu_tanh(acc); silu = silu(acc); rowsum[m] = sum_n acc."""
    return P.gelu_tanh(acc), P.silu(acc), acc


ACTIVATIONS = codetta.Program(
    "test_activations",
    _activations,
    outputs=(codetta.Tile("gelu"), codetta.Tile("silu"), codetta.RowSum("rowsum")),
    reference=lambda acc: {
        "gelu": F.gelu(acc, approximate="tanh"),
        "silu": F.silu(acc),
        "rowsum": acc.sum(1),
    },
)


def test_activation_helpers(dtype, device):
    M, N, K = SHAPES[1]
    y, w = _inputs(M, N, K, dtype, device)
    out = codetta.gemm(y, w, epilogue=ACTIVATIONS)
    acc64, acc_t = _acc(y, w)
    assert_within(
        "gelu", out.gelu, F.gelu(acc64, approximate="tanh"), F.gelu(acc_t, approximate="tanh").to(dtype)
    )
    assert_within("silu", out.silu, F.silu(acc64), F.silu(acc_t).to(dtype))
    assert_within("rowsum", out.rowsum, acc64.sum(1), acc_t.sum(1))


@pytest.mark.parametrize("approx", [False, True], ids=["polynomial", "approx"])
def test_sincos(approx, device):
    """RoPE's angles (positions below 2^17 times Llama's and Qwen's frequencies, formed in
    float32 as the epilogue forms them): both sin/cos helpers within 2e-6 of float64's
    sin and cos of the same float32 angle. ``sincos_approx`` runs PTX's sin/cos.approx on
    the GPU; in the interpreter it is ``sincos`` (so on the CPU both cases check that)."""
    g = torch.Generator().manual_seed(0)
    pos = torch.cat([torch.arange(4096), torch.randint(4096, 2**17, (4096,), generator=g)])
    _check_sincos(pos, (1e4, 5e5, 1e6), approx, device)


def _check_sincos(pos, thetas, approx, device):
    """Both helpers' sin and cos of RoPE's float32 angles (``pos`` times head dim 128's
    frequencies for each theta) within 2e-6 of float64's of the same angles."""
    freq = torch.cat([1.0 / theta ** (torch.arange(0, 128, 2).float() / 128) for theta in thetas])
    x = (pos.float()[:, None] * freq[None, :]).reshape(-1).to(device)
    n = x.numel()
    out = torch.full((2 * n,), float("nan"), device=device)
    sincos_kernel[(triton.cdiv(n, 1024),)](x, out, n, APPROX=approx, BLOCK=1024)
    xd = x.double()
    assert (out[:n].double() - xd.sin()).abs().max().item() < 2e-6
    assert (out[n:].double() - xd.cos()).abs().max().item() < 2e-6


@pytest.mark.skipif(not ON_GPU, reason="the GPU's fused multiply-adds (numpy rounds each product)")
@pytest.mark.parametrize("approx", [False, True], ids=["polynomial", "approx"])
def test_sincos_long_positions(approx, device):
    """Positions 2^17 to 2^22 (Qwen2.5-1M's context and past it; angles to ~4M radians): on
    the GPU both reductions stay exact, as each ``x - j * C`` compiles to one fused
    multiply-add (the product unrounded), so both helpers are within 2e-6 of float64's sin
    and cos of the same float32 angle. The interpreter rounds each product: there the
    first constant's product is exact only while j * 201 < 2^24 (``P.sincos``: x below
    ~131k radians), so this range is the GPU's only (docs/huggingface.md's numeric limit, NOTES.md)."""
    g = torch.Generator().manual_seed(1)
    _check_sincos(torch.randint(2**17, 2**22, (8192,), generator=g), (1e4, 1e6), approx, device)


# ---- the contract: one body, checked here, run by both mainloops


def test_source_key_follows_the_code():
    """A program's tuning key hashes its body's code: docstrings, comments and layout left
    out (a documentation edit keeps the shipped entries), any change of the code kept."""
    from codetta.kernels.program import _code_of

    base = '@triton.jit\ndef body(acc, s):\n    """Scale."""\n    return acc * s  # by s\n'
    same = '@triton.jit\ndef body(acc, s):\n    """Scale the tile."""\n    # by s\n    return (acc*s)\n'
    other = '@triton.jit\ndef body(acc, s):\n    """Scale."""\n    return acc * s + 1.0\n'
    nested = "    " + base.replace("\n", "\n    ")  # a method's indentation
    assert _code_of(base) == _code_of(same) == _code_of(nested) != _code_of(other)


def test_source_key_follows_the_store_order():
    """The ping-pong store order (``stores_first``) is in the key: entries tuned under one
    order are not taken under the other (its configs time, and spill, otherwise)."""
    import dataclasses

    flipped = dataclasses.replace(pg.CE_LOGITS_SCALED, stores_first=False)
    assert flipped.source_key != pg.CE_LOGITS_SCALED.source_key
    assert dataclasses.replace(flipped, stores_first=True).source_key == pg.CE_LOGITS_SCALED.source_key


@triton.jit
def _body_through_module(acc, elem):
    return P.rounded(acc, elem) * 2.0


@triton.jit
def _rounded_otherwise(acc, elem):
    return acc.to(elem.dtype).to(tl.float32)


def test_source_key_follows_helpers_reached_through_a_module(monkeypatch):
    """A helper a body reaches through one of codetta's modules (``P.rounded``) is part of
    its key: an edit of the helper re-keys every program that uses it (run 216's fp16 fix
    to ``rounded`` left the old keys on changed code until they were re-keyed by hand)."""
    from codetta.kernels.program import _source_hash

    before = _source_hash(_body_through_module)
    assert _source_hash(_body_through_module) == before
    monkeypatch.setattr(P, "rounded", _rounded_otherwise)
    assert _source_hash(_body_through_module) != before


def test_both_mainloops_run_the_body():
    """The ping-pong mainloop gets the program's own body (no twin), as the portable one does."""
    for name in pg.__all__:
        prog = getattr(pg, name)
        kinds = prog.in_kinds
        assert (
            TRITON.constexprs(prog, kinds, configs.INTERPRETER_CONFIG, torch.float16, 0, 0, 3)["BODY"]
            is prog.body
        )
        for cfg in PINGPONG.candidates(prog):
            consts = PINGPONG.constexprs(prog, kinds, cfg, torch.bfloat16, 0, 0)
            assert consts["BODY"] is prog.body
            # (the store order reaches the kernel: CE_LOGITS_SCALED's e1 spills without it)
            assert consts["STORES_FIRST"] is prog.stores_first
    # (and the programs that store first are the two row-scaled logits ones)
    first = {getattr(pg, n).name for n in pg.__all__ if getattr(pg, n).stores_first}
    assert first == {"ce_logits_scaled", "ce_probs_scaled"}


@triton.jit
def _residual_rms_off_by_one_percent(acc, gamma, elem):
    x = acc.to(elem.dtype).to(tl.float32)
    return x, x * gamma * 1.01, x * x


def test_wrong_body_fails(device):
    """A body that writes h x 1.01 (the defect once seen in a hand-written twin) fails
    the same check the shipped body passes; both mainloops run what this checks."""
    import dataclasses

    bad = dataclasses.replace(pg.RESIDUAL_RMS, name="bad_residual_rms", body=_residual_rms_off_by_one_percent)
    M, N, K = SHAPES[2]
    y, w = _inputs(M, N, K, torch.float16, device)
    res, gamma = rand(M, N, dtype=torch.float16, device=device), torch.rand(N, device=device) + 0.5
    out = codetta.gemm(y, w, epilogue=bad, residual=res, gamma=gamma)
    with pytest.raises(AssertionError, match="h: error"):
        check_residual_rms(out, y, w, res, gamma, torch.float16)


def test_programs_deterministic(device):
    M, N, K = SHAPES[-1]
    y, w = _inputs(M, N, K, torch.float16, device)
    res = rand(M, N, dtype=torch.float16, device=device)
    gamma = rand(N, dtype=torch.float32, device=device)
    a = codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, residual=res, gamma=gamma)
    b = codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, residual=res, gamma=gamma)
    for name in a._fields:
        assert torch.equal(getattr(a, name), getattr(b, name)), name


def test_reductions_do_not_depend_on_the_config(device):
    """Row and column reductions come back finished, [M] and [N], whatever the tiles."""
    M, N, K = SHAPES[2]
    y, w = _inputs(M, N, K, torch.float16, device)
    other = rand(M, N, dtype=torch.float16, device=device)
    cfgs = (
        [
            configs.INTERPRETER_CONFIG,
            configs.Config(16, 64, 16, 1, 4, 1, 4),
            configs.Config(64, 32, 64, 4, 1, 1, 4),
        ]
        if device == "cpu"
        else TRITON.candidates(pg.MUL_COLSUM)[:3]
    )
    outs = [codetta.gemm(y, w, epilogue=pg.MUL_COLSUM, other=other, config=c) for c in cfgs]
    for o in outs:
        assert o.colsum.shape == (N,)
        torch.testing.assert_close(o.colsum, outs[0].colsum, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize(
    "operands,exc,match",
    [
        ({"gamma": "g"}, TypeError, "needs operand"),
        ({"residual": "r", "gamma": "g"}, TypeError, "'residual' must be a torch.Tensor"),
        ({"residual": "short", "gamma": "g"}, ValueError, "'residual' must have shape"),
        ({"residual": "ok", "gamma": "long"}, ValueError, "'gamma' must have shape"),
        ({"residual": "strided", "gamma": "g"}, ValueError, "'residual' must be row-contiguous"),
        ({"residual": "ok", "gamma": "g64"}, TypeError, "'gamma' must be float32, bfloat16, float16"),
        ({"residual": "ok", "gamma": "gint"}, TypeError, "'gamma' must be float32, bfloat16, float16"),
        ({"residual": "ok", "gamma": "g", "elem": "g"}, TypeError, "takes no operand"),
    ],
)
def test_bad_operands(operands, exc, match, device):
    M, N, K = 16, 32, 64
    y, w = _inputs(M, N, K, torch.float16, device)
    vals = {
        "g": torch.ones(N, device=device),
        "g64": torch.ones(N, device=device, dtype=torch.float64),
        "gint": torch.ones(N, device=device, dtype=torch.int64),
        "long": torch.ones(N + 1, device=device),
        "ok": rand(M, N, dtype=torch.float16, device=device),
        "short": rand(M - 1, N, dtype=torch.float16, device=device),
        "strided": rand(M, 2 * N, dtype=torch.float16, device=device)[:, ::2],
        "r": 1.0,
    }
    kwargs = {k: vals[v] for k, v in operands.items()}
    with pytest.raises(exc, match=match):
        codetta.gemm(y, w, epilogue=pg.RESIDUAL_RMS, **kwargs)


def test_scalar_operand_type(device):
    y, w = _inputs(8, 32, 64, torch.float16, device)
    with pytest.raises(TypeError, match="'scale' must be a Python float"):
        codetta.gemm(y, w, epilogue=pg.ROW_LSE, scale=torch.tensor(1.0))


def test_rotate_pairs_odd_n(device):
    y, w = _inputs(8, 24, 64, torch.float16, device)
    cs = torch.ones(8, device=device)
    with pytest.raises(ValueError, match="N must be even"):
        codetta.gemm(y, w[:23], epilogue=pg.ROTATE_PAIRS, cos=cs, sin=cs)


def _program_operands(name, M, N, device, K=64):
    dtype = torch.float16
    f32 = dict(device=device, dtype=torch.float32)
    norm = {"sumsq": torch.rand(M, **f32) * K + 1, "inv_d": 1.0 / K, "eps": 1e-6}
    rope = {**norm, "pos": torch.randint(0, 4096, (M,), device=device), "freq": torch.rand(N, **f32),
            "scaling": 0.9}  # fmt: skip

    def parts(n):  # K parts: [M, K_i] and [N, K_i] pairs of their own K
        ks = (24, 40, 16)[:n]
        return {k: v for i, kk in enumerate(ks, 1) for k, v in (
            (f"a{i}", rand(M, kk, dtype=dtype, device=device)),
            (f"w{i}", rand(N, kk, dtype=dtype, device=device, scale=kk**-0.5)))}  # fmt: skip

    wide = {**rope, "freq": torch.rand(3 * N, **f32)}  # q, k, v side by side: 3 N columns
    qkv = {"w1": rand(N, K, dtype=dtype, device=device, scale=K**-0.5),
           "w2": rand(N, K, dtype=dtype, device=device, scale=K**-0.5)}  # fmt: skip
    rows1 = 128 if device == "cuda" else 32  # (boundaries on the tiles' edges: 128 rows on the GPU)
    stacked = {"a1": rand(rows1, K, dtype=dtype, device=device),
               "a2": rand(40, K, dtype=dtype, device=device)}  # fmt: skip
    return {
        "store_m3": stacked,
        "rms_rope_64_n3": {**wide, **qkv},
        "rms_rope_128_n3": {**wide, **qkv},
        "store_k2": parts(1),
        "store_k3": parts(2),
        "store_k4": parts(3),
        "swiglu": {"up": rand(N, K, dtype=dtype, device=device, scale=K**-0.5)},
        "swiglu_rms": {
            "up": rand(N, K, dtype=dtype, device=device, scale=K**-0.5),
            "sumsq": torch.rand(M, **f32) * K + 1,
            "inv_d": 1.0 / K,
            "eps": 1e-6,
        },  # fmt: skip
        "dswiglu": {"g": rand(M, N, dtype=dtype, device=device), "u": rand(M, N, dtype=dtype, device=device)},
        "dswiglu_y": {
            "g": rand(M, N, dtype=dtype, device=device),
            "u": rand(M, N, dtype=dtype, device=device),
        },
        "rms_rope_64": rope,
        "rms_rope_128": rope,
        "rms_rope_bias_64": {**rope, "bias": rand(N, dtype=dtype, device=device)},
        "rms_rope_bias_128": {**rope, "bias": rand(N, **f32)},
        "rms_qknorm_rope_128": {**rope, "qk_w": torch.rand(N, **f32) + 0.5, "qk_eps": 1e-6},
        "rms_rope_pairs_128": rope,
        "rms_rope_pairs_64": rope,
        "rms_qknorm_rope_pairs_64": {**rope, "qk_w": torch.rand(N, **f32) + 0.5, "qk_eps": 1e-6},
        "rms_qknorm_rope_pairs_128": {**rope, "qk_w": torch.rand(N, **f32) + 0.5, "qk_eps": 1e-6},
        "store": {},
        "store_f32": {},
        "accumulate": {"c": rand(M, N, dtype=dtype, device=device)},
        "accumulate_f32": {"c": rand(M, N, dtype=torch.float32, device=device)},
        "finish_f32": {"c": rand(M, N, dtype=torch.float32, device=device)},
        "row_scale": {"scale": torch.rand(M, **f32) + 0.5},
        "rms_scale": {"sumsq": torch.rand(M, **f32) * 9, "inv_d": 1.0 / N, "eps": 1e-6},
        "rms_scale_bias": {
            "sumsq": torch.rand(M, **f32) * 9,
            "inv_d": 1.0 / N,
            "eps": 1e-6,
            "bias": rand(N, dtype=dtype, device=device),
        },  # fmt: skip
        "mul_colsum": {"other": rand(M, N, dtype=dtype, device=device)},
        "residual_rms": {"residual": rand(M, N, dtype=dtype, device=device), "gamma": torch.rand(N, **f32)},
        "residual_rms_f32": {"residual": rand(M, N, **f32), "gamma": torch.rand(N, **f32)},
        "residual_sumsq": {"residual": rand(M, N, dtype=dtype, device=device)},
        "gamma_weight_grad": {"gamma": torch.rand(N, **f32), "w": rand(M, N, dtype=dtype, device=device)},
        "rms_backward": {
            "x": rand(M, N, dtype=dtype, device=device),
            "dres": rand(M, N, dtype=dtype, device=device),
            "sumsq": torch.rand(M, **f32) * N + 1,
            "zeta": torch.randn(M, **f32),
            "gamma": torch.rand(N, **f32),
            "inv_d": 1.0 / N,
            "eps": 1e-6,
        },
        "rms_grad_partials": {
            "x": rand(M, N, dtype=dtype, device=device),
            "sumsq": torch.rand(M, **f32) * N + 1,
            "gamma": torch.rand(N, **f32),
            "inv_d": 1.0 / N,
            "eps": 1e-6,
        },
        "row_lse": {"scale": 2.0},
        "ce_logits": {},
        "ce_logits_scaled": {"scale": torch.rand(M, **f32) + 0.5},
        "ce_logits_ext": {
            "bias": rand(N, dtype=dtype, device=device),
            "softcap": 3.0,
        },  # fmt: skip
        "rotate_pairs": {"cos": torch.rand(M, **f32), "sin": torch.rand(M, **f32)},
        "ce_probs": {"ref": torch.rand(M, **f32) * 4},  # (products of K 64: |l| up to ~10)
        "ce_probs_scaled": {"scale": torch.rand(M, **f32) + 0.5, "ref": torch.rand(M, **f32) * 4},
        "ce_probs_dx": {
            "s": torch.rand(M, **f32) + 0.5,
            "g": torch.randn(M, **f32),
            "wt": rand(M, N, dtype=dtype, device=device),
        },
        "ce_probs_dw": {  # (every third row without a slot: zeros added)
            "slot": torch.where(
                torch.arange(M, device=device) % 3 == 0, -1, torch.randint(0, 5, (M,), device=device)
            ).to(torch.int32),
            "corr": torch.randn(5, N, **f32),
        },  # fmt: skip
    }[name]


@pytest.mark.parametrize("name", [getattr(pg, n).name for n in pg.__all__])
def test_reference_path_matches_kernel(name, device):
    """Each program's PyTorch reference (the CPU path without the interpreter)
    computes what its kernel computes."""
    prog = next(getattr(pg, n) for n in pg.__all__ if getattr(pg, n).name == name)
    M, N, K = 77, 128 if prog.sub_tile_width else 96, 64  # RoPE: whole heads of 64 or 128
    if prog.m_parts:
        M = 128 if device == "cuda" else 64  # (the first A's rows end on a tile edge: 128 on the GPU)
    y, w = _inputs(M, N, K, torch.float16, device)
    ops = _program_operands(name, M, N, device, K)
    kernel = codetta.gemm(y, w, epilogue=prog, **ops)
    cpu_ops = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in ops.items()}
    with settings.override(force_reference=True):
        reference = codetta.gemm(y.cpu(), w.cpu(), epilogue=prog, **cpu_ops)
    kernel = kernel if isinstance(kernel, tuple) else (kernel,)
    reference = reference if isinstance(reference, tuple) else (reference,)
    for out_k, out_r in zip(kernel, reference):
        assert out_k.shape == out_r.shape and out_k.dtype == out_r.dtype
        tol = 2e-3 if out_k.dtype == torch.float16 else 1e-4
        torch.testing.assert_close(
            out_k.cpu().float(), out_r.float(), rtol=tol, atol=tol * out_r.abs().max().item()
        )


def test_program_without_reference_on_cpu():
    """A program with no PyTorch reference says so on the CPU path instead of crashing."""
    bare = codetta.Program("bare_store", pg.STORE.body, outputs=pg.STORE.outputs)
    y, w = _inputs(8, 32, 64, torch.float16, "cpu")
    with (
        settings.override(force_reference=True),
        pytest.raises(NotImplementedError, match="no PyTorch reference"),
    ):
        codetta.gemm(y, w, epilogue=bare)


def test_reference_with_a_wrong_key():
    """A reference that forgets an output names the program and the key."""
    bad = codetta.Program(
        "bad_ref", pg.STORE.body, outputs=pg.STORE.outputs, reference=lambda acc: {"y": acc}
    )
    y, w = _inputs(8, 32, 64, torch.float16, "cpu")
    with settings.override(force_reference=True), pytest.raises(KeyError, match="'bad_ref'.*no 'out'"):
        codetta.gemm(y, w, epilogue=bad)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"name": "has space"}, "identifier"),
        ({"outputs": ()}, "no outputs"),
        ({"inputs": (codetta.RowSum("x"),)}, "cannot be ROW_SUM"),
        ({"inputs": (codetta.Tile("a", seeds_acc=True), codetta.Tile("b", seeds_acc=True))}, "at most one"),
        ({"outputs": (codetta.RowPick("p", index="t"),)}, "not a PerRow"),
        ({"outputs": (codetta.Tile("out"), codetta.Tile("out"))}, "repeat"),
        ({"pingpong_regs": 244}, "multiple of 8"),
        ({"pingpong_regs": 264}, "multiple of 8"),
    ],
)
def test_bad_program_declarations(kwargs, match):
    base = {"name": "p", "body": pg.STORE.body, "outputs": pg.STORE.outputs}
    with pytest.raises(ValueError, match=match):
        codetta.Program(**{**base, **kwargs})


def test_every_program_has_a_portable_configuration():
    """Every program codetta defines (each head dim of the RoPE families included) has a
    configuration of the portable mainloop, and a program with a sub-tile width (RoPE's:
    one head) only ones whose sub-tiles are that wide. The interleaved pairs at head dim 16
    had none, and their calls raised IndexError on a GPU (the interpreter runs its own
    configuration, so no CPU call could show it; found by scripts/fuzz on the H200)."""
    import importlib
    import pkgutil

    import codetta.programs as programs
    from codetta.kernels.engines import TRITON
    from codetta.kernels.program import Program

    found = {}
    for info in pkgutil.iter_modules(programs.__path__):
        if info.name == "sm90_check":
            continue
        for value in vars(importlib.import_module(f"codetta.programs.{info.name}")).values():
            for p in value.values() if isinstance(value, dict) else (value,):
                if isinstance(p, Program):
                    found[p.name] = p
    assert len(found) >= 40 and "rms_rope_pairs_16" in found, sorted(found)
    for name, program in found.items():
        cands = TRITON.candidates(program)
        assert cands, name
        if program.sub_tile_width:
            assert all(c.block_n // c.epi_split == program.sub_tile_width for c in cands), name


@triton.jit
def _tanh_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, P.tanh(tl.load(x_ptr + offs, mask=mask)), mask=mask)


def test_tanh_within_a_few_ulp(device):
    """``P.tanh`` (soft-capped logits, GELU's tanh form) against float64: within 4 float32
    ulp over [-20, 20], densest near 0 and around the branch at |x| 0.625; +-1 at +-inf,
    NaN at NaN, saturated (no overflow) far out. (2 sigmoid(2x) - 1, the form before, was
    ~1e7 ulp off near 0.)"""
    x = torch.cat([torch.linspace(-20, 20, 4001), torch.logspace(-8, 0.5, 400), -torch.logspace(-8, 0.5, 400),
                   0.625 + torch.linspace(-1e-3, 1e-3, 201), torch.tensor([0.0, 1e4, -1e4])])  # fmt: skip
    x = x.to(device)
    out = torch.empty_like(x)
    _tanh_kernel[(1,)](x, out, x.numel(), BLOCK=triton.next_power_of_2(x.numel()))
    want = torch.tanh(x.double())
    ulp = torch.finfo(torch.float32).eps * want.abs().float().clamp_min(torch.finfo(torch.float32).tiny)
    assert ((out.double() - want).abs() <= 4 * ulp.double()).all()
    edge = torch.tensor([float("inf"), -float("inf"), float("nan")], device=device)
    got = torch.empty_like(edge)
    _tanh_kernel[(1,)](edge, got, 3, BLOCK=4)
    assert got[0].item() == 1.0 and got[1].item() == -1.0 and got[2].isnan().item()
