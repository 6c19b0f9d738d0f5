"""The widths of the decoder models codetta is tuned for, and reading them from a
Hugging Face config (a ``config.json`` path, a dict, a ``transformers`` config
object, or a hub name when ``transformers`` is installed).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Widths:
    """What the GEMMs of a Llama-family decoder layer depend on."""

    name: str
    hidden: int  # d
    intermediate: int  # f
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool = False
    qk_norm: bool = False  # per-head q/k RMSNorm before RoPE (Qwen3)
    qkv_bias: bool = False  # q, k and v projections with biases (Qwen2, Qwen2.5)
    # RoPE over part of each head (Phi-4-mini's partial_rotary_factor 0.75): q and k come out
    # of their GEMMs unrotated (the drop-in leaves the rotation to Hugging Face)
    partial_rotary: bool = False
    # RoPE in the interleaved-pairs convention (columns 2i, 2i + 1: Meta's original Llama
    # code, torchtitan); Hugging Face's models rotate halves (the default)
    rope_interleaved: bool = False

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def qkv_width(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim


# from each model's published config.json
KNOWN = {
    w.name: w
    for w in (
        Widths("llama3-1b", 2048, 8192, 32, 8, 64, 128256, tied=True),
        Widths("llama3-3b", 3072, 8192, 24, 8, 128, 128256, tied=True),
        Widths("llama3-8b", 4096, 14336, 32, 8, 128, 128256),
        Widths("llama3-70b", 8192, 28672, 64, 8, 128, 128256),
        Widths("qwen3-0.6b", 1024, 3072, 16, 8, 128, 151936, tied=True, qk_norm=True),
        Widths("qwen3-1.7b", 2048, 6144, 16, 8, 128, 151936, tied=True, qk_norm=True),
        Widths("qwen3-4b", 2560, 9728, 32, 8, 128, 151936, tied=True, qk_norm=True),
        Widths("qwen3-8b", 4096, 12288, 32, 8, 128, 151936, qk_norm=True),
        Widths("qwen3-14b", 5120, 17408, 40, 8, 128, 151936, qk_norm=True),
        Widths("qwen3-32b", 5120, 25600, 64, 8, 128, 151936, qk_norm=True),
        Widths("mistral-7b", 4096, 14336, 32, 8, 128, 32768),
        Widths("qwen2.5-0.5b", 896, 4864, 14, 2, 64, 151936, tied=True, qkv_bias=True),
        Widths("qwen2.5-1.5b", 1536, 8960, 12, 2, 128, 151936, tied=True, qkv_bias=True),
        Widths("qwen2.5-3b", 2048, 11008, 16, 2, 128, 151936, tied=True, qkv_bias=True),
        Widths("qwen2.5-7b", 3584, 18944, 28, 4, 128, 152064, qkv_bias=True),
        Widths("qwen2.5-14b", 5120, 13824, 40, 8, 128, 152064, qkv_bias=True),
        Widths("qwen2.5-32b", 5120, 27648, 40, 8, 128, 152064, qkv_bias=True),
        Widths("qwen2.5-72b", 8192, 29568, 64, 8, 128, 152064, qkv_bias=True),
        Widths("phi-4", 5120, 17920, 40, 10, 128, 100352),  # (model_type phi3)
    )
}


def widths_of(spec) -> Widths:
    """``spec``: a name in ``KNOWN``, a ``config.json`` path, a dict or a ``transformers``
    config, or a hub model name (needs ``transformers`` and the hub, or its local cache)."""
    if isinstance(spec, Widths):
        return spec
    if isinstance(spec, str) and spec.lower() in KNOWN:
        return KNOWN[spec.lower()]
    if isinstance(spec, (str, Path)) and Path(spec).is_file():
        return _from_dict(_read_config(Path(spec)), Path(spec).parent.name or str(spec))
    if isinstance(spec, (str, Path)) and (Path(spec) / "config.json").is_file():
        return _from_dict(_read_config(Path(spec) / "config.json"), Path(spec).name)
    if isinstance(spec, dict):
        return _from_dict(spec, spec.get("_name_or_path") or "config")
    if hasattr(spec, "to_dict"):
        return _from_dict(spec.to_dict(), getattr(spec, "_name_or_path", "") or type(spec).__name__)
    if isinstance(spec, str):
        problem = hub_name_problem(spec)
        if problem:  # (said now, not after the hub's retries)
            raise ValueError(f"{spec!r} is not a known model ({', '.join(KNOWN)}): {problem}")
        try:
            from transformers import AutoConfig
        except ImportError:
            raise ValueError(
                f"{spec!r} is not a known model ({', '.join(KNOWN)}) nor a config.json path; "
                "reading a hub name needs `pip install transformers`"
            ) from None
        try:
            config = AutoConfig.from_pretrained(spec)
        except OSError as exc:  # not on the hub, or the hub out of reach and not cached
            raise ValueError(
                f"{spec!r} is not a known model ({', '.join(KNOWN)}) nor a config.json path, and "
                f"Hugging Face could not give its config: {str(exc).splitlines()[0]}"
            ) from None
        return widths_of(config)
    raise TypeError(f"cannot read model widths from {type(spec).__name__}")


def hub_name_problem(spec: str) -> str | None:
    """Why ``spec``, not a file or folder here, cannot be a Hugging Face hub name (org/name),
    or None: a path (``.json``, or starting with ``.``, ``/`` or ``~``) that is not there,
    or a bare name (a mistyped known one)."""
    if Path(spec).exists():
        return None
    if spec.endswith(".json") or spec.startswith((".", "/", "~")):
        return "no such file"
    if spec.count("/") != 1:
        return "no config file or folder of that name here, nor a hub name (org/name)"
    return None


def _read_config(path: Path) -> dict:
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: not a JSON model config ({exc})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a model config (a JSON object), got a JSON {type(cfg).__name__}")
    return cfg


def _from_dict(cfg: dict, name: str) -> Widths:
    cfg = cfg.get("text_config", cfg)
    missing = [
        k for k in ("hidden_size", "intermediate_size", "num_attention_heads", "vocab_size") if k not in cfg
    ]
    if missing:
        raise ValueError(f"model config {name!r} lacks {missing}: not a Llama-family decoder config")
    biased = [k for k in ("attention_bias", "mlp_bias") if cfg.get(k)]
    if biased:  # (as apply_codetta refuses such a model: no program adds o_proj's or the MLP's bias)
        raise ValueError(
            f"model config {name!r} has {' and '.join(biased)}: codetta adds the q, k and v projections' "
            "biases only (Qwen2's), so it does not run this model"
        )
    heads = cfg["num_attention_heads"]
    return Widths(
        name=str(name),
        hidden=cfg["hidden_size"],
        intermediate=cfg["intermediate_size"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab=cfg["vocab_size"],
        tied=bool(cfg.get("tie_word_embeddings", False)),
        qk_norm=cfg.get("model_type") == "qwen3",
        qkv_bias=cfg.get("model_type") == "qwen2",
        partial_rotary=_rotary_factor(cfg) != 1.0,
    )


def _rotary_factor(cfg: dict) -> float:
    """The share of each head that RoPE turns (1.0: all of it), from a config's
    ``partial_rotary_factor``, or its ``rope_parameters`` / ``rope_scaling`` entry."""
    for source in (cfg, cfg.get("rope_parameters") or {}, cfg.get("rope_scaling") or {}):
        factor = source.get("partial_rotary_factor") if isinstance(source, dict) else None
        if factor is not None:
            return float(factor)
    return 1.0
