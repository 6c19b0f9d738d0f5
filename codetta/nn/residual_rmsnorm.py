"""``ResidualRMSNormLinear``: o-proj GEMM + residual + RMSNorm + next GEMM as one module."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops import residual_rmsnorm_linear
from ._autocast import autocast_dtype, cast, stream


class ResidualRMSNormLinear(nn.Module):
    """``x = residual + y @ proj.T``;  ``z = RMSNorm(x) @ weight.T``;  ``forward(y, residual) -> (x, z)``.

    The parameters are those of ``nn.Linear(in_features, hidden, bias=False)``
    (``proj``), ``nn.RMSNorm(hidden, eps)`` (``norm_weight``) and
    ``nn.Linear(hidden, out_features, bias=False)`` (``weight``), so existing
    weights load by copying. ``norm_dtype`` may be float32 (default) or the
    activation dtype.
    """

    def __init__(self, in_features, hidden, out_features, eps=None, device=None, dtype=None, norm_dtype=None):
        super().__init__()
        if eps is not None and (isinstance(eps, bool) or not isinstance(eps, (int, float)) or eps < 0
                                or not math.isfinite(eps)):  # fmt: skip
            raise ValueError(f"eps must be a finite number >= 0 or None, got {eps!r}")
        # (float32, or the activations' dtype: that may come with a cast after, .half(), so
        # the forward checks the match)
        if norm_dtype not in (None, torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"norm_dtype must be float32, bfloat16 or float16 (or None), got {norm_dtype}")
        kw = {"device": device, "dtype": dtype}
        self.eps = eps
        self.proj = nn.Parameter(torch.empty(hidden, in_features, **kw))
        self.norm_weight = nn.Parameter(torch.empty(hidden, device=device, dtype=norm_dtype or torch.float32))
        self.weight = nn.Parameter(torch.empty(out_features, hidden, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """The initial values (as nn.Linear's and nn.RMSNorm's): made at construction, and
        for a module made on the meta device after ``to_empty``."""
        nn.init.kaiming_uniform_(self.proj, a=math.sqrt(5))
        nn.init.ones_(self.norm_weight)
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, y: torch.Tensor, residual: torch.Tensor):
        proj, gamma, weight = self.proj, self.norm_weight, self.weight
        dtype = autocast_dtype(y)
        if dtype is not None:
            # under torch.autocast: the GEMMs in its dtype, as nn.Linear's; the residual stream
            # and the norm's weight as they are (float32: the operator's mixed precision)
            y, proj, weight = cast(y, dtype), cast(proj, dtype), cast(weight, dtype)
            residual, gamma = stream(residual, dtype), stream(gamma, dtype)
        return residual_rmsnorm_linear(y, proj, residual, gamma, weight, self.eps)

    def extra_repr(self) -> str:
        h, k = self.proj.shape
        return f"in_features={k}, hidden={h}, out_features={self.weight.shape[0]}, eps={self.eps}"
