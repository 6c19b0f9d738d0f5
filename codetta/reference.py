"""Readable PyTorch references: the test oracle and the documentation of the math.

Nothing here imports the rest of codetta. Functions take and return float
tensors; callers choose the precision (the tests use float64).
"""

import torch


def round_to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to ``dtype`` and back to x's dtype (what a store then load does)."""
    return x.to(dtype).to(x.dtype)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each adjacent column pair (a, b) of row m by the angle with cos[m], sin[m]."""
    a, b = x[:, 0::2], x[:, 1::2]
    c, s = cos[:, None], sin[:, None]
    out = torch.empty_like(x)
    out[:, 0::2] = a * c - b * s
    out[:, 1::2] = b * c + a * s
    return out


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float) -> torch.Tensor:
    """n = x * rsqrt(mean(x^2) + eps) * gamma, over the last dimension."""
    r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x * r * gamma


def residual_rms_chain(y, w, residual, gamma):
    """The unfused K1 chain: x = residual + y @ w.T;  h = x * gamma;  sumsq = sum x^2 per row."""
    x = residual + y @ w.t()
    return x, x * gamma, (x * x).sum(-1)
