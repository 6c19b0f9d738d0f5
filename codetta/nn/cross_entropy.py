"""``LinearCrossEntropyLoss``: the module form of ``codetta.ops.linear_cross_entropy``."""

from __future__ import annotations

import torch

from ..ops.cross_entropy import check_options, linear_cross_entropy
from ._autocast import autocast_dtype, cast


class LinearCrossEntropyLoss(torch.nn.Module):
    """``loss = LinearCrossEntropyLoss(...)(input, linear_weight, target, linear_bias=None,
    row_scale=None)``: the LM head and its cross-entropy without fp32 logits (options as
    ``codetta.ops.linear_cross_entropy``; ``weight``: class weights, a buffer). Under
    ``torch.autocast`` the input, weight and bias in autocast's dtype and the loss in float32,
    as ``F.cross_entropy(F.linear(...))`` there."""

    def __init__(self, weight=None, *, reduction="mean", ignore_index=-100, label_smoothing=0.0, z_loss=0.0,
                 softcap=None, return_lse=False, vocab_chunk=None):  # fmt: skip
        super().__init__()
        check_options(reduction, label_smoothing, z_loss, softcap, vocab_chunk)
        self.register_buffer("weight", weight)
        self.reduction, self.ignore_index, self.label_smoothing = reduction, ignore_index, label_smoothing
        self.z_loss, self.softcap, self.return_lse = z_loss, softcap, return_lse
        self.vocab_chunk = vocab_chunk

    def forward(self, input, linear_weight, target, linear_bias=None, row_scale=None):
        loss_dtype = None
        dtype = autocast_dtype(input)
        if dtype is not None:  # (under torch.autocast: the head's product in its dtype, as nn.Linear's,
            # the loss in float32, as autocast's cross_entropy gives it)
            input, linear_weight, linear_bias = (cast(t, dtype) for t in (input, linear_weight, linear_bias))
            loss_dtype = torch.float32
        return linear_cross_entropy(
            input, linear_weight, target, linear_bias=linear_bias, row_scale=row_scale, weight=self.weight,
            reduction=self.reduction, ignore_index=self.ignore_index, label_smoothing=self.label_smoothing,
            z_loss=self.z_loss, softcap=self.softcap, return_lse=self.return_lse,
            vocab_chunk=self.vocab_chunk, loss_dtype=loss_dtype,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"reduction={self.reduction!r}, ignore_index={self.ignore_index}, "
            f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}, softcap={self.softcap}"
            + (f", vocab_chunk={self.vocab_chunk}" if self.vocab_chunk else "")
            + (", return_lse=True" if self.return_lse else "")
        )
