"""``RMSNormQKVRoPE``: an attention block's input RMSNorm, q/k/v projections, optional
per-head q/k norms and RoPE, as one module on ``codetta.ops.rmsnorm_linear``."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops import RoPE, rmsnorm_linear
from ..ops.rope import RMS_ROPE
from ._autocast import autocast_dtype, cast, stream


def _positive_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{name} must be a positive int, got {v!r}")
    return v


def _eps(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {v!r}")
    return float(v)


class RMSNormQKVRoPE(nn.Module):
    """``n = RMSNorm(x)``; ``q, k, v = n @ q_proj.T, n @ k_proj.T, n @ v_proj.T``; with
    ``qk_norm``, an RMSNorm over each head of q and k (Qwen3); RoPE on q and k (Hugging
    Face's rotate-half convention, or ``interleaved=True``: adjacent column pairs). The
    norm's scale, the q/k norms and the rotation run in the projections' GEMM epilogues
    (``codetta.ops.rmsnorm_linear``), forward and backward.

    ``forward(x [B, S, hidden], position_ids=None) -> (q, k, v)``, each [B, heads, S,
    head_dim]: transposed views of [B, S, heads * head_dim] tensors (the last dimension
    contiguous), which ``F.scaled_dot_product_attention`` takes as they are: no copy is
    made here (``scripts/sdpa_layout.py`` times SDPA on them against contiguous
    tensors). ``position_ids`` [B, S] or [S] (packed sequences: per-token
    positions); default ``arange(S)``.

    Parameters, as a Hugging Face Llama / Qwen2 / Qwen3 layer names them: ``norm`` (an
    ``nn.RMSNorm``: the layer's ``input_layernorm``), ``q_proj``, ``k_proj``, ``v_proj``
    (``nn.Linear``, with biases where ``bias=True``, as Qwen2's: added before RoPE, in the
    same epilogues; not with ``qk_norm`` or ``interleaved``), ``q_norm`` and ``k_norm``
    (``nn.RMSNorm(head_dim)``) with ``qk_norm``; with ``fused_qkv=True`` one ``qkv_proj``
    (q's rows, then k's, then v's) instead of the three, its row blocks used in place
    (views: no per-step copy, and their gradients land in ``qkv_proj.weight``). The
    rotation's frequencies are the buffer ``inv_freq`` (``rope_theta ** (-2i /
    head_dim)``; give ``inv_freq`` for a scaled rope, e.g. Llama 3's, and its
    ``attention_scaling``)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope_theta: float = 10000.0, eps: float = 1e-6, qk_norm: bool = False,
                 qk_norm_eps: float | None = None, interleaved: bool = False,
                 inv_freq: torch.Tensor | None = None, attention_scaling: float = 1.0,
                 fused_qkv: bool = False, bias: bool = False, device=None, dtype=None):  # fmt: skip
        super().__init__()
        sizes = {"hidden_size": hidden_size, "num_heads": num_heads, "num_kv_heads": num_kv_heads,
                 "head_dim": head_dim}  # fmt: skip
        for name, v in sizes.items():
            _positive_int(name, v)
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if head_dim % 2:
            raise ValueError(f"head_dim must be even (RoPE rotates pairs of columns), got {head_dim}")
        if head_dim not in RMS_ROPE:
            raise ValueError(f"head_dim must be one of {sorted(RMS_ROPE)} (the RoPE programs'), "
                             f"got {head_dim}")  # fmt: skip
        if not all(isinstance(f, bool) for f in (interleaved, qk_norm, fused_qkv, bias)):
            raise TypeError("qk_norm, interleaved, fused_qkv and bias must be True or False")
        if bias and (qk_norm or interleaved):
            raise ValueError("bias=True: not with qk_norm or interleaved (no program adds a bias there)")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.interleaved, self.attention_scaling = interleaved, float(attention_scaling)
        eps = _eps("eps", eps)
        qk_eps = eps if qk_norm_eps is None else _eps("qk_norm_eps", qk_norm_eps)
        kw = {"device": device, "dtype": dtype}
        self.eps, self.qk_eps = eps, qk_eps
        self.norm = nn.RMSNorm(hidden_size, eps=eps, device=device)
        self.widths = (num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim)
        if fused_qkv:
            self.qkv_proj = nn.Linear(hidden_size, sum(self.widths), bias=bias, **kw)
        else:
            self.q_proj = nn.Linear(hidden_size, self.widths[0], bias=bias, **kw)
            self.k_proj = nn.Linear(hidden_size, self.widths[1], bias=bias, **kw)
            self.v_proj = nn.Linear(hidden_size, self.widths[2], bias=bias, **kw)
        self.q_norm = nn.RMSNorm(head_dim, eps=qk_eps, **kw) if qk_norm else None
        self.k_norm = nn.RMSNorm(head_dim, eps=qk_eps, **kw) if qk_norm else None
        self.rope_theta = float(rope_theta)
        # (the frequencies as given, on the host: ``to_empty`` from the meta device makes them
        # again from these, or from rope_theta: a buffer outside the state_dict holds no values
        # there, and load_state_dict would not give it any)
        self._inv_freq_given = None
        if inv_freq is not None:
            if inv_freq.shape != (head_dim // 2,):
                raise ValueError(f"inv_freq must have shape ({head_dim // 2},), got {tuple(inv_freq.shape)}")
            if inv_freq.is_meta:
                raise ValueError("inv_freq is on the meta device: give its values (the module may be "
                                 "made there; to_empty makes its frequencies again)")  # fmt: skip
            self._inv_freq_given = inv_freq.detach().to("cpu", torch.float32).clone()
        if inv_freq is not None and device is None and torch.get_default_device().type == "meta":
            device = "meta"  # (made under ``with torch.device("meta")``: the frequencies too)
        f32 = torch.float32
        freqs = self._frequencies(device) if inv_freq is None else inv_freq.to(device=device, dtype=f32)
        self.register_buffer("inv_freq", freqs, persistent=False)

    def _frequencies(self, device) -> torch.Tensor:
        """inv_freq as made: as given, else ``rope_theta ** (-2i / head_dim)``, float32."""
        if self._inv_freq_given is not None:
            return self._inv_freq_given.to(device)
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.rope_theta**steps)

    @classmethod
    def from_layer(cls, layer: nn.Module, rotary_emb: nn.Module) -> RMSNormQKVRoPE:
        """The module over a Hugging Face Llama / Qwen2 / Qwen3 / Mistral decoder layer's own
        ``input_layernorm`` and ``self_attn`` projections (their biases, and q/k norms), shared, not
        copied, with the model's ``rotary_emb`` (also shared: its frequencies and attention
        scaling are read at each call, so a device move or an in-place change follows).
        Rotate-half, as those models rotate. Rope types whose frequencies depend on the
        sequence length ("dynamic", "longrope") are refused: the rotary module changes
        them in its own forward, which this module does not call."""
        attn, norm = getattr(layer, "self_attn", None), getattr(layer, "input_layernorm", None)
        projs = [getattr(attn, n, None) for n in ("q_proj", "k_proj", "v_proj")]
        if norm is None or not all(isinstance(p, nn.Linear) for p in projs):
            raise TypeError("from_layer needs a decoder layer with input_layernorm and self_attn's "
                            "q_proj, k_proj, v_proj (nn.Linear)")  # fmt: skip
        inv_freq = getattr(rotary_emb, "inv_freq", None)
        if inv_freq is None:
            raise TypeError("from_layer needs the model's rotary embedding (a module with inv_freq)")
        rope_type = str(getattr(rotary_emb, "rope_type", "default"))
        if "dynamic" in rope_type or "longrope" in rope_type:
            raise ValueError(f"rope_type {rope_type!r} sets its frequencies per sequence length in the "
                             "rotary module's forward: not supported here (the Hugging Face drop-in, "
                             "codetta.apply_codetta, reads them after that forward)")  # fmt: skip
        hd = 2 * inv_freq.shape[0]
        if getattr(attn, "head_dim", hd) != hd:
            raise ValueError(f"the rotary embedding rotates {hd} of each head's {attn.head_dim} columns "
                             "(partial rotary): not supported")  # fmt: skip
        qk_norm = getattr(attn, "q_norm", None) is not None
        if qk_norm and any(p.bias is not None for p in projs):
            raise ValueError("q, k and v biases with per-head q/k norms: not supported")

        def eps_of(m):
            for name in ("variance_epsilon", "eps"):
                if getattr(m, name, None) is not None:
                    return _eps(f"{type(m).__name__}.{name}", getattr(m, name))
            raise TypeError(f"{type(m).__name__} has no epsilon (variance_epsilon or eps)")

        new = cls.__new__(cls)
        nn.Module.__init__(new)
        new.num_heads, new.num_kv_heads = projs[0].out_features // hd, projs[1].out_features // hd
        new.head_dim = hd
        new.interleaved = False
        new.eps, new.qk_eps = eps_of(norm), eps_of(attn.q_norm) if qk_norm else 1e-6
        if qk_norm and eps_of(attn.k_norm) != new.qk_eps:
            raise ValueError("q_norm and k_norm have different epsilons: not supported")
        new.widths = tuple(p.out_features for p in projs)
        new.norm, (new.q_proj, new.k_proj, new.v_proj) = norm, projs
        new.q_norm, new.k_norm = (attn.q_norm, attn.k_norm) if qk_norm else (None, None)
        new.rotary_emb = rotary_emb
        return new

    def _apply(self, fn, recurse=True):
        # inv_freq stays float32 at its own precision under .half() / .to(dtype) (a device
        # move moves it): the rotation's angles are formed in float32 from it; moved off the
        # meta device (``to_empty``), it is made again (it holds no values there)
        inv = self._buffers.get("inv_freq")
        out = super()._apply(fn, recurse)
        moved = self._buffers.get("inv_freq")
        if inv is not None and moved is not None:
            if inv.is_meta and not moved.is_meta:
                self._buffers["inv_freq"] = self._frequencies(moved.device)
            elif moved.dtype != torch.float32:
                self._buffers["inv_freq"] = inv.to(device=moved.device)
        return out

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None):
        if x.dim() != 3 or x.shape[-1] != self.norm.weight.shape[0]:
            raise ValueError(
                f"x must be [batch, seq, hidden] with hidden {self.norm.weight.shape[0]} (this module's), "
                f"got shape {tuple(x.shape)}"
            )
        B, S, _ = x.shape
        if position_ids is None:
            position_ids = torch.arange(S, device=x.device)
        qk = (self.q_norm.weight, self.k_norm.weight) if self.q_norm is not None else ()
        fields = {"qk_norm_weights": qk, "qk_norm_eps": self.qk_eps, "interleaved": self.interleaved}
        rotary = self._modules.get("rotary_emb")  # (from_layer: the model's, read as it is now)
        if rotary is not None:
            rope = RoPE.of_rotary(rotary, position_ids, **fields)
        else:
            rope = RoPE(position_ids, self.inv_freq, self.attention_scaling, **fields)
        if hasattr(self, "qkv_proj"):
            ws = list(self.qkv_proj.weight.split(self.widths))
        else:
            ws = [self.q_proj.weight, self.k_proj.weight, self.v_proj.weight]
        gamma, bias, dtype = self.norm.weight, self._bias(), autocast_dtype(x)
        if dtype is not None:
            # under torch.autocast: the projections in its dtype, as nn.Linear's; x and the
            # norms' weights as they are (float32: the operator's mixed precision)
            ws = [cast(w, dtype) for w in ws]
            x, gamma = stream(x, dtype), stream(gamma, dtype)
            bias = None if bias is None else [b if b is None else stream(b, dtype) for b in bias]
        q, k, v = rmsnorm_linear(x, gamma, ws, self.eps, rope=rope, bias=bias)
        # (heads from the width: a view cannot infer -1 of an empty batch)
        hd = self.head_dim
        return tuple(t.view(B, S, t.shape[-1] // hd, hd).transpose(1, 2) for t in (q, k, v))

    def _bias(self) -> tuple | None:
        """The q, k and v biases (an entry None for one without), or None where none has one."""
        if hasattr(self, "qkv_proj"):
            b = self.qkv_proj.bias
            return None if b is None else tuple(b.split(self.widths))
        bs = (self.q_proj.bias, self.k_proj.bias, self.v_proj.bias)
        return None if all(b is None for b in bs) else bs

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"qk_norm={self.q_norm is not None}, interleaved={self.interleaved}, "
                f"bias={self._bias() is not None}")  # fmt: skip
