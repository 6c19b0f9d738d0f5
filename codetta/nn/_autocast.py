"""The modules under ``torch.autocast``: their GEMMs' operands in autocast's dtype, as
``nn.Linear``'s are (a float32 model trained under autocast, Hugging Face Trainer's
``bf16=True``); the operators themselves take dtypes as they come."""

from __future__ import annotations

import torch


def autocast_dtype(x: torch.Tensor) -> torch.dtype | None:
    """The dtype autocast runs matrix products in on x's device, or None where it is off."""
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return None
    return torch.get_autocast_dtype(device)


def cast(t: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """``t`` in ``dtype`` where it is a floating tensor in another (a differentiable cast:
    the gradient reaches a float32 parameter in float32), else as it is."""
    if t is None or t.dtype == dtype or not t.is_floating_point():
        return t
    return t.to(dtype)


def stream(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A residual stream or norm weight beside GEMMs in ``dtype``: as it is in float32 or
    ``dtype`` (the operators' mixed precision), else promoted to float32."""
    return t if t.dtype in (torch.float32, dtype) else t.float()
