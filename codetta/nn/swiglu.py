"""``SwiGLUMLP``: a Llama-family MLP (gate_proj, up_proj, down_proj) on codetta's SwiGLU operator."""

from __future__ import annotations

import torch
from torch import nn

from ..ops.swiglu import swiglu_mlp
from ._autocast import autocast_dtype, cast


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))`` (``+ residual`` if given) through
    ``codetta.ops.swiglu_mlp``: the same parameters and ``state_dict`` keys as a Hugging
    Face ``LlamaMLP`` (``gate_proj``, ``up_proj``, ``down_proj``; no biases).
    ``SwiGLUMLP.from_mlp(mlp)`` wraps an existing MLP's projections (shared, not copied)."""

    def __init__(self, hidden_size: int, intermediate_size: int, device=None, dtype=None):
        super().__init__()
        kw = {"bias": False, "device": device, "dtype": dtype}
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, **kw)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, **kw)

    @classmethod
    def from_mlp(cls, mlp: nn.Module) -> SwiGLUMLP:
        """A SwiGLUMLP over ``mlp``'s own ``gate_proj``, ``up_proj`` and ``down_proj`` (its
        activation, the module ``act_fn`` or Phi-3's ``activation_fn``, must be SiLU: an MLP
        without one, whose forward may apply any function, is refused; projections without
        biases)."""
        act = getattr(mlp, "act_fn", None)
        act = getattr(mlp, "activation_fn", None) if act is None else act  # (Phi-3's name)
        hf_silu = (type(act).__module__, type(act).__name__) == ("transformers.activations", "SiLUActivation")
        if act is None and not isinstance(mlp, SwiGLUMLP):
            raise ValueError(
                f"SwiGLUMLP computes silu(gate) * up; this {type(mlp).__name__} has no act_fn (or "
                "activation_fn) module to show its activation is SiLU: give it act_fn = nn.SiLU(), "
                "or make a SwiGLUMLP and load the MLP's state_dict into it"
            )
        if act is not None and not (isinstance(act, nn.SiLU) or hf_silu):
            raise ValueError(f"SwiGLUMLP computes silu(gate) * up; this MLP's activation is {act!r}")
        projs = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
        if not all(isinstance(p, nn.Linear) for p in projs):
            raise TypeError("from_mlp needs an MLP with nn.Linear gate_proj, up_proj and down_proj")
        if any(p.bias is not None for p in projs):
            raise ValueError("SwiGLUMLP's projections have no biases (mlp_bias=True is not supported)")
        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.gate_proj, new.up_proj, new.down_proj = projs
        return new

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        ws = (self.gate_proj.weight, self.up_proj.weight, self.down_proj.weight)
        dtype = autocast_dtype(x)
        if dtype is not None:  # (under torch.autocast: the products in its dtype, as nn.Linear's)
            x, ws = cast(x, dtype), [cast(w, dtype) for w in ws]
            if residual is not None and residual.dtype != dtype:
                # (the add in PyTorch's promotion, as residual + mlp(x) is under autocast)
                return residual + swiglu_mlp(x, *ws)
        return swiglu_mlp(x, *ws, residual)
