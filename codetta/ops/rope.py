"""RoPE's arguments for the norm + projection operators (``residual_rmsnorm.py``): the
``RoPE`` description a caller passes, validated into what the programs' epilogues and the
backward's inverse rotation take (docs/design.md)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels.operands import check_tensor
from ..programs.rope import RMS_ROPE
from ._eager import derived
from .norm_checks import finite_nonnegative


class RoPE(NamedTuple):
    """Rotary position embedding for ``residual_rmsnorm_linear``'s first ``n_weights``
    outputs (q and k), in Hugging Face's rotate-half convention (each head's columns i and
    i + head_dim / 2 rotate together), or with ``interleaved=True`` in the interleaved-pairs
    one (columns 2i and 2i + 1: GPT-J, Meta's original Llama code), applied in their GEMMs'
    epilogues: each token's angles are ``position_ids * inv_freq`` (float32), cos and
    sin scaled by ``attention_scaling`` (a model's ``rotary_emb.inv_freq`` and
    ``.attention_scaling`` cover its rope_scaling type). ``position_ids``: integers
    broadcastable to the tokens' shape (packed sequences: per-token positions). Angles are
    reduced exactly on the GPU to ~4M radians, positions to 2^22 (both sin/cos helpers: each
    product of the reduction compiles to a fused multiply-add), through the interpreter
    only below ~131k (its products rounded: 5e-3 off at 2^17-2^18, NOTES.md).
    ``qk_norm_weights``: one [head_dim] weight per rotated output (Qwen3's q_norm and
    k_norm), an RMSNorm over each head (``qk_norm_eps``) applied before the rotation."""

    position_ids: torch.Tensor
    inv_freq: torch.Tensor
    attention_scaling: float = 1.0
    n_weights: int = 2
    qk_norm_weights: tuple = ()
    qk_norm_eps: float = 1e-6
    interleaved: bool = False

    @classmethod
    def of_rotary(cls, rotary_emb, position_ids: torch.Tensor, **fields) -> RoPE:
        """The rotation of a model's rotary-embedding module (Hugging Face's: its
        ``inv_freq`` buffer and ``attention_scaling``, as they are now), with the other
        fields given. A bf16-cast model's buffer is read through a float32 copy kept
        per buffer and version (``_eager.derived``), not made per call."""
        inv_freq = rotary_emb.inv_freq
        if inv_freq.dtype != torch.float32:
            inv_freq = derived(inv_freq, "float32", inv_freq.float)
        scaling = float(getattr(rotary_emb, "attention_scaling", 1.0))
        return cls(position_ids, inv_freq, scaling, **fields)


def column_freq(freq: torch.Tensor, n: int, keep: bool = True) -> torch.Tensor:
    """The per-head frequencies [head_dim] repeated over the n columns of a projection
    (``keep``: the table is kept with ``freq``, ``_eager.derived``: RoPE's tables come
    from a model's inv_freq buffer, the same tensor every layer and step)."""
    make = lambda: freq.repeat(n // freq.shape[0])  # noqa: E731
    return derived(freq, n, make) if keep else make()


def rope_operands(rope, ws, lead, device) -> tuple[list, float, int, float, bool]:
    """(tensors, scaling, how many outputs, q/k norm eps, interleaved pairs) of a ``RoPE``
    argument, validated."""
    if rope is None:
        return [], 1.0, 0, 0.0, False
    if not isinstance(rope, RoPE):
        raise TypeError(f"rope must be a codetta.ops.RoPE, got {type(rope).__name__}")
    pos, inv_freq = rope.position_ids, rope.inv_freq
    check_tensor("rope.position_ids", pos)
    check_tensor("rope.inv_freq", inv_freq)
    if pos.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"rope.position_ids must be int32 or int64, got {pos.dtype}")
    if inv_freq.dim() != 1 or inv_freq.dtype != torch.float32:
        raise TypeError(f"rope.inv_freq must be a 1-D float32 tensor [head_dim / 2], got {inv_freq.dtype} "
                        f"{tuple(inv_freq.shape)}")  # fmt: skip
    hd = 2 * inv_freq.shape[0]
    if hd not in RMS_ROPE:
        raise ValueError(f"head_dim {hd} (2 x rope.inv_freq's length) must be one of {sorted(RMS_ROPE)}")
    n = rope.n_weights
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(ws):
        raise ValueError(f"rope.n_weights must be an int in [1, {len(ws)}] (the next weights), got {n!r}")
    for i in range(n):
        if ws[i].shape[0] % hd:
            raise ValueError(f"weight[{i}] has {ws[i].shape[0]} rows: not whole heads of head_dim {hd}")
    if pos.device != device or inv_freq.device != device:
        raise ValueError(f"rope tensors must be on {device}")
    try:
        pos = pos.expand(lead)
    except RuntimeError:
        raise ValueError(
            f"rope.position_ids {tuple(pos.shape)} must broadcast to the tokens' shape {tuple(lead)}"
        ) from None
    pairs = rope.interleaved
    if not isinstance(pairs, bool):
        raise TypeError(f"rope.interleaved must be True or False, got {pairs!r}")
    if pairs:  # each pair's frequency twice, side by side
        freq = derived(inv_freq, "pairs", lambda: inv_freq.repeat_interleave(2))
    else:  # both halves rotate alike
        freq = derived(inv_freq, "halves", lambda: inv_freq.repeat(2))
    qk = list(rope.qk_norm_weights)
    if qk:
        if len(qk) != n:
            raise ValueError(
                f"rope.qk_norm_weights: one [head_dim] weight per rotated output ({n}), got {len(qk)}"
            )
        for i, w in enumerate(qk):
            check_tensor(f"rope.qk_norm_weights[{i}]", w)
            if w.shape != (hd,) or not w.is_floating_point() or w.device != device:
                raise ValueError(f"rope.qk_norm_weights[{i}] must be a float [{hd}] tensor on {device}, got "
                                 f"{w.dtype} {tuple(w.shape)} on {w.device}")  # fmt: skip
    eps = float(rope.qk_norm_eps)
    if qk and not finite_nonnegative(eps):
        raise ValueError(f"rope.qk_norm_eps must be a finite number >= 0, got {rope.qk_norm_eps!r}")
    return [pos.reshape(-1).contiguous(), freq, *qk], float(rope.attention_scaling), n, eps, pairs
