"""RoPE in GEMM epilogues: rotation of adjacent column pairs, and Hugging Face's
rotate-half convention (or the interleaved-pairs one) on whole heads after an RMSNorm
(q and k projections)."""

import math

import torch
import triton
import triton.language as tl  # noqa: F401 - the JIT needs tl in scope

from .. import reference as ref
from ..kernels import device, precompile
from ..kernels import primitives as P
from ..kernels.configs import PINGPONG_64_ROW_CANDIDATES, PINGPONG_CANDIDATES, config_grid
from ..kernels.program import PerCol, PerRow, Program, Scalar, Tile, with_n_parts
from .norm import rms_scale_of
from .norm_rows import torch_path


@triton.jit
def rotate_pairs(acc, cos, sin):
    """For each column pair (a, b) = (acc[:, 2i], acc[:, 2i+1]) of row m, with c = cos[m], s = sin[m]:
    out[:, 2i] = a c - b s,  out[:, 2i+1] = b c + a s."""
    # scale before splitting: per-row factors then share the halves' register layout
    # (the ping-pong mainloop does not convert layouts behind a body's back)
    ac, bc = P.even_odd(acc * cos)
    a_s, b_s = P.even_odd(acc * sin)
    return P.interleave(ac - b_s, bc + a_s)


def _check_even(M, N):
    if N % 2:
        raise ValueError(f"rotate_pairs pairs adjacent columns: N must be even, got N={N}")


ROTATE_PAIRS = Program(
    "rotate_pairs",
    rotate_pairs,
    inputs=(PerRow("cos"), PerRow("sin")),
    outputs=(Tile("out"),),
    reference=lambda acc, cos, sin: {"out": ref.rotate_pairs(acc, cos.to(acc.dtype), sin.to(acc.dtype))},
    check=_check_even,
)


# ---- RoPE in Hugging Face's rotate-half convention, one attention head per sub-tile
# (the programs set sub_tile_width = head_dim, so a body sees exactly one head: its
# width is the head dim, and one body serves every head dim)


# _rotate's sines and cosines come from the special-function unit (P.sincos_approx): at
# the 700 W cap the polynomials' ~40 instructions an angle cost the q projection's GEMM
# 6.5 % of its time against cuBLAS's, the unit's 0.8 % (runs 156 and 159, NOTES.md).
@triton.jit
def _rotate(x1, x2, pos, freq, scaling):
    """RoPE of one head given its halves: a = position[m] * inv_freq (the column's
    frequency, the same in both halves); (x1 cos a - x2 sin a, x2 cos a + x1 sin a), cos
    and sin times ``scaling``. The angles are formed at full width in the accumulator's
    layout, then halved (Gluon takes no other way)."""
    a1, a2 = P.halves(pos.to(tl.float32) * freq)
    sin, cos = P.sincos_approx(a1)
    c = cos * scaling
    s = sin * scaling
    return P.whole(x1 * c - x2 * s, x2 * c + x1 * s)


@triton.jit
def rms_rope(acc, sumsq, inv_d, eps, pos, freq, scaling):
    """q or k of one head: the norm's row scale r = rsqrt(sumsq / d + eps), then RoPE."""
    x1, x2 = P.halves(acc * rms_scale_of(sumsq, inv_d, eps))
    return _rotate(x1, x2, pos, freq, scaling)


@triton.jit
def rms_rope_bias(acc, sumsq, inv_d, eps, pos, freq, scaling, bias):
    """``rms_rope`` with the projection's bias added before the rotation (Qwen2's q and
    k): RoPE of acc * r + bias."""
    x1, x2 = P.halves(acc * rms_scale_of(sumsq, inv_d, eps) + bias)
    return _rotate(x1, x2, pos, freq, scaling)


@triton.jit
def rms_qknorm_rope(acc, sumsq, inv_d, eps, pos, freq, scaling, qk_w, qk_eps):
    """As ``rms_rope`` with Qwen3's per-head RMSNorm between the two (weight ``qk_w``,
    the [head_dim] weight repeated per head): z = acc * r; z * rsqrt(mean of the head's
    z^2 + qk_eps) * qk_w; then RoPE. Also returns z (``pre``), the backward's input."""
    z = acc * rms_scale_of(sumsq, inv_d, eps)
    W: tl.constexpr = acc.shape[1]
    # the sub-tile is one head: its row sums are the heads' (at full width, the
    # accumulator's layout throughout, as Gluon needs)
    rho = tl.rsqrt(tl.sum(z * z, axis=1) * (1.0 / W) + qk_eps)[:, None]
    n1, n2 = P.halves(z * rho * qk_w)
    return _rotate(n1, n2, pos, freq, scaling), z


@triton.jit
def _rotate_pairs_of(x, pos, freq, scaling):
    """RoPE of one head in the interleaved-pairs convention (GPT-J, Meta's original Llama
    code): columns (2i, 2i+1) rotate by position[m] * inv_freq[i] (``freq`` holds each
    pair's frequency twice). The angles' sines and cosines at full width (from the
    special-function unit, as ``_rotate``'s), then the products split (``_rotate``'s
    form, its angles split before sincos, spilled for sm_90a on the portable mainloop
    here: 56-104 B)."""
    sin, cos = P.sincos_approx(pos.to(tl.float32) * freq)
    xc1, xc2 = P.even_odd(x * (cos * scaling))
    xs1, xs2 = P.even_odd(x * (sin * scaling))
    return P.interleave(xc1 - xs2, xc2 + xs1)


@triton.jit
def _rotate_pairs_swapped(x, pos, freq, scaling):
    """``_rotate_pairs_of``'s rotation with one split: x cos plus x sin with its pairs
    swapped and signed, at full width. For sm_90a on the portable mainloop it
    holds 217-240 registers at head dim 64 (128x128 and 64x128 tiles) and spills nothing
    where ``_rotate_pairs_of`` spilled 64-96 B (NOTES.md). The Gluon
    mainloop cannot run it (the split's layout meets x's wgmma layout in one sum), so the
    programs with ping-pong candidates (head dim 128) keep ``_rotate_pairs_of``. The
    angles from the special-function unit, as ``_rotate``'s."""
    sin, cos = P.sincos_approx(pos.to(tl.float32) * freq)
    BM: tl.constexpr = x.shape[0]
    W: tl.constexpr = x.shape[1]
    # (a s_a, b s_b) -> (-b s_b, a s_a): each product with its own column's sine, as
    # ``_rotate_pairs_of`` (and the reference) forms it
    even, odd = tl.split(tl.reshape(x * (sin * scaling), (BM, W // 2, 2)))
    return x * (cos * scaling) + tl.reshape(tl.join(-odd, even), (BM, W))


@triton.jit
def rms_rope_pairs_portable(acc, sumsq, inv_d, eps, pos, freq, scaling):
    """``rms_rope_pairs`` for the portable mainloop only (``_rotate_pairs_swapped``)."""
    return _rotate_pairs_swapped(acc * rms_scale_of(sumsq, inv_d, eps), pos, freq, scaling)


@triton.jit
def _head_normed(acc, sumsq, inv_d, eps, qk_w, qk_eps):
    """(the layer norm's row scale, then the head's RMSNorm times qk_w; z, the norm's
    input, which the backward needs): a sub-tile is one head."""
    z = acc * rms_scale_of(sumsq, inv_d, eps)
    W: tl.constexpr = acc.shape[1]
    rho = tl.rsqrt(tl.sum(z * z, axis=1) * (1.0 / W) + qk_eps)[:, None]
    return z * rho * qk_w, z


@triton.jit
def rms_qknorm_rope_pairs_portable(acc, sumsq, inv_d, eps, pos, freq, scaling, qk_w, qk_eps):
    """``rms_qknorm_rope_pairs`` for the portable mainloop only."""
    normed, z = _head_normed(acc, sumsq, inv_d, eps, qk_w, qk_eps)
    return _rotate_pairs_swapped(normed, pos, freq, scaling), z


@triton.jit
def rms_rope_pairs(acc, sumsq, inv_d, eps, pos, freq, scaling):
    """``rms_rope`` with the interleaved-pairs rotation."""
    return _rotate_pairs_of(acc * rms_scale_of(sumsq, inv_d, eps), pos, freq, scaling)


@triton.jit
def rms_qknorm_rope_pairs(acc, sumsq, inv_d, eps, pos, freq, scaling, qk_w, qk_eps):
    """``rms_qknorm_rope`` with the interleaved-pairs rotation."""
    normed, z = _head_normed(acc, sumsq, inv_d, eps, qk_w, qk_eps)
    return _rotate_pairs_of(normed, pos, freq, scaling), z


def head_rms_norm(z: torch.Tensor, weight: torch.Tensor, eps: float, head_dim: int) -> torch.Tensor:
    """Each head's RMSNorm (weight [head_dim]) over [M, N] rows, in z's dtype."""
    M, N = z.shape
    h = z.reshape(M, N // head_dim, head_dim)
    return (h * (h.pow(2).mean(-1, keepdim=True) + eps).rsqrt() * weight.to(z.dtype)).reshape(M, N)


def rope_tables(pos: torch.Tensor, freq: torch.Tensor, scaling: float):
    """cos and sin [M, N] (float32) of each row's position times each column's frequency."""
    angle = pos.to(torch.float32)[:, None] * freq.to(torch.float32)[None, :]
    return angle.cos() * scaling, angle.sin() * scaling


def rotate_half_reference(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int
) -> torch.Tensor:
    """x cos + rotate_half(x) sin over heads of ``head_dim`` columns (Hugging Face's RoPE)."""
    M, N = x.shape
    h = x.reshape(M, N // head_dim, 2, head_dim // 2)
    rot = torch.cat([-h[:, :, 1], h[:, :, 0]], dim=-1).reshape(M, N)
    return x * cos + rot * sin


def rotate_pairs_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_pairs(x) sin: columns (2i, 2i+1) = (a, b) -> (a c - b s, b c + a s),
    the interleaved-pairs RoPE (any head dim), each product with its own column's cos or
    sin as the programs form them (a model's two columns of a pair share one angle)."""
    M, N = x.shape
    a, b = x.reshape(M, N // 2, 2).unbind(-1)
    ca, cb = cos.reshape(M, N // 2, 2).unbind(-1)
    sa, sb = sin.reshape(M, N // 2, 2).unbind(-1)
    return torch.stack([a * ca - b * sb, b * cb + a * sa], dim=-1).reshape(M, N)


def unrotate_pairs(dout: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The gradient through ``rotate_pairs_reference``, in float32: (g_a c + g_b s,
    g_b c - g_a s) per column pair."""
    M, N = dout.shape
    ga, gb = dout.float().reshape(M, N // 2, 2).unbind(-1)
    c, s = cos.reshape(M, N // 2, 2)[..., 0], sin.reshape(M, N // 2, 2)[..., 0]
    return torch.stack([ga * c + gb * s, gb * c - ga * s], dim=-1).reshape(M, N).to(dout.dtype)


def unrotate_half(dout: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The gradient through ``rotate_half_reference`` (the rotation's transpose):
    d1 = g1 c + g2 s, d2 = g2 c - g1 s per head, computed in float32."""
    M, N = dout.shape
    g = dout.float().reshape(M, N // head_dim, 2, head_dim // 2)
    c = cos.reshape(M, N // head_dim, 2, head_dim // 2)[:, :, 0]
    s = sin.reshape(M, N // head_dim, 2, head_dim // 2)[:, :, 0]
    d1 = g[:, :, 0] * c + g[:, :, 1] * s
    d2 = g[:, :, 1] * c - g[:, :, 0] * s
    return torch.stack([d1, d2], dim=2).reshape(M, N).to(dout.dtype)


def _first_half_freq(freq: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The frequencies the programs use: each head's first half, for both halves (a
    model's are the same in both: Hugging Face repeats inv_freq)."""
    h = freq.reshape(-1, 2, head_dim // 2)[:, :1]
    return h.expand(-1, 2, -1).reshape(-1)


def _reference(head_dim: int, pairs: bool, qk_norm: bool):
    """The PyTorch form of RMS_ROPE, RMS_QKNORM_ROPE (``qk_norm``) and their ``pairs``
    twins: the norm's row scale, (each head's RMSNorm,) the rotation."""

    def rotate(x, pos, freq, scaling):
        cos, sin = rope_tables(pos, freq if pairs else _first_half_freq(freq, head_dim), scaling)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        return rotate_pairs_reference(x, cos, sin) if pairs else rotate_half_reference(x, cos, sin, head_dim)

    def ref(acc, sumsq, inv_d, eps, pos, freq, scaling, qk_w=None, qk_eps=None, bias=None):
        z = acc * (sumsq.to(acc.dtype) * inv_d + eps).rsqrt()[:, None]
        if bias is not None:
            z = z + bias.to(z.dtype)
        if not qk_norm:
            return {"out": rotate(z, pos, freq, scaling)}
        unit = torch.ones(head_dim, dtype=z.dtype, device=z.device)
        n = head_rms_norm(z, unit, qk_eps, head_dim) * qk_w.to(z.dtype)
        return {"out": rotate(n, pos, freq, scaling), "pre": z}

    return ref


def _head_check(head_dim):
    def check(M, N):
        if N % head_dim:
            raise ValueError(f"RoPE rotates whole heads: N={N} must be a multiple of head_dim {head_dim}")

    return check


# tiles whose sub-tiles can be one head (64, 128 or 256 wide: each program keeps those
# exactly its head dim wide; the ping-pong mainloop's candidates are filtered the same
# way). The sm_90a check found 256x128 tiles, 4-warp 128x128 tiles and 128-wide
# sub-tiles of 128x256 tiles spilling (the whole fp32 tile stays live under the
# rotation's temporaries): out
_ROPE_CANDIDATES = tuple(
    config_grid(((128, 256, 3, 8),), (1, 4))
    + config_grid(((128, 128, 4, 8), (128, 128, 3, 8)), (1, 2), (False,))
)


def _narrow_candidates(hd: int) -> tuple:
    """Narrow heads (16, 32: tiny test models): 64- or 128-wide tiles split in four (a
    sub-tile is one head); none for wider heads."""
    return () if hd >= 64 else tuple(config_grid(((128, 4 * hd, 3, 8),), (4,), (False,)))


def _rope_candidates(hd: int) -> tuple:
    return _ROPE_CANDIDATES + _narrow_candidates(hd)


_ROPE_INPUTS = (PerRow("sumsq"), Scalar("inv_d"), Scalar("eps"), PerRow("pos", index=True), PerCol("freq"),
                Scalar("scaling"))  # fmt: skip

HEAD_DIMS = (16, 32, 64, 128, 256)
# heads per program of the backward row passes' default launches (``unrotate_launch``,
# ``qknorm_launch``): their rows' angles made once for that many heads
UNROTATE_HEADS, QKNORM_HEADS = 2, 2


def _rope_programs(name: str, body, pairs: bool, qk_norm: bool, configs, pingpong: dict,
                   bias_of: dict | None = None) -> dict:  # fmt: skip
    """One program per head dim: ``name`` with the head dim appended; ``body``: a function
    of the head dim giving the body; ``pingpong``: the Program's ping-pong arguments for a
    head dim. ``bias_of``: the same programs without a bias, per head dim: these take one
    more input, the projection's bias ([N], added before the rotation), and where their own
    shapes are untuned take those programs' tuned configurations as the nearest ones."""
    extra = (PerCol("qk_w"), Scalar("qk_eps")) if qk_norm else ()
    return {
        hd: Program(
            f"{name}_{hd}",
            body(hd),
            inputs=(*_ROPE_INPUTS, *extra, *((PerCol("bias"),) if bias_of else ())),
            outputs=(Tile("out"), Tile("pre")) if qk_norm else (Tile("out"),),
            reference=_reference(hd, pairs, qk_norm),
            check=_head_check(hd),
            configs=configs(hd),
            sub_tile_width=hd,
            tuned_like=bias_of[hd] if bias_of else None,
            **pingpong(hd),
        )
        for hd in HEAD_DIMS
    }


# q or k projections after an RMSNorm (K1's h): the norm's row scale, then RoPE with each
# row's position (PerRow index: packed sequences work) and each column's inverse frequency
# ([N]: the model's inv_freq, per head, both halves; a head's first half is what counts),
# times the rope's attention scaling
RMS_ROPE = _rope_programs("rms_rope", lambda hd: rms_rope, False, False, _rope_candidates, lambda hd: {})
# the same with the projection's bias added before the rotation (Qwen2's q and k
# projections; the backward's bias gradient is the column sum of the rotation's
# transpose of the output's gradient, ops/residual_rmsnorm.py)
RMS_ROPE_BIAS = _rope_programs(
    "rms_rope_bias", lambda hd: rms_rope_bias, False, False, _rope_candidates, lambda hd: {}, RMS_ROPE
)
# the same with Qwen3's per-head q/k RMSNorm before RoPE (qk_w: the norm weight repeated
# over the projection's heads, [N]); also stores the un-normalized z for the backward.
# Whole 128x128 ping-pong consumer tiles spill 648 B here; 64-row ones (64x128, 64x256)
# do not
RMS_QKNORM_ROPE = _rope_programs(
    "rms_qknorm_rope", lambda hd: rms_qknorm_rope, False, True, _rope_candidates,
    lambda hd: {"pingpong_configs": PINGPONG_64_ROW_CANDIDATES if hd == 128 else None, "pingpong": hd == 128},
)  # fmt: skip

# the same two in the interleaved-pairs convention (``RoPE(interleaved=True)``): freq
# [N] holds each pair's frequency twice (inv_freq.repeat_interleave(2) per head).
# RMS_ROPE_PAIRS at head dims 64 and 128 (the Llama widths) runs ``rms_rope_pairs`` on both
# mainloops with rotate-half's candidates plus 64-row tiles: in the sm_90a
# check of 2026-12-04 (the current bodies, the special-function unit's angles) none spills
# (128-244 registers on the portable mainloop, the ping-pong split's 168), where an
# earlier body spilled 1.2 KB on 128x128 ping-pong tiles and 96-288 B on 128x256 ones at
# head dim 64, which had kept them to 64-row ping-pong tiles at 128 and the portable
# mainloop at 64 (on the H200, run 183: its q GEMM 1.27-1.38x cuBLAS at head dim 64,
# NOTES.md). Other head dims keep the portable-only body. RMS_QKNORM_ROPE_PAIRS keeps its
# earlier candidates (the portable mainloop's 128x128 and 64x128 tiles, 64-row ping-pong
# tiles at head dim 128, where its portable tiles once spilled 56-176 B of stack: now
# 166-174 registers and no spill, so head dim 128 joined 64 in CI's sm_90a list; no
# shipped model uses this convention with q/k norms)
_PAIRS_CANDIDATES = _ROPE_CANDIDATES + tuple(
    config_grid(((64, 128, 4, 4), (64, 128, 3, 4)), (1, 2, 4), (False,))
)
_WIDE_PAIRS = (64, 128)  # the head dims whose RMS_ROPE_PAIRS runs on both mainloops


def _rope_pairs_candidates(hd: int) -> tuple:
    """RMS_ROPE_PAIRS's portable candidates: rotate-half's and 64-row tiles; narrow heads
    (16, 32) also get ``_narrow_candidates`` (head dim 16 had no candidate at all before:
    its calls raised on a GPU)."""
    return _PAIRS_CANDIDATES + _narrow_candidates(hd)


def _rope_pairs_pingpong(hd: int) -> dict:
    """RMS_ROPE_PAIRS's ping-pong candidates: the default ones and the 64-row tiles (those
    whose sub-tile is one head), at ``_WIDE_PAIRS`` only."""
    if hd not in _WIDE_PAIRS:
        return {"pingpong": False}
    return {"pingpong_configs": PINGPONG_CANDIDATES + PINGPONG_64_ROW_CANDIDATES}


def _pairs_pingpong(hd: int) -> dict:
    """RMS_QKNORM_ROPE_PAIRS: the ping-pong mainloop for head dim 128 only (the others'
    portable-only body)."""
    return _PAIRS_PINGPONG if hd == 128 else {"pingpong": False}


def _pairs_candidates(hd: int) -> tuple:
    """RMS_QKNORM_ROPE_PAIRS: 128x256 tiles only where a head needs them (256): at head
    dim 64 they spilled 96-288 B with either body; the 128x128 and 64x128 ones spill
    nothing there. Narrow heads (16, 32) also get ``_narrow_candidates``."""
    if hd == 256:
        return _PAIRS_CANDIDATES
    return tuple(c for c in _PAIRS_CANDIDATES if c.block_n <= 128) + _narrow_candidates(hd)


_PAIRS_PINGPONG = {"pingpong_configs": tuple(c for c in PINGPONG_64_ROW_CANDIDATES if c.block_n == 128)}
RMS_ROPE_PAIRS = _rope_programs(
    "rms_rope_pairs", lambda hd: rms_rope_pairs if hd in _WIDE_PAIRS else rms_rope_pairs_portable, True,
    False, _rope_pairs_candidates, _rope_pairs_pingpong,
)  # fmt: skip
RMS_QKNORM_ROPE_PAIRS = _rope_programs(
    "rms_qknorm_rope_pairs",
    lambda hd: rms_qknorm_rope_pairs if hd == 128 else rms_qknorm_rope_pairs_portable,
    True, True, _pairs_candidates, _pairs_pingpong,
)  # fmt: skip

# the head dims of the models codetta ships configs for (Llama 3, Qwen3, Mistral, Qwen2.5), as
# names: checked for sm_90a in CI with every shipped program; 16, 32 and 256 are in
# RMS_ROPE only
RMS_ROPE_64, RMS_ROPE_128 = RMS_ROPE[64], RMS_ROPE[128]
RMS_ROPE_BIAS_64, RMS_ROPE_BIAS_128 = RMS_ROPE_BIAS[64], RMS_ROPE_BIAS[128]
RMS_ROPE_PAIRS_128, RMS_QKNORM_ROPE_PAIRS_128 = RMS_ROPE_PAIRS[128], RMS_QKNORM_ROPE_PAIRS[128]
RMS_ROPE_PAIRS_64, RMS_QKNORM_ROPE_PAIRS_64 = RMS_ROPE_PAIRS[64], RMS_QKNORM_ROPE_PAIRS[64]
# q, k and v from one launch: the three weights side by side along N (N parts), each
# output its own tensor; v's columns take frequency 0 (cos 1, sin 0: an exact identity
# when the attention scaling is 1), so it comes out as RMS_SCALE would write it
RMS_ROPE_QKV = {hd: with_n_parts(prog, 2) for hd, prog in RMS_ROPE.items()}
RMS_ROPE_QKV_64, RMS_ROPE_QKV_128 = RMS_ROPE_QKV[64], RMS_ROPE_QKV[128]
RMS_QKNORM_ROPE_128 = RMS_QKNORM_ROPE[128]


@triton.jit
def _row_angles(pos_ptr, freq_ptr, M, scaling, HALF: tl.constexpr, BLOCK_M: tl.constexpr,
                APPROX: tl.constexpr = False):  # fmt: skip
    """The backward passes' rows (program id 0: row block) and their rotation, cos and sin
    [BLOCK_M, HALF] times ``scaling``: one token's angles serve every head of its row."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    pos = tl.load(pos_ptr + rows, mask=rows < M, other=0).to(tl.float32)
    angle = pos[:, None] * tl.load(freq_ptr + tl.arange(0, HALF))[None, :]
    if APPROX:  # the special-function unit's, as the forward's (_rotate)
        sin, cos = P.sincos_approx(angle)
    else:
        sin, cos = P.sincos(angle)
    return rows, cos * scaling, sin * scaling


@triton.jit
def _load_parts(ptr, base, mask, HALF: tl.constexpr, PAIRS: tl.constexpr):
    """Each head's two rotated parts, [BLOCK_M, HEADS, HALF] in fp32, of the heads whose
    first columns ``base`` [BLOCK_M, HEADS, 1] addresses: its halves (rotate-half), or with
    ``PAIRS`` its even and odd columns, split in registers from whole rows of the head
    (contiguous: with loads and stores of every other 2-byte element the inverse rotation
    of [16384, 4096] + [16384, 1024] took 1.29 ms on the H200 instead of 0.083, run 184,
    NOTES.md)."""
    if PAIRS:
        whole = tl.load(ptr + base + tl.arange(0, 2 * HALF)[None, None, :], mask=mask, other=0.0)
        BM: tl.constexpr = whole.shape[0]
        H: tl.constexpr = whole.shape[1]
        p1, p2 = tl.split(tl.reshape(whole.to(tl.float32), (BM, H, HALF, 2)))
    else:
        cols = tl.arange(0, HALF)[None, None, :]
        p1 = tl.load(ptr + base + cols, mask=mask, other=0.0).to(tl.float32)
        p2 = tl.load(ptr + base + HALF + cols, mask=mask, other=0.0).to(tl.float32)
    return p1, p2


@triton.jit
def _store_parts(ptr, base, mask, p1, p2, HALF: tl.constexpr, PAIRS: tl.constexpr):
    """``_load_parts``' inverse: the two parts written back as the heads' columns, in
    ``ptr``'s dtype."""
    if PAIRS:
        BM: tl.constexpr = p1.shape[0]
        H: tl.constexpr = p1.shape[1]
        whole = tl.reshape(tl.join(p1, p2), (BM, H, 2 * HALF))
        cols = tl.arange(0, 2 * HALF)[None, None, :]
        tl.store(ptr + base + cols, whole.to(ptr.dtype.element_ty), mask=mask)
    else:
        cols = tl.arange(0, HALF)[None, None, :]
        tl.store(ptr + base + cols, p1.to(ptr.dtype.element_ty), mask=mask)
        tl.store(ptr + base + HALF + cols, p2.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _head_block(g_ptr, rows, c, s, M, N, group, HALF: tl.constexpr, PAIRS: tl.constexpr,
                HEADS: tl.constexpr):  # fmt: skip
    """HEADS heads of the rows (``_row_angles``; ``group``: which HEADS heads), each head's
    two rotated parts as [BLOCK_M, HEADS, HALF] blocks (``_load_parts``), the angles
    broadcast over the heads. Returns (each head's first column's offset [BLOCK_M, HEADS,
    1], the row mask, the un-rotated gradient parts n1, n2: the rotation's transpose, in
    fp32)."""
    heads = group * HEADS + tl.arange(0, HEADS)
    mask = (rows < M)[:, None, None]
    base = rows.to(tl.int64)[:, None, None] * N + (heads * 2 * HALF)[None, :, None]
    g1, g2 = _load_parts(g_ptr, base, mask, HALF, PAIRS)
    c = c[:, None, :]
    s = s[:, None, :]
    return base, mask, g1 * c + g2 * s, g2 * c - g1 * s


@triton.jit
def _unrotate_kernel(g_ptr, out_ptr, g2_ptr, out2_ptr, pos_ptr, freq_ptr, M, N, N2, scaling,
                     HALF: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr, HEADS: tl.constexpr,
                     APPROX: tl.constexpr = False):  # fmt: skip
    # program ids: (row block, group of HEADS heads: the first tensor's groups [M, N], then
    # the second's [M, N2], the same rows' angles); the angles made once for the group
    rows, c, s = _row_angles(pos_ptr, freq_ptr, M, scaling, HALF, BLOCK_M, APPROX)
    group = tl.program_id(1)
    groups = N // (2 * HALF * HEADS)
    if group >= groups:  # the second tensor's heads (q's gradient, then k's)
        g_ptr, out_ptr, N, group = g2_ptr, out2_ptr, N2, group - groups
    base, mask, n1, n2 = _head_block(g_ptr, rows, c, s, M, N, group, HALF, PAIRS, HEADS)
    _store_parts(out_ptr, base, mask, n1, n2, HALF, PAIRS)


def _tables(pos, inv_freq, n: int, scaling: float, pairs: bool):
    """cos and sin [M, n] of the forward's rotation (each head's frequencies repeated as
    its convention pairs the columns)."""
    per_head = inv_freq.repeat_interleave(2) if pairs else inv_freq.repeat(2)
    return rope_tables(pos, per_head.repeat(n // per_head.shape[0]), scaling)


def unrotate_launch(half: int) -> tuple[int, int, int, bool]:
    """The inverse rotation's default launch: (rows per program, warps, heads per program,
    approx): 2048 elements of each rotated half per program over two heads, 8 warps, the
    polynomials' sines and cosines. Timed on the H200 (run 147, ``scripts/row_passes.py``):
    [16384, 4096] at head_dim 128 in 71.6 us against 77.4 for one head of 64 rows (the
    angles made once per row block, not per head). The pass is memory-bound: the
    special-function unit's angles were level in run 160 (72.7 against 72.5 us) and 2-8 %
    slower in run 163 (83.7 against 77.6), so not taken here (the q/k-norm pass takes
    them). 8 warps: with 4 and one head, 182-255 registers per thread for sm_90a and
    16-160 B spilled at head dims 16-128; now 34-48 and no spill (CI's sm_90a check
    compiles these launches)."""
    return max(1, 1024 // half), 8, UNROTATE_HEADS, False


def _heads(launch, n_heads: int) -> tuple[int, int, int, bool]:
    """A launch (rows, warps[, heads[, approx]]) in full: its heads per program brought to
    the largest power of 2 that divides both it and ``n_heads`` (a block dimension);
    ``approx``: the angles' sines and cosines from the special-function unit
    (``P.sincos_approx``, as the forward's) instead of the polynomials (False where the
    launch leaves it out; the default launches set it; on the CPU both are the
    polynomials)."""
    block_m, warps, *more = launch
    common = math.gcd(more[0] if more else 1, n_heads)
    return block_m, warps, common & -common, bool(more[1]) if len(more) > 1 else False


def qknorm_launch(half: int) -> tuple[int, int, int, bool]:
    """The q/k-norm backward's default launch (as ``unrotate_launch``'s): 2048 elements of
    each rotated half per program over two heads, 4 warps, the special-function unit's
    sines and cosines (as the forward's, ``_rotate``): 128-180 registers per thread for
    sm_90a, no spill. Run 147 timed [16384, 4096] at head_dim 128 in 237 us with one head
    of 32 rows and 8 warps, 147 us with two heads of 32 rows and 4 warps, which spills
    360 B (so not the default; NOTES.md). This launch with the polynomials' angles: 176-177
    us (runs 148, 160, 163); with the special-function unit's 156.6-157.4 (runs 160, 163:
    the pass is arithmetic-bound, ~40 instructions an angle against ~7). Their weight
    gradient's float32 error against float64 is 1.2-2.0x the polynomials' (run 163; both
    ~1e-6 of its size, far inside the standard's bf16 bound)."""
    return max(1, 1024 // half), 4, QKNORM_HEADS, True


def row_pass_jobs() -> list[tuple]:
    """The backward row passes as the sm_90a check compiles them (``programs/sm90_check.py``):
    (label, kernel, argument types, constexprs, warps) at their default launches, bf16,
    every head dim and both conventions."""
    rows = {"g_ptr": "*bf16", "pos_ptr": "*i64", "freq_ptr": "*fp32", "M": "i32", "N": "i32"}
    rows["scaling"] = "fp32"
    qk = {"pre_ptr": "*bf16", "w_ptr": "*bf16", "out_ptr": "*bf16", "dw_ptr": "*fp32", "eps": "fp32"}
    kernels = (
        (
            "unrotate",
            _unrotate_kernel,
            {**rows, "out_ptr": "*bf16", "g2_ptr": "*bf16", "out2_ptr": "*bf16", "N2": "i32"},
            unrotate_launch,
        ),
        ("qknorm_backward", _qknorm_backward_kernel, {**rows, **qk}, qknorm_launch),
    )
    jobs = []
    for name, fn, types, launch in kernels:
        for hd in HEAD_DIMS:
            for pairs in (False, True):
                block_m, warps, heads, approx = launch(hd // 2)
                label = (f"{name} head_dim {hd}{' pairs' if pairs else ''}, {block_m} rows, {warps} warps, "
                         f"{heads} heads{', approx' if approx else ''}")  # fmt: skip
                consts = dict(HALF=hd // 2, BLOCK_M=block_m, PAIRS=pairs, HEADS=heads, APPROX=approx)
                jobs.append((label, fn, types, consts, warps))
    return jobs


def unrotate_half_rows(
    dout: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float, pairs: bool = False,
    *, launch: tuple[int, ...] | None = None,
) -> torch.Tensor:  # fmt: skip
    """The gradient through RMS_ROPE's rotation (its transpose), one pass over [M, N]:
    d1 = g1 c + g2 s, d2 = g2 c - g1 s per head of 2 * len(inv_freq) columns, with the
    angles pos[m] * inv_freq formed in float32 as the forward forms them; ``pairs``:
    RMS_ROPE_PAIRS's rotation (d1, d2 the even and odd columns). Returns a new tensor of
    dout's dtype. ``launch``: (rows per program, warps[, heads per program[, approx]])
    instead of the default (``scripts/row_passes.py`` times the choices; the heads per
    program are brought to a divisor of the heads; ``_heads``)."""
    return _unrotate((dout,), pos, inv_freq, scaling, pairs, launch)[0]


def unrotate_two_rows(
    dq: torch.Tensor, dk: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float,
    pairs: bool = False, *, launch: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """``unrotate_half_rows`` of two gradients with the same rows and rotation (q's and k's,
    [M, N_q] and [M, N_k]) in one launch: each element's math is its own, so the results
    are those of two calls, with one launch's host time fewer (the 1B q/k/v operator is
    host-bound, NOTES.md). The heads per program are brought to a divisor of both
    tensors' heads."""
    if dq.shape[0] != dk.shape[0] or dq.dtype != dk.dtype or dq.device != dk.device:
        raise ValueError(f"dq {dq.dtype} {tuple(dq.shape)} and dk {dk.dtype} {tuple(dk.shape)} must share "
                         "rows, dtype and device")  # fmt: skip
    out = _unrotate((dq, dk), pos, inv_freq, scaling, pairs, launch)
    return out[0], out[1]


def _unrotate(douts, pos, inv_freq, scaling, pairs, launch) -> list[torch.Tensor]:
    """The inverse rotation of one or two [M, N_i] gradients (the same rows), one launch."""
    half = inv_freq.shape[0]
    hd = 2 * half
    for d in douts:
        if d.dim() != 2 or d.shape[1] % hd:
            raise ValueError(f"a gradient [M, N] of whole heads of {hd} columns, got {tuple(d.shape)}")
    if torch_path(douts[0]):
        outs = []
        for d in douts:
            cos, sin = _tables(pos, inv_freq, d.shape[1], scaling, pairs)
            outs.append(unrotate_pairs(d, cos, sin) if pairs else unrotate_half(d, cos, sin, hd))
        return outs
    douts = [d.contiguous() for d in douts]
    outs = [torch.empty_like(d) for d in douts]
    M, N = douts[0].shape
    N2 = douts[-1].shape[1]
    block_m, warps, heads, approx = _heads(launch or unrotate_launch(half), math.gcd(N // hd, N2 // hd))
    groups = N // hd // heads + (N2 // hd // heads if len(douts) == 2 else 0)
    grid = (triton.cdiv(M, block_m), groups)
    with device.on_device(douts[0].device):
        freq = inv_freq.float().contiguous()
        precompile.launch(_unrotate_kernel, grid, douts[0], outs[0], douts[-1], outs[-1], pos.contiguous(),
                          freq, M, N, N2, float(scaling), HALF=half, BLOCK_M=block_m, PAIRS=pairs,
                          HEADS=heads, APPROX=approx, num_warps=warps)  # fmt: skip
    return outs


@triton.jit
def _qknorm_backward_kernel(g_ptr, pre_ptr, w_ptr, out_ptr, dw_ptr, pos_ptr, freq_ptr, M, N, scaling, eps,
                            HALF: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr,
                            HEADS: tl.constexpr, APPROX: tl.constexpr = False):  # fmt: skip
    # program ids: (row block, group of HEADS heads); n1, n2: the gradient of the normalized
    # heads, before the rotation; dw partials: a row per program of [., 2 HALF], summed
    # over its heads
    rows, c, s = _row_angles(pos_ptr, freq_ptr, M, scaling, HALF, BLOCK_M, APPROX)
    base, mask, n1, n2 = _head_block(g_ptr, rows, c, s, M, N, tl.program_id(1), HALF, PAIRS, HEADS)
    z1, z2 = _load_parts(pre_ptr, base, mask, HALF, PAIRS)
    step: tl.constexpr = 2 if PAIRS else 1
    other: tl.constexpr = 1 if PAIRS else HALF
    cols = step * tl.arange(0, HALF)  # the first part's columns within a head (the weight's: small)
    w1 = tl.load(w_ptr + cols).to(tl.float32)[None, None, :]
    w2 = tl.load(w_ptr + other + cols).to(tl.float32)[None, None, :]
    rho = tl.rsqrt((tl.sum(z1 * z1, axis=2) + tl.sum(z2 * z2, axis=2)) * (0.5 / HALF) + eps)[:, :, None]
    h1 = z1 * rho
    h2 = z2 * rho
    gw1 = n1 * w1
    gw2 = n2 * w2
    m = ((tl.sum(gw1 * h1, axis=2) + tl.sum(gw2 * h2, axis=2)) * (0.5 / HALF))[:, :, None]
    _store_parts(out_ptr, base, mask, rho * (gw1 - h1 * m), rho * (gw2 - h2 * m), HALF, PAIRS)
    part = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * 2 * HALF
    tl.store(dw_ptr + part + cols, tl.sum(tl.sum(n1 * h1, axis=1), axis=0))
    tl.store(dw_ptr + part + other + cols, tl.sum(tl.sum(n2 * h2, axis=1), axis=0))


def qknorm_backward_rows(dout, pre, weight, pos, inv_freq, scaling: float, eps: float, pairs: bool = False,
                        *, launch: tuple[int, ...] | None = None):  # fmt: skip
    """The gradient through RMS_QKNORM_ROPE's per-head norm and rotation, one pass over
    [M, N]: returns (dz [M, N] in dout's dtype, dweight [head_dim] float32). ``pre``: the
    forward's z (the norm's input); ``weight``: the norm weight [head_dim]; ``pairs``:
    RMS_QKNORM_ROPE_PAIRS's rotation; ``launch``: as ``unrotate_half_rows``'s."""
    M, N = dout.shape
    half = inv_freq.shape[0]
    hd = 2 * half
    if torch_path(dout):
        cos, sin = _tables(pos, inv_freq, N, scaling, pairs)
        g = dout.float()
        n = (unrotate_pairs(g, cos, sin) if pairs else unrotate_half(g, cos, sin, hd)).reshape(M, N // hd, hd)
        z = pre.float().reshape(M, N // hd, hd)
        rho = (z.pow(2).mean(-1, keepdim=True) + eps).rsqrt()
        h = z * rho
        gw = n * weight.float()
        dz = rho * (gw - h * (gw * h).mean(-1, keepdim=True))
        return dz.reshape(M, N).to(dout.dtype), (n * h).sum((0, 1))
    dout, pre = dout.contiguous(), pre.contiguous()
    out = torch.empty_like(dout)
    block_m, warps, heads, approx = _heads(launch or qknorm_launch(half), N // hd)
    grid = (triton.cdiv(M, block_m), N // hd // heads)
    dw = torch.empty((grid[0] * grid[1], hd), dtype=torch.float32, device=dout.device)
    with device.on_device(dout.device):
        freq = inv_freq.float().contiguous()
        precompile.launch(_qknorm_backward_kernel, grid, dout, pre, weight.contiguous(), out, dw,
                          pos.contiguous(), freq, M, N, float(scaling), float(eps), HALF=half,
                          BLOCK_M=block_m, PAIRS=pairs, HEADS=heads, APPROX=approx,
                          num_warps=warps)  # fmt: skip
    return out, dw.sum(0)
