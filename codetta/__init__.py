"""codetta: Transformer blocks as GEMM + epilogue programs, on Triton."""

from . import nn, ops  # noqa: E402
from ._version import __version__
from .kernels.configs import Config  # noqa: E402
from .kernels.device import interpreting  # noqa: E402
from .kernels.launch import gemm  # noqa: E402
from .kernels.precompile import precompile  # noqa: E402
from .kernels.program import (  # noqa: E402
    ColSum,
    DType,
    HalfTile,
    Kind,
    KPart,
    PairedWeight,
    PerCol,
    PerRow,
    Program,
    RowLogSumExp,
    RowPick,
    RowSum,
    RowTable,
    Scalar,
    Tile,
    with_k_parts,
    with_n_parts,
)


def apply_codetta(model, *, autocast: str | None = None):
    """Run a Hugging Face Llama / Qwen2 / Qwen3 / Mistral / Phi-3 causal LM's training forward through
    codetta (picked by ``model.config.model_type``; ``codetta.integrations.hf``).
    ``autocast``: what this model does under ``torch.autocast`` to another dtype than its
    parameters' (Hugging Face Trainer's ``bf16=True``): ``"own-forward"`` or ``"cast"``
    (docs/huggingface.md, "Mixed precision"); None: the ``CODETTA_AUTOCAST`` setting."""
    from .integrations import hf

    return hf.apply_codetta(model, autocast=autocast)


def apply_codetta_to_llama(model=None, *, autocast: str | None = None):
    """Patch ``LlamaForCausalLM`` (class-wide when ``model`` is None, else that instance;
    ``autocast`` as in ``apply_codetta``, an instance only)."""
    from .integrations import hf

    return hf.apply("llama", model, autocast)


def apply_codetta_to_qwen2(model=None, *, autocast: str | None = None):
    """Patch ``Qwen2ForCausalLM`` (Qwen2 and Qwen2.5: q, k and v biases, added in their
    GEMMs' epilogues; class-wide when ``model`` is None, else that instance; ``autocast``
    as in ``apply_codetta``, an instance only)."""
    from .integrations import hf

    return hf.apply("qwen2", model, autocast)


def apply_codetta_to_qwen3(model=None, *, autocast: str | None = None):
    """Patch ``Qwen3ForCausalLM`` (class-wide when ``model`` is None, else that instance;
    ``autocast`` as in ``apply_codetta``, an instance only)."""
    from .integrations import hf

    return hf.apply("qwen3", model, autocast)


def apply_codetta_to_mistral(model=None, *, autocast: str | None = None):
    """Patch ``MistralForCausalLM`` (class-wide when ``model`` is None, else that instance;
    ``autocast`` as in ``apply_codetta``, an instance only)."""
    from .integrations import hf

    return hf.apply("mistral", model, autocast)


def apply_codetta_to_phi3(model=None, *, autocast: str | None = None):
    """Patch ``Phi3ForCausalLM`` (Phi-3, Phi-4: the fused qkv_proj and gate_up_proj read in
    place as row blocks; class-wide when ``model`` is None, else that instance; ``autocast``
    as in ``apply_codetta``, an instance only)."""
    from .integrations import hf

    return hf.apply("phi3", model, autocast)


def revert(model=None):
    """Restore the original forward of ``model`` (and its class, if patched class-wide);
    ``model=None``: every class-wide patch."""
    from .integrations import hf

    return hf.revert(model)


__all__ = [
    "apply_codetta",
    "apply_codetta_to_llama",
    "apply_codetta_to_qwen2",
    "apply_codetta_to_qwen3",
    "apply_codetta_to_mistral",
    "apply_codetta_to_phi3",
    "revert",
    "gemm",
    "precompile",
    "interpreting",
    "Program",
    "Tile",
    "HalfTile",
    "PerRow",
    "PerCol",
    "Scalar",
    "DType",
    "RowTable",
    "PairedWeight",
    "KPart",
    "with_k_parts",
    "with_n_parts",
    "RowSum",
    "RowLogSumExp",
    "RowPick",
    "ColSum",
    "Kind",
    "Config",
    "nn",
    "ops",
    "__version__",
]
