"""RoPE in GEMM epilogues: rotation of adjacent column pairs, and Hugging Face's
rotate-half convention on whole heads after an RMSNorm (q and k projections)."""

import torch
import triton
import triton.language as tl  # noqa: F401 - the JIT needs tl in scope

from .. import reference as ref
from ..kernels import device
from ..kernels import primitives as P
from ..kernels.configs import _grid
from ..kernels.program import PerCol, PerRow, Program, Scalar, Tile
from ..kernels.settings import SETTINGS
from .norm import rms_scale_of


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


# ---- RoPE in Hugging Face's rotate-half convention, on whole attention heads


@triton.jit
def _halves(x, HD: tl.constexpr):
    """[BM, W] (W a multiple of HD) -> each head's first and second halves, [BM, W/HD, HD/2]."""
    BM: tl.constexpr = x.shape[0]
    W: tl.constexpr = x.shape[1]
    return tl.split(tl.permute(tl.reshape(x, (BM, W // HD, 2, HD // 2)), (0, 1, 3, 2)))


@triton.jit
def _whole(first, second):
    """Inverse of ``_halves``."""
    BM: tl.constexpr = first.shape[0]
    H: tl.constexpr = first.shape[1]
    HALF: tl.constexpr = first.shape[2]
    return tl.reshape(tl.permute(tl.join(first, second), (0, 1, 3, 2)), (BM, H * 2 * HALF))


@triton.jit
def _rms_rope(acc, sumsq, inv_d, eps, pos, freq, scaling, HD: tl.constexpr):
    """The norm's row scale, then RoPE over heads of HD columns (Hugging Face's
    rotate-half): with x1, x2 a head's halves and a = position[m] * inv_freq (the
    column's frequency, the same in both halves), out = (x1 cos a - x2 sin a,
    x2 cos a + x1 sin a) * (cos and sin times ``scaling``). The angles are formed on
    half-width tensors: half the sines and cosines, half their registers."""
    x1, x2 = _halves(acc * rms_scale_of(sumsq, inv_d, eps), HD)
    a1, a2 = _halves(pos.to(tl.float32) * freq, HD)  # angles in the acc's layout, then halved
    sin, cos = P.sincos(a1)
    c = cos * scaling
    s = sin * scaling
    return _whole(x1 * c - x2 * s, x2 * c + x1 * s)


@triton.jit
def rms_rope_16(acc, sumsq, inv_d, eps, pos, freq, scaling):
    """q or k with the norm's row scale and RoPE (head_dim 16): see ``_rms_rope``."""
    return _rms_rope(acc, sumsq, inv_d, eps, pos, freq, scaling, 16)


@triton.jit
def rms_rope_32(acc, sumsq, inv_d, eps, pos, freq, scaling):
    return _rms_rope(acc, sumsq, inv_d, eps, pos, freq, scaling, 32)


@triton.jit
def rms_rope_64(acc, sumsq, inv_d, eps, pos, freq, scaling):
    return _rms_rope(acc, sumsq, inv_d, eps, pos, freq, scaling, 64)


@triton.jit
def rms_rope_128(acc, sumsq, inv_d, eps, pos, freq, scaling):
    return _rms_rope(acc, sumsq, inv_d, eps, pos, freq, scaling, 128)


@triton.jit
def rms_rope_256(acc, sumsq, inv_d, eps, pos, freq, scaling):
    return _rms_rope(acc, sumsq, inv_d, eps, pos, freq, scaling, 256)


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


def _rope_reference(head_dim):
    def ref(acc, sumsq, inv_d, eps, pos, freq, scaling):
        z = acc * (sumsq.to(acc.dtype) * inv_d + eps).rsqrt()[:, None]
        cos, sin = rope_tables(pos, freq, scaling)
        return {"out": rotate_half_reference(z, cos.to(acc.dtype), sin.to(acc.dtype), head_dim)}

    return ref


def _head_check(head_dim):
    def check(M, N):
        if N % head_dim:
            raise ValueError(f"RoPE rotates whole heads: N={N} must be a multiple of head_dim {head_dim}")

    return check


# whole heads per sub-tile; the ping-pong mainloop's candidates are filtered the same way
_ROPE_CANDIDATES = tuple(
    _grid(((128, 256, 3, 8),), (2, 4))
    + _grid(((256, 128, 3, 8),), (1, 2), (False,))
    + _grid(((128, 128, 4, 4),), (1, 2), (True,))
)

# q or k projections after an RMSNorm (K1's h): the norm's row scale, then RoPE with each
# row's position (PerRow index: packed sequences work) and each column's inverse frequency
# ([N]: the model's inv_freq, per head, both halves), times the rope's attention scaling
RMS_ROPE = {
    hd: Program(
        f"rms_rope_{hd}",
        body,
        inputs=(
            PerRow("sumsq"),
            Scalar("inv_d"),
            Scalar("eps"),
            PerRow("pos", index=True),
            PerCol("freq"),
            Scalar("scaling"),
        ),  # fmt: skip
        outputs=(Tile("out"),),
        reference=_rope_reference(hd),
        check=_head_check(hd),
        configs=_ROPE_CANDIDATES,
        sub_tile_multiple=hd,
    )
    for hd, body in (
        (16, rms_rope_16),
        (32, rms_rope_32),
        (64, rms_rope_64),
        (128, rms_rope_128),
        (256, rms_rope_256),
    )  # fmt: skip
}
# the head dims of the models codetta ships configs for (Llama 3, Qwen3, Mistral), as
# names: checked for sm_90a in CI with every shipped program; 16, 32 and 256 are in
# RMS_ROPE only
RMS_ROPE_64, RMS_ROPE_128 = RMS_ROPE[64], RMS_ROPE[128]


@triton.jit
def _unrotate_kernel(g_ptr, out_ptr, pos_ptr, freq_ptr, M, N, scaling, HALF: tl.constexpr,
                     BLOCK_M: tl.constexpr):  # fmt: skip
    # one program: BLOCK_M rows of one head; the head's halves are addressed directly
    pid_m = tl.program_id(0)
    head = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, HALF)
    mask = (rows < M)[:, None]
    base = rows.to(tl.int64)[:, None] * N + head * 2 * HALF + cols[None, :]
    g1 = tl.load(g_ptr + base, mask=mask, other=0.0).to(tl.float32)
    g2 = tl.load(g_ptr + base + HALF, mask=mask, other=0.0).to(tl.float32)
    pos = tl.load(pos_ptr + rows, mask=rows < M, other=0).to(tl.float32)
    freq = tl.load(freq_ptr + cols)
    sin, cos = P.sincos(pos[:, None] * freq[None, :])
    c = cos * scaling
    s = sin * scaling
    tl.store(out_ptr + base, (g1 * c + g2 * s).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + base + HALF, (g2 * c - g1 * s).to(out_ptr.dtype.element_ty), mask=mask)


def unrotate_half_rows(
    dout: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> torch.Tensor:
    """The gradient through RMS_ROPE's rotation (its transpose), one pass over [M, N]:
    d1 = g1 c + g2 s, d2 = g2 c - g1 s per head of 2 * len(inv_freq) columns, with the
    angles pos[m] * inv_freq formed in float32 as the forward forms them. Returns a new
    tensor of dout's dtype."""
    M, N = dout.shape
    half = inv_freq.shape[0]
    if dout.device.type == "cpu" and (
        not device.interpreting() or SETTINGS.force_reference or dout.dtype == torch.bfloat16
    ):
        cos, sin = rope_tables(pos, inv_freq.repeat(2).repeat(N // (2 * half)), scaling)
        return unrotate_half(dout, cos, sin, 2 * half)
    dout = dout.contiguous()
    out = torch.empty_like(dout)
    block_m = max(1, 4096 // half)
    grid = (triton.cdiv(M, block_m), N // (2 * half))
    with device.on_device(dout.device):
        freq = inv_freq.float().contiguous()
        _unrotate_kernel[grid](
            dout, out, pos.contiguous(), freq, M, N, float(scaling), HALF=half, BLOCK_M=block_m
        )
    return out
