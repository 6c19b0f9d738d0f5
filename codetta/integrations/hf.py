"""Hugging Face ``transformers`` (4.53 on) drop-in: Llama, Qwen2, Qwen3, Mistral and Phi-3
causal LMs on codetta.

The patched forward moves each RMSNorm to the GEMM that consumes it (docs/design.md,
"the shifted layer boundary"): the attention output projection adds the residual
and produces the post-attention norm's statistics in its epilogue, and the norm's
scale lands in the gate and up projections, which run as one GEMM whose epilogue
forms SwiGLU (``codetta.ops.residual_rmsnorm_swiglu``); the down projection does
the same for the next layer's input norm and its q, k, v projections, and its
backward forms the SwiGLU gradients in its dX epilogue; the last layer's down
projection does it for the final norm and the LM head. One operator does each
step (``codetta.ops.residual_rmsnorm_linear``, with the next weights as they are:
no concatenation, no copies). Attention itself stays Hugging Face's: its
configured implementation (SDPA, FlashAttention, eager), masks (padding, packed
sequences through ``position_ids``, sliding windows) and rotary embeddings. The
first layer's input norm has no GEMM before it: one row pass writes its statistics
(``codetta.ops.rmsnorm_linear``); every layer's q and k come out of their GEMMs
rotated (RoPE in the epilogue, after Qwen3's per-head q/k norms or Qwen2's q/k/v
biases, also in the epilogue) where the head dim has a RoPE program; training with labels, the
final norm's output goes to the fused LM head + loss (``codetta.ops.linear_cross_entropy``)
as its two factors, K1's h and the norm's rstd, which the logits GEMM's epilogue applies
(``residual_rmsnorm_factors``; in float16 or with ``CODETTA_CE_NORM_FACTORS=0``, n formed
by one pass after K1); with tied embeddings (a plain
``nn.Embedding``, no FSDP2) the lookup goes through ``codetta.ops.tied_embedding`` so
the table's whole gradient is formed in one pass, and an untied one through
``codetta.ops.embedding`` (its gradient in one pass too). Activations other than
SiLU run the gate/up GEMMs on codetta and the product in PyTorch.

Falls back to the model's own forward (same results, no codetta) where the fused
path does not apply: a KV cache in use (generation), ``use_cache=True`` (or, in eval
mode, not passed while ``config.use_cache`` is on), requested hidden states or
attentions (passed, or on the config), ``logits_to_keep``, a ``loss_function`` other than Hugging
Face's causal-LM cross-entropy (training with labels), FSDP1 wrapping the decoder layers
(FSDP2's ``fully_shard`` is served), float32 parameters on the GPU outside autocast,
float64 parameters, hooks added after the model was patched (``unsupported``),
``torch.autocast`` to another dtype than the parameters' when asked for
(``autocast="own-forward"`` or ``CODETTA_AUTOCAST=own-forward``; by default the fused path
runs there on the projections cast to autocast's dtype over a float32 residual stream,
as autocast itself keeps it),
and under class-wide patching a model with biases on projections other than q, k and v
(``attention_bias`` puts one on o_proj too; ``mlp_bias``), widths that are not
multiples of 16 bytes, projections that are not plain hook-free ``nn.Linear`` modules (PEFT's
LoRA layers, quantized layers: the fused path reads their weights and never calls their
forwards), non-contiguous projection weights, modules whose math the fused forward
computes itself (decoder layers, attention, MLP, norms, the rotary embedding) of
another class than the family's, or hooks
other than FSDP2's on the base model, the final norm, the rotary embedding or a decoder
layer's modules (they would not run). An activation module other than SiLU runs as a
module on codetta's gate and up projections.
Patching such an instance raises, naming why; a projection replaced or hooked after the
model was patched stops the fused forward with the reason. The vocabulary may be any size: the loss pads its
logits rows, and without labels an odd vocabulary's LM head runs in PyTorch after
codetta's final norm. Hugging Face's gradient checkpointing
(``model.gradient_checkpointing_enable()``) recomputes one unit per layer in the
backward, on the shifted boundary: from a layer's q, k, v (and the residual stream) to
the next layer's (under FSDP2 too: its hooks skip the recomputation's own forward
calls, their modules being in their backward then); torch.distributed's per-block checkpoint
wrappers raise (the fused forward never calls the layers' forwards they wrap).
Parameters, ``state_dict`` and optimizer state are untouched. A patched model is
marked by an attribute that the class's forward reads (``_dispatching``: a subclass's own
forward runs around codetta's), so its copies, ``nn.DataParallel``'s replicas and a
pickled one loaded in a process that has patched a model of its class run patched;
``revert`` removes the mark.
"""

from __future__ import annotations

import inspect
import sys
import warnings
import weakref

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..kernels.settings import AUTOCAST_MODES, SETTINGS
from ..ops.cross_entropy import linear_cross_entropy
from ..ops.residual_rmsnorm import (
    residual_rmsnorm,
    residual_rmsnorm_factors,
    residual_rmsnorm_linear,
    residual_rmsnorm_swiglu,
    rmsnorm_linear,
)
from ..ops.rope import RoPE
from ..ops.tied_embedding import TiedLink, embedding, tied_embedding
from ..programs.rope import RMS_ROPE
from .fsdp import Spans

try:  # the composable APIs applied to a module (torch.distributed's activation checkpointing)
    from torch.distributed._composable.contract import _get_registry as _composable_registry
except ImportError:  # torch built without distributed

    def _composable_registry(module):
        return None


FAMILIES = {
    "llama": ("transformers.models.llama.modeling_llama", "LlamaForCausalLM"),
    "qwen2": ("transformers.models.qwen2.modeling_qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("transformers.models.qwen3.modeling_qwen3", "Qwen3ForCausalLM"),
    "mistral": ("transformers.models.mistral.modeling_mistral", "MistralForCausalLM"),
    # (Phi-3 / Phi-4: one qkv_proj and one gate_up_proj, whose row blocks the GEMMs read in
    # place; residual dropouts, which the fused residual adds cannot apply, must be off)
    "phi3": ("transformers.models.phi3.modeling_phi3", "Phi3ForCausalLM"),
}
# class -> its own forward, where codetta's dispatching forward (``_dispatching``) replaced
# it: once any model of the class is patched, then kept (it runs the class's own forward for
# a model not patched). A patched model is marked by ``_codetta_patched`` on the instance,
# a class patched class-wide by the same on the class: a plain attribute, which pickling,
# copies and ``nn.DataParallel``'s replicas carry (a bound method on the instance named
# the original model in each)
_ORIGINAL: dict = {}
_HELPERS: dict = {}  # modeling module name -> (apply_rotary_pos_emb, eager_attention_forward)
_FALLBACK_WARNED: set = set()
# model -> [(parameter dtype, device), static verdict, watched modules, hook count, verdict] (``unsupported``)
_UNSUPPORTED = weakref.WeakKeyDictionary()


def _causal_lm_class(family: str):
    import importlib

    module, name = FAMILIES[family]
    try:
        importlib.import_module("transformers.masking_utils")  # (4.53 on: the mask builders)
        mod = importlib.import_module(module)
        # looked up here, not in the forward: torch.compile cannot trace an import
        _HELPERS[module] = (mod.apply_rotary_pos_emb, mod.eager_attention_forward)
        return getattr(mod, name)
    except ImportError as exc:
        raise ImportError(
            f"codetta's {family} drop-in needs transformers >= 4.53: pip install 'codetta[hf]' ({exc})"
        ) from None


def _original_forward(model):
    # through the class's bases: FSDP2 and others swap in a subclass of the model's class
    for cls in type(model).__mro__:
        if cls in _ORIGINAL:
            return _ORIGINAL[cls]
    return type(model).forward


def _dispatching(cls):
    """Install on ``cls`` a forward that runs codetta's for a patched model (or every model,
    the class patched class-wide) and the class's own otherwise: once, and again where
    another forward replaced it since (another library's class-wide patch: that forward is
    then the one a model not patched runs; the fused forward's fallbacks run the class's
    first, ``_ORIGINAL``). Its signature is the original's (Trainer keeps
    the dataset columns a forward names; no ``__wrapped__``, which accelerate's unwrapping
    follows past it); a subclass's own forward that calls ``super().forward`` runs around
    codetta's."""
    current = cls.__dict__["forward"]
    if getattr(current, "_codetta_dispatch", False):
        return
    # (the fallbacks keep the class's first forward: a wrapper installed over the first
    # dispatching forward calls it, which would come back to codetta's)
    original = current
    _ORIGINAL.setdefault(cls, current)

    def forward(self, *args, **kwargs):
        if getattr(self, "_codetta_patched", False):
            return _codetta_forward(self, *args, **kwargs)
        return original(self, *args, **kwargs)

    for name in ("__module__", "__name__", "__qualname__", "__doc__"):
        setattr(forward, name, getattr(original, name, None))
    forward.__signature__ = inspect.signature(original)
    forward._codetta_dispatch = True
    cls.forward = forward


def apply(family: str, model=None, autocast: str | None = None):
    """Patch ``family``'s causal LM class (``model=None``) or one model instance;
    ``autocast`` (an instance only): its own ``CODETTA_AUTOCAST``, None for the setting's."""
    if family not in FAMILIES:
        raise ValueError(f"codetta has no drop-in for {family!r}; supported: {sorted(FAMILIES)}")
    cls = _causal_lm_class(family)
    _read_mask_params()
    if autocast is not None:
        if autocast not in AUTOCAST_MODES:
            raise ValueError(f"autocast must be one of {', '.join(AUTOCAST_MODES)}, got {autocast!r}")
        if model is None:
            raise ValueError("autocast= is per model: class-wide patching follows CODETTA_AUTOCAST")
    if model is None:
        _dispatching(cls)
        cls._codetta_patched = True
        return None
    if not isinstance(model, cls):
        kind = getattr(getattr(model, "config", None), "model_type", None)
        raise TypeError(
            f"{'apply_codetta' if kind == family else f'apply_codetta_to_{family}'} expects a "
            f"{cls.__name__}, got {type(model).__name__}"
            + (
                f" (model_type {kind!r}: use codetta.apply_codetta)"
                if kind in FAMILIES and kind != family
                else " (codetta patches the causal LM, whose forward ends in the LM head and the loss)"
            )  # fmt: skip
        )
    wrapped = vars(model).get("forward")
    if wrapped is not None and not vars(model).get("_codetta_patched"):
        # (accelerate's mixed precision, as Hugging Face Trainer prepares a model, wraps the
        # forward in autocast on the instance: patching over it would drop the autocast)
        raise ValueError(
            f"codetta: this {cls.__name__}'s forward was already replaced on the instance "
            f"({getattr(wrapped, '__qualname__', type(wrapped).__name__)}: accelerate's mixed "
            "precision or another wrapper); patching it would drop that wrapper. Patch the model "
            "before it is wrapped (before Trainer.train() or accelerate's prepare)"
        )
    misaligned = _misaligned(model)
    if misaligned:
        # (parameters copied only where the model is otherwise served)
        static, _ = _static_problem(model, alignment=False)
        if static:
            raise ValueError(f"codetta cannot run this {cls.__name__}: {static}")
        _realign(misaligned)
        _UNSUPPORTED.pop(model, None)  # (a verdict made before, under a class-wide patch)
    why = unsupported(model)
    if why:
        raise ValueError(f"codetta cannot run this {cls.__name__}: {why}")
    _dispatching(cls)
    model._codetta_patched = True
    own = type(model).forward
    if not getattr(own, "_codetta_dispatch", False) and (type(model), "forward") not in _FALLBACK_WARNED:
        _FALLBACK_WARNED.add((type(model), "forward"))
        warnings.warn(
            f"codetta: {type(model).__name__} has its own forward ({own.__qualname__}): codetta's "
            f"fused forward runs where it calls {cls.__name__}.forward (super().forward), and "
            "nowhere else",
            stacklevel=3,
        )
    if autocast is not None:
        model._codetta_autocast = autocast
    return model


def apply_codetta(model, autocast: str | None = None):
    """Patch a supported model instance, picked by ``model.config.model_type``."""
    kind = getattr(getattr(model, "config", None), "model_type", None)
    if kind not in FAMILIES:
        raise ValueError(
            f"codetta does not support model type {kind!r} ({type(model).__name__}); supported: "
            f"{', '.join(sorted(FAMILIES))} causal LMs"
        )
    return apply(kind, model, autocast)


def _autocast_mode(model) -> str:
    """The model's own ``apply_codetta(autocast=...)``, else ``CODETTA_AUTOCAST``."""
    return getattr(model, "_codetta_autocast", None) or SETTINGS.autocast


def revert(model=None):
    """Undo ``apply``: the instance's own patch and, for a class patched class-wide, the
    class's (every instance of it); ``model=None`` reverts every class-wide patch. (The
    class keeps codetta's dispatching forward, which runs its own forward for a model not
    patched.)"""
    classes = list(_ORIGINAL) if model is None else type(model).__mro__
    if model is not None:
        vars(model).pop("_codetta_patched", None)
        vars(model).pop("_codetta_autocast", None)
    for cls in classes:
        if "_codetta_patched" in cls.__dict__:
            del cls._codetta_patched
    return model


def unsupported(model) -> str | None:
    """Why the fused forward cannot run this model (None: it can). Worked out once per
    model and its parameters' dtype and device (every forward asks; a model may be cast
    or moved after it is patched); the modules' hooks are looked at again whenever a hook was registered
    through PyTorch's hook API anywhere since (its count of hook handles moved: under
    FSDP2 every forward, which registers tensor hooks; ~5 us a layer), from a weakly held
    list made with the verdict, and at every call while some are in the way (a removal
    moves no count). Not seen after patching: modules swapped into the model, forwards
    replaced on an instance (accelerate's ``add_hook_to_module`` does; patch after it, and
    it is refused). Under
    torch.compile the verdict is worked out from the model in the traced frame (its
    guards are on what it reads, which the compiled forward guards on anyway), never
    looked up in the weak table: traced, that lookup guarded on the table's size, which
    changed when the garbage collector dropped a dead model during the compile ("Guard
    failed on the same frame it was created", a CI run of 2026-12-04). (Marking this
    function ``torch.compiler.assume_constant_result`` instead passed on torch 2.13 and
    failed on 2.11, which takes only constant arguments there: run 187, NOTES.md.)"""
    if torch.compiler.is_compiling():
        static, watched = _static_problem(model)
        return static or _hook_problem(model, watched)
    # (worked out again when the parameters' dtype or device moves: a checkpoint loaded on
    # the CPU, memory-mapped, unaligned, moved to the GPU)
    w, hooks = model.lm_head.weight, _hook_count()
    placed = (w.dtype, w.device)
    entry = _UNSUPPORTED.get(model)
    if entry is None or entry[0] != placed:
        static, watched = _static_problem(model)
        # (weakly: under FSDP2 the modules' hooks lead back to the model, which the weak
        # table's entry would then keep alive for good)
        watched = [weakref.ref(m) for m in watched]
        entry = _UNSUPPORTED[model] = [placed, static, watched, None, static]
    if entry[1] is None and entry[3] != hooks:
        problem = _hook_problem(model, [m for m in (ref() for ref in entry[2]) if m is not None])
        # (while hooks are in the way, look again at every call: removing one moves no count)
        entry[3], entry[4] = (hooks if problem is None else None), problem
    return entry[4]


def _misaligned(model) -> list:
    """The model's parameters whose data starts off a 16-byte boundary (the GEMMs' TMA
    reads need it): transformers loads a checkpoint on the CPU as views into the memory-
    mapped file, each 8 bytes past one (safetensors aligns to 8)."""
    # (plain tensors only: FSDP2's DTensors have no storage of their own; it gathers into
    # fresh allocations)
    return [p for p in model.parameters() if type(p.data) is torch.Tensor and p.data_ptr() % 16]


def _realign(params: list) -> None:
    """Each parameter (``_misaligned``'s) given its own (aligned) copy of its data, in place
    (the same Parameter objects: optimizers and ties keep them)."""
    with torch.no_grad():
        for p in params:
            p.data = p.data.clone()


def _hook_count() -> int:
    """How many hook handles PyTorch has made (module and tensor hooks, global ones too):
    while it stays, no hook was added anywhere."""
    return torch.utils.hooks.RemovableHandle.next_id


def _static_problem(model, alignment: bool = True) -> tuple[str | None, list]:
    """What does not change without a cast, a move or a module swap: the projections,
    biases, widths and module classes, last (``alignment``) the parameters' addresses; and
    the modules whose hooks matter (for ``_hook_problem``)."""
    base = model.model
    layers = base.layers[: model.config.num_hidden_layers]
    linears = [model.lm_head]
    for layer in layers:
        a, m = layer.self_attn, layer.mlp
        linears += [*_qkv_linears(a), a.o_proj, *_gate_up_linears(m), m.down_proj]
    # (the base model's and the final norm's forwards are never called either; the
    # embeddings are, as a module, where they run in PyTorch; the rotary embedding is, but
    # the fused RoPE reads its frequencies, not its output)
    watched = [base, base.norm, base.rotary_emb, *(m for layer in layers for m in layer.modules())]
    for lin in linears:
        problem = _projection_problem(lin)
        if problem:
            return f"{_module_name(model, lin)} is {problem}", watched
    problem = _class_problem(model, base, layers)
    if problem:
        return problem, watched
    # q, k and v may have biases (Qwen2's), added in their GEMMs' epilogues; no other one
    qkv = {id(p) for layer in layers for p in _qkv_linears(layer.self_attn)}
    biased = [lin for lin in linears if lin.bias is not None and id(lin) not in qkv]
    if biased:
        return (
            f"{_module_name(model, biased[0])} has a bias (attention_bias puts one on o_proj too, "
            "mlp_bias on the MLP's): codetta adds the q, k and v projections' biases only"
        ), watched
    for layer in layers:
        attn = layer.self_attn
        if hasattr(attn, "q_norm") and _qkv_bias(attn) is not None:
            return "q, k and v biases with per-head q/k norms", watched
        for lin in _qkv_linears(attn):
            b = lin.bias
            if b is not None and (b.dtype not in (torch.float32, lin.weight.dtype) or not b.is_contiguous()):
                return (
                    f"{_module_name(model, lin)}'s bias is {b.dtype} (strides {tuple(b.stride())}) beside "
                    f"a {lin.weight.dtype} weight: codetta adds a contiguous bias in float32 or the "
                    "weight's dtype"
                ), watched
    unit = _row_unit(model.lm_head.weight)
    # (the vocabulary, the LM head's rows, may be any size: the loss pads its logits rows
    # to 16 bytes, and an embedding table's rows are d wide; Llama-2 fine-tunes with an
    # added pad token have 32001)
    widths = {lin.weight.shape[0] for lin in linears[1:]} | {lin.weight.shape[1] for lin in linears}
    for layer in layers:  # (a fused projection's parts too: each is a GEMM's weight)
        widths |= {*_qkv_widths(layer.self_attn), layer.mlp.down_proj.weight.shape[1]}
    bad = sorted(w for w in widths if w % unit)
    if bad:
        return f"widths {bad} are not multiples of {unit} (TMA moves 16-byte rows)", watched
    if not layers:
        return "no layers", watched
    for layer in layers:  # (Phi-3's residual dropouts: plain ones, their p asked per forward)
        for drop in _resid_dropouts(layer):
            if type(drop) is not torch.nn.Dropout:
                kind = f"{type(drop).__module__}.{type(drop).__qualname__}"
                return f"{_module_name(model, drop)} is a {kind}, not torch.nn.Dropout", watched
    # (not while torch.compile traces: its tensors have no addresses there; a model patched
    # class-wide and compiled must be aligned, as on the GPU it is)
    misaligned = _misaligned(model) if alignment and not torch.compiler.is_compiling() else []
    if misaligned:
        name = next(n for n, p in model.named_parameters() if p is misaligned[0])
        return (
            f"{len(misaligned)} parameters ({name}, ...) start off a 16-byte boundary (views into a "
            "memory-mapped checkpoint, as transformers loads one on the CPU): codetta's GEMMs read "
            "aligned rows. codetta.apply_codetta(model) gives them aligned copies; so does moving "
            "the model to another device"
        ), watched
    return None, watched


def _resid_dropouts(layer) -> list:
    """Phi-3's residual dropout modules of a layer ([] for the other families)."""
    return [
        m
        for m in (getattr(layer, n, None) for n in ("resid_attn_dropout", "resid_mlp_dropout"))
        if m is not None
    ]


def _dropout_reason(model) -> str | None:
    """In training, a residual dropout that drops (Phi-3's ``resid_pdrop`` > 0): the fused
    residual adds apply none, so the model's own forward runs. Asked per forward (a module's
    ``p`` may change after patching; in eval mode dropout does nothing)."""
    if not model.training:
        return None
    layers = model.model.layers
    if not layers or not _resid_dropouts(layers[0]):
        return None
    for layer in layers:
        for drop in _resid_dropouts(layer):
            if drop.p > 0:
                return (
                    f"{_module_name(model, drop)} drops with p={drop.p} (resid_pdrop) in training: the fused "
                    "residual adds apply no dropout"
                )
    return None


def _hook_problem(model, watched) -> str | None:
    """Hooks the fused forward would skip: on the base model, the final norm, the rotary
    embedding or a decoder layer's modules (other than FSDP2's), or global module hooks."""
    if _global_module_hooks():
        return (
            "global module hooks (torch.nn.modules.module.register_module_forward_hook and the like, "
            "as FlopCounterMode and memory trackers use): the fused forward never calls most of "
            "the modules they would see"
        )
    for module in watched:
        hooks = _foreign_hooks(module)
        if hooks:
            return (
                f"{_module_name(model, module)} has hooks ({hooks}): the fused forward never "
                "calls the base model's, its decoder layers' or the final norm's forwards, nor "
                "uses the rotary embedding's output where RoPE is fused, so they would not run"
            )
    return None


def _family_classes(model):
    """``suffix -> class`` of the model's family in transformers ("DecoderLayer" ->
    LlamaDecoderLayer, ...), from the first of the model's classes that a family names."""
    for cls in type(model).__mro__:
        for module_name, name in FAMILIES.values():
            if cls.__module__ == module_name and cls.__name__ == name:
                # (the model's class comes from it: imported; sys.modules, as torch.compile traces it)
                mod, prefix = sys.modules[module_name], name.removesuffix("ForCausalLM")
                return lambda suffix: getattr(mod, prefix + suffix, None)
    return lambda suffix: None


def _own_type(module) -> type:
    """``module``'s class, under the classes torch.distributed swaps in (FSDP2's
    ``FSDP<Name>``, a subclass of it)."""
    return next(c for c in type(module).__mro__ if not c.__module__.startswith("torch.distributed"))


def _class_problem(model, base, layers) -> str | None:
    """A module whose math the fused forward computes itself (never calling its forward)
    that is not the family's own class: a subclass or a replacement with other math
    would be skipped in silence. (A forward replaced on the instance is taken to compute
    the class's math: transformers' ``kernelize`` and Liger's instance patch replace the
    norms' so, with the same math; accelerate's ``_hf_hook`` is refused as a hook.)"""
    family = _family_classes(model)
    wanted = [(base, "Model"), (base.norm, "RMSNorm"), (base.rotary_emb, "RotaryEmbedding")]
    for layer in layers:
        attn = layer.self_attn
        wanted += [(layer, "DecoderLayer"), (attn, "Attention"), (layer.mlp, "MLP")]
        wanted += [(layer.input_layernorm, "RMSNorm"), (layer.post_attention_layernorm, "RMSNorm")]
        wanted += [(getattr(attn, n), "RMSNorm") for n in ("q_norm", "k_norm") if hasattr(attn, n)]
    for module, suffix in wanted:
        cls = family(suffix)
        if cls is not None and _own_type(module) is not cls:
            kind = f"{type(module).__module__}.{type(module).__qualname__}"
            return (
                f"{_module_name(model, module)} is a {kind}, not transformers' {cls.__name__}: the "
                f"fused forward computes {cls.__name__}'s math without calling the module"
            )
    return None


def _projection_problem(lin) -> str | None:
    """Why the fused path cannot take ``lin``'s weight for its forward, or None: it never
    calls a projection's forward, so only a plain ``nn.Linear`` with nothing hooked on it
    is what its weight alone says (a LoRA adapter's extra path, a quantized layer's own
    weight format, an offloading or logging hook would be silently skipped)."""
    if type(lin) is not torch.nn.Linear:
        kind = f"{type(lin).__module__}.{type(lin).__qualname__}"
        return f"a {kind}, not a plain nn.Linear (LoRA adapters, quantized layers)"
    if lin._forward_hooks or lin._forward_pre_hooks or "forward" in vars(lin):
        return "hooked (forward hooks, or a forward replaced on it: the fused path never calls its forward)"
    if not lin.weight.is_contiguous():
        return (
            "a non-contiguous weight (a transposed or strided view): the fused GEMMs read each "
            "projection's weight as a row-major [out, in] matrix; make it contiguous"
        )
    return None


def _foreign_hooks(module) -> str | None:
    """The kinds of hook on ``module`` other than FSDP2's (whose gathering the fused
    forward does itself, ``fsdp.Spans``) and transformers' output-capturing ones (installed
    the first time hidden states or attentions are asked for, and left in place, inert
    but while a forward asks for them, which then runs the model's own), or None:
    forward, backward and accelerate's ``_hf_hook`` (device placement by replacing the
    forward)."""
    if not (
        module._forward_pre_hooks or module._forward_hooks or module._backward_pre_hooks
        or module._backward_hooks or module.__dict__.get("_hf_hook") is not None
    ):  # fmt: skip
        return None  # (the common case, first: a model's modules are walked often)
    kinds = [
        kind
        for kind, hooks in (
            ("forward", [*module._forward_pre_hooks.values(), *module._forward_hooks.values()]),
            ("backward", [*module._backward_pre_hooks.values(), *module._backward_hooks.values()]),
        )
        if any(not _served_hook(h) for h in hooks)
    ]
    if module.__dict__.get("_hf_hook") is not None:
        kinds.append("accelerate's _hf_hook")
    return ", ".join(kinds) or None


def _served_hook(hook) -> bool:
    return getattr(hook, "__qualname__", "").startswith("FSDPState.") or (
        getattr(hook, "__module__", None) == "transformers.utils.output_capturing"
    )


def _module_name(model, module) -> str:
    return next((n for n, m in model.named_modules() if m is module), type(module).__name__)


def _w(lin, biased: bool = False) -> torch.Tensor:
    """A projection's weight as the fused forward reads it, checked again on every read
    (a module replaced or hooked after the model's verdict was cached, e.g. PEFT applied
    to a patched model, would otherwise be skipped in silence; a bias, which the fused
    forward adds on q, k and v only, ``biased``, likewise)."""
    problem = _projection_problem(lin)
    if problem is None and lin.bias is not None and not biased:
        problem = "biased (the fused forward adds the q, k and v projections' biases only)"
    if problem:
        raise RuntimeError(
            f"codetta: a projection is {problem}, changed after codetta patched "
            "the model: the fused forward reads plain weights only. codetta.revert(model) first "
            "(codetta does not serve LoRA or quantized projections)"
        )
    return lin.weight


def _qkv_bias(attn) -> tuple | None:
    """The q, k and v projections' biases (None for one without), or None where none has
    one (Qwen2's have them; Llama's with ``attention_bias``, refused, on o_proj too)."""
    if hasattr(attn, "qkv_proj"):
        b = attn.qkv_proj.bias
        return None if b is None else tuple(b.split(_qkv_widths(attn)))
    bs = (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias)
    return None if all(b is None for b in bs) else bs


def _qkv_linears(attn) -> tuple:
    """The attention's input projections as modules: q, k and v, or Phi-3's one qkv_proj."""
    return (attn.qkv_proj,) if hasattr(attn, "qkv_proj") else (attn.q_proj, attn.k_proj, attn.v_proj)


def _gate_up_linears(mlp) -> tuple:
    """The MLP's gate and up projections as modules: two, or Phi-3's one gate_up_proj."""
    return (mlp.gate_up_proj,) if hasattr(mlp, "gate_up_proj") else (mlp.gate_proj, mlp.up_proj)


def _qkv_widths(attn) -> tuple:
    """q's, k's and v's widths (their outputs' columns)."""
    cfg, hd = attn.config, attn.head_dim
    kv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    return (cfg.num_attention_heads * hd, kv * hd, kv * hd)


def _qkv_ws(attn) -> tuple:
    """q's, k's and v's weights as the fused forward reads them: Phi-3's one qkv_proj read
    in place as three row blocks (views: their gradients land in it)."""
    if hasattr(attn, "qkv_proj"):
        return tuple(_w(attn.qkv_proj, biased=True).split(_qkv_widths(attn)))
    return (_w(attn.q_proj, biased=True), _w(attn.k_proj, biased=True), _w(attn.v_proj, biased=True))


def _gate_up_ws(mlp) -> tuple:
    """The gate's and up's weights: Phi-3's one gate_up_proj read in place as two row
    blocks (the gate's first, as its forward chunks its output)."""
    if hasattr(mlp, "gate_up_proj"):
        return tuple(_w(mlp.gate_up_proj).chunk(2))
    return (_w(mlp.gate_proj), _w(mlp.up_proj))


def _act(mlp):
    """The MLP's activation module (Phi-3 names it ``activation_fn``)."""
    act = getattr(mlp, "act_fn", None)
    return act if act is not None else mlp.activation_fn


def _row_unit(weight: torch.Tensor) -> int:
    """Elements of ``weight``'s dtype in 16 bytes: TMA rows are whole multiples of it."""
    return 16 // weight.element_size()


def _fallback_reason(model, kwargs) -> str | None:
    if kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None:
        return "a KV cache is in use"
    if kwargs.get("use_cache"):
        return "use_cache=True"
    if kwargs.get("output_hidden_states") or kwargs.get("output_attentions"):
        return "hidden states or attentions requested"
    config = model.config
    for name in ("output_hidden_states", "output_attentions"):
        if kwargs.get(name) is None and getattr(config, name, False):
            return f"hidden states or attentions requested (config.{name})"
    if kwargs.get("use_cache") is None and not model.training and getattr(config, "use_cache", False):
        # (as the model's own forward would, in eval mode this returns the KV cache that
        # config.use_cache asks for; in training the fused path returns none)
        return "config.use_cache=True in eval mode (pass use_cache=False for the fused forward)"
    keep = kwargs.get("logits_to_keep", 0)
    if not (isinstance(keep, int) and keep == 0):
        return "logits_to_keep"
    return _precision_reason(model) or _fsdp1_reason(model) or unsupported(model) or _dropout_reason(model)


def _loss_reason(model, labels) -> str | None:
    """A training forward with labels fuses Hugging Face's causal-LM loss (cross-entropy
    over the shifted labels) into the LM head: a model whose ``loss_function`` is another
    (set by the user, or another ``loss_type``) runs its own forward, or None. (Its own
    loss compiled, as the regional compile does, is still that loss.)"""
    if labels is None or not model.training:
        return None  # (no fused loss: the model's loss_function runs on the logits)
    from transformers.loss.loss_utils import LOSS_MAPPING

    fn = model.loss_function
    if getattr(fn, "_torchdynamo_orig_callable", fn) is LOSS_MAPPING["ForCausalLM"]:
        return None
    name = getattr(fn, "__name__", type(fn).__name__)
    return f"a loss_function other than Hugging Face's causal-LM cross-entropy ({name})"


def _fsdp1_reason(model) -> str | None:
    """FSDP1 (``FullyShardedDataParallel``) wrapping a decoder layer, the embeddings or the
    LM head, or None. Asked on every forward (the wrapping usually comes after the patch):
    FSDP1 gathers a unit's parameters in its own forward, which the fused path never calls,
    so it would read sharded views. (FSDP2's ``fully_shard`` is served: ``fsdp.Spans``.)"""
    base = model.model
    for module in (*base.layers, base.embed_tokens, base.norm, model.lm_head):
        if type(module).__name__ == "FullyShardedDataParallel":
            return (
                "FSDP1 (FullyShardedDataParallel) wraps its decoder layers or embeddings: the fused "
                "forward never calls their forwards, where FSDP1 gathers their parameters; shard with "
                "FSDP2's fully_shard instead (codetta train --parallel fsdp does)"
            )
    return None


def _precision_reason(model) -> str | None:
    """Why the model's compute dtype is not one the fused path serves, or None. Asked on
    every forward (a model may be cast after it is patched; autocast is per region): the
    LM head's weight stands for the model's parameters (under FSDP2 it is the gathered
    one, in the mixed-precision policy's dtype; a still-sharded DTensor is left to the
    kernels' own checks). Autocast over float32 parameters (Hugging Face Trainer's
    ``bf16=True``) keeps the residual stream in float32 and casts each projection's
    operands: the cast mode (``CODETTA_AUTOCAST=cast``, the default) does the same
    (``_autocast_dtype``); ``own-forward`` runs the model's own forward instead."""
    weight = model.lm_head.weight
    if not _plain(weight):
        return None  # (DTensor and other subclasses)
    target = _autocast_target(weight)
    if target is not None:
        to, of = (str(t).removeprefix("torch.") for t in (target, weight.dtype))
        why = f"torch.autocast to {to} over {of} parameters"
        if _autocast_mode(model) != "cast":
            return (
                f"{why}, and autocast='own-forward' (apply_codetta's, or CODETTA_AUTOCAST) asks for "
                f"the model's own forward there; the default, 'cast', runs codetta on the projections "
                f"cast to {to} over a float32 residual stream, as autocast does "
                '(docs/huggingface.md, "Mixed precision")'
            )
        if to not in ("bfloat16", "float16"):
            return f"{why}: codetta's cast mode (CODETTA_AUTOCAST=cast, the default) runs bf16 or fp16 only"
        if not all(_plain(p) for p in model.parameters()):
            return (
                f"{why}: codetta's cast mode (CODETTA_AUTOCAST=cast, the default) takes unsharded "
                "parameters only (under FSDP2, give fully_shard a MixedPrecisionPolicy instead)"
            )
        return None
    if weight.device.type == "cuda" and weight.dtype == torch.float32:
        return "float32 parameters on the GPU: codetta's kernels serve bfloat16 and float16"
    if weight.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        kind = str(weight.dtype).removeprefix("torch.")
        return f"{kind} parameters: codetta's kernels serve bfloat16 and float16"
    return None


def _autocast_target(weight) -> torch.dtype | None:
    """The dtype of the autocast region over ``weight``'s device, where it differs from
    ``weight``'s; else None."""
    kind = weight.device.type
    if not torch.is_autocast_enabled(kind):
        return None
    target = torch.get_autocast_dtype(kind)
    return None if target == weight.dtype else target


def _plain(t) -> bool:
    return type(t) is torch.nn.Parameter or type(t) is torch.Tensor


def _autocast_dtype(model) -> torch.dtype | None:
    """The dtype the fused path runs the parameters in under ``CODETTA_AUTOCAST=cast``
    (autocast's, where it differs from the parameters'), or None: as they are. Asked after
    ``_precision_reason`` found nothing against it."""
    if _autocast_mode(model) != "cast":
        return None
    return _autocast_target(model.lm_head.weight)


def _codetta_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    cache=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    logits_to_keep=0,
    **kwargs,
):
    # the parameters in the order of the Hugging Face forward it replaces (positional calls)
    kwargs.update(use_cache=use_cache, logits_to_keep=logits_to_keep)
    if cache is not None:  # (the model's own forward also takes the old name, past_key_values)
        kwargs["cache"] = cache
    why = _fallback_reason(self, kwargs) or _loss_reason(self, labels)
    if why is not None:
        if why != "a KV cache is in use" and (type(self), why) not in _FALLBACK_WARNED:
            _FALLBACK_WARNED.add((type(self), why))
            warnings.warn(f"codetta: {type(self).__name__} runs its own forward here ({why})", stacklevel=2)
        return _original_forward(self)(
            self, input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            inputs_embeds=inputs_embeds, labels=labels, **kwargs,
        )  # fmt: skip
    cast = _autocast_dtype(self)
    # CODETTA_AUTOCAST=cast: the fused forward over the projections' weights cast to
    # autocast's dtype (differentiable casts: the gradients reach the parameters in their
    # own dtype; tied ones stay tied) and a float32 residual stream; the module's hooks do
    # not run again
    saved = _cast_parameters((self,), cast)
    try:
        return _fused_forward(
            self, input_ids, attention_mask, position_ids, inputs_embeds, labels, kwargs, cast
        )  # fmt: skip
    finally:
        _restore_parameters(saved)


def _cast_parameters(modules, dtype) -> list:
    """Each projection's (``nn.Linear``'s) parameters not in ``dtype`` replaced by their
    (differentiable) casts to it, a parameter shared by several modules by one cast;
    nothing when ``dtype`` is None. The rest stay as they are where float32, as under
    autocast: the norms' weights (applied in float32 in the epilogues) and the embedding
    table (the lookup starts the float32 residual stream; a tied LM head reads its cast);
    in another dtype (a bf16 model under fp16 autocast) they are cast to ``dtype`` too.
    Returns what ``_restore_parameters`` puts back (in a
    ``finally``: plain code, not a context manager, so that torch.compile traces it).
    Gradient checkpointing's recomputation of a unit, which runs after the forward's casts
    are undone, casts its own layers' parameters again (the same values: the saved tensors
    it supplies match the forward's)."""
    saved, casts = [], {}
    for module in modules if dtype is not None else ():
        for sub in module.modules():
            keep = () if isinstance(sub, torch.nn.Linear) else (torch.float32,)
            for name, p in sub._parameters.items():
                if p is not None and p.dtype != dtype and p.dtype not in keep:
                    if id(p) not in casts:
                        casts[id(p)] = p.to(dtype)
                    saved.append((sub, name, p))
    for sub, name, p in saved:
        sub._parameters[name] = casts[id(p)]
    return saved


def _restore_parameters(saved: list) -> None:
    for sub, name, p in saved:
        sub._parameters[name] = p


def _fused_forward(self, input_ids, attention_mask, position_ids, inputs_embeds, labels, kwargs, cast=None):
    from transformers.modeling_outputs import CausalLMOutputWithPast

    return_dict = kwargs.pop("return_dict", None)
    base = self.model
    cache_made = _makes_cache(base, kwargs.get("use_cache"))
    for name in ("cache", "past_key_values", "use_cache", "logits_to_keep"):
        kwargs.pop(name, None)
    if self.training and _wrapped_for_checkpointing(base.layers):
        raise RuntimeError(
            "codetta: activation (gradient) checkpointing by torch.distributed's per-block "
            "wrappers is not supported by the fused forward (it never calls the decoder layers' "
            "forwards, so the wrapper would silently not apply); use Hugging Face's "
            "model.gradient_checkpointing_enable() instead, leave the layers unwrapped, or "
            "codetta.revert(model)"
        )
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
    layers = base.layers[: self.config.num_hidden_layers]
    # FSDP2: each layer's parameters are gathered over the span that uses them (fsdp.py);
    # a wrapped base model's own ones (embeddings, final norm) for the whole forward
    spans = Spans([*([layer] for layer in layers), (base.norm, self.lm_head)], outer=(base,))
    checkpointing = self.training and torch.is_grad_enabled() and _hf_checkpointing(base, layers)
    spans.open_outer()
    # with labels in training, the loss is fused and no logits are returned (as Liger does)
    fused_loss = labels is not None and self.training
    tied = None
    if inputs_embeds is not None:
        h = inputs_embeds
        wdt = base.embed_tokens.weight.dtype
        if h.is_floating_point() and h.dtype != wdt and torch.promote_types(h.dtype, wdt) == wdt:
            # (narrower embeddings than the model's, float16 into float32: the model's own
            # forward promotes them at its first residual add, after its first norm has
            # rounded its output to their dtype; here promoted first, exactly)
            h = h.to(wdt)
    elif fused_loss and not spans.active and _tied_lookup(base.embed_tokens, self.lm_head):
        # tied embeddings: the table's two gradients formed in one pass (ops/tied_embedding.py)
        tied = TiedLink()
        emb = base.embed_tokens
        h = _input_grads(emb, tied_embedding(input_ids, emb.weight, emb.padding_idx, tied))
    elif not spans.active and SETTINGS.embed_grad and _plain_lookup(base.embed_tokens):
        # the table's gradient in one pass (ops/tied_embedding.py: embedding)
        emb = base.embed_tokens
        h = _input_grads(emb, embedding(input_ids, emb.weight, emb.padding_idx))
    else:
        h = base.embed_tokens(input_ids)
    if cast is not None and h.dtype != torch.float32:
        # the cast mode's residual stream is float32, as autocast keeps it (ops/norm_checks.mixed)
        h = h.float()
    # the masks see the caller's position_ids: given none, the positions are 0..T-1 and
    # transformers' packed-sequence check (a host synchronization: it looks at GPU values
    # on the host, NOTES.md) has nothing to find
    # (transformers looks for packed sequences in position_ids only where the model's own
    # forward makes no cache: ``_makes_cache``)
    masks = _masks(base, h, attention_mask, None if cache_made else position_ids, len(layers))
    if position_ids is None:
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
    position_embeddings = base.rotary_emb(h, position_ids)

    loss = logits = None
    rope0 = _fused_rope(base, layers[0].self_attn, position_ids)  # frequencies: once per forward
    (h,) = spans.open(0, h)
    first, norm = layers[0], layers[0].input_layernorm
    attn = first.self_attn
    # the first norm has no projection before it: one row pass, then q, k, v as in later
    # layers (the norm's scale and RoPE in their epilogues)
    rope = _layer_rope(rope0, attn)
    qkv = rmsnorm_linear(
        h, norm.weight, _qkv_ws(attn), norm.variance_epsilon,
        rope=rope, bias=_qkv_bias(attn),
    )  # fmt: skip
    rotated = rope is not None

    def mlp_half(i, h, qkv, rotated):
        """Layer i from its q, k, v to the residual stream after its MLP's SwiGLU: (h, y)."""
        layer = layers[i]
        attn, mlp = layer.self_attn, layer.mlp
        # (the positions reach the attention function as the model's own layers pass them:
        # FlashAttention finds sequences packed in one row there)
        a = _attention(
            attn, *qkv, position_embeddings, masks[i], self.config, rotated,
            position_ids=position_ids, **kwargs,
        )  # fmt: skip
        post = layer.post_attention_layernorm
        gate_up = _gate_up_ws(mlp)
        if _silu(mlp):
            # the gate and up projections as one GEMM whose epilogue forms SwiGLU; y carries
            # g and u, so the down projection's backward forms their gradients in its epilogue
            # (over g and u: nothing else here reads them)
            h, y = residual_rmsnorm_swiglu(
                a, _w(attn.o_proj), h, post.weight, *gate_up, post.variance_epsilon, internal=True
            )
        else:
            h, (g, u) = residual_rmsnorm_linear(
                a, _w(attn.o_proj), h, post.weight, gate_up, post.variance_epsilon
            )
            y = _act(mlp)(g) * u
        # (the next span opens before its parameters are read: under FSDP2 they are
        # gathered then)
        (h,) = spans.open(i + 1, h)
        return h, y

    def segment(i, rotated, h, q, k, v):
        """Layer i from its q, k, v to layer i + 1's (and the residual stream): the unit
        Hugging Face's gradient checkpointing recomputes in the backward, on the shifted
        boundary (its inputs are all it keeps)."""
        # (only a recomputation needs it: in the forward they are cast already)
        saved = _cast_parameters((layers[i], layers[i + 1]), cast if checkpointing else None)
        try:
            return _segment(i, rotated, h, q, k, v)
        finally:
            _restore_parameters(saved)

    def _segment(i, rotated, h, q, k, v):
        h, y = mlp_half(i, h, (q, k, v), rotated)
        nxt = layers[i + 1]
        ws = _qkv_ws(nxt.self_attn)
        norm = nxt.input_layernorm
        # q and k come out rotated (RoPE in their GEMMs' epilogues) where it applies
        rope = _layer_rope(rope0, nxt.self_attn)  # with that layer's own q/k norms
        h, qkv = residual_rmsnorm_linear(
            y, _w(layers[i].mlp.down_proj), h, norm.weight, ws, norm.variance_epsilon, rope=rope,
            bias=_qkv_bias(nxt.self_attn),
        )  # fmt: skip
        # (FSDP2 gathers layer i again when dh arrives; under checkpointing also when dq, dk
        # or dv does, whichever comes first: the unit's recomputation reads layer i's weights.
        # By reasoning: the CPU test passes with h alone hooked too, its order of arrival)
        if checkpointing:
            return spans.close(i, (h, *qkv))
        (h,) = spans.close(i, (h,))
        return (h, *qkv)

    for i in range(len(layers) - 1):
        if checkpointing:
            h, *qkv = checkpoint(segment, i, rotated, h, *qkv, use_reentrant=False)
        else:
            h, *qkv = segment(i, rotated, h, *qkv)
        rotated = _layer_rope(rope0, layers[i + 1].self_attn) is not None
    i = len(layers) - 1
    mlp = layers[i].mlp
    h, y = mlp_half(i, h, qkv, rotated)
    if fused_loss:
        # training with labels: the last residual add and the final norm, then the LM head
        # and the loss in one chunked operator (no logits): K1's h and the norm's rstd
        # handed on, rstd applied in the logits GEMM's epilogue (in float16, or with
        # CODETTA_CE_NORM_FACTORS=0, one pass forming n after K1 instead: float16's range
        # may not hold h's unscaled logits, linear_cross_entropy's row_scale)
        norm, head = base.norm, _w(self.lm_head)
        rstd = None
        if SETTINGS.ce_norm_factors and head.dtype != torch.float16:
            _, n, rstd = residual_rmsnorm_factors(y, _w(mlp.down_proj), h, norm.weight, norm.variance_epsilon)
        else:
            _, n = residual_rmsnorm(y, _w(mlp.down_proj), h, norm.weight, norm.variance_epsilon)
        loss = _causal_lm_loss(n, head, labels, kwargs, tied, row_scale=rstd)
        loss = spans.close(i + 1, spans.close(i, loss))
    elif self.lm_head.weight.shape[0] % _row_unit(self.lm_head.weight):
        # an odd vocabulary: TMA cannot store its logits rows; the final norm here (K1 and
        # one pass forming n), the LM head in PyTorch
        norm = base.norm
        _, n = residual_rmsnorm(y, _w(mlp.down_proj), h, norm.weight, norm.variance_epsilon)
        logits = spans.close(i + 1, spans.close(i, F.linear(n, _w(self.lm_head))))
    else:
        norm = base.norm
        h, zs = residual_rmsnorm_linear(
            y, _w(mlp.down_proj), h, norm.weight, (_w(self.lm_head),), norm.variance_epsilon
        )
        logits = spans.close(i + 1, spans.close(i, zs[0]))
    if labels is not None and not fused_loss:
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
    loss, logits = spans.close_outer((loss, logits))
    out = CausalLMOutputWithPast(loss=loss, logits=logits)
    if return_dict is None:
        return_dict = getattr(self.config, "return_dict", True)
    return out if return_dict else out.to_tuple()


def _makes_cache(base, use_cache) -> bool:
    """Whether the model's own forward would make a KV cache here (``use_cache``, else
    ``config.use_cache``; off under gradient checkpointing in training with gradients, as
    transformers decides it): its masks then skip the packed-sequence check of position_ids
    (block-diagonal attention over sequences packed in a row), even in training, so a
    patched model, which makes none, builds its masks as though it did, for the same numbers."""
    if use_cache is None:
        use_cache = getattr(base.config, "use_cache", None)
    if getattr(base, "gradient_checkpointing", False) and base.training and torch.is_grad_enabled():
        use_cache = False
    return bool(use_cache)


def _hf_checkpointing(base, layers) -> bool:
    """Hugging Face's gradient checkpointing is on (a flag on the base model and one per
    layer)."""
    return bool(base.gradient_checkpointing) or any(getattr(layer, "gradient_checkpointing", False)
                                                    for layer in layers)  # fmt: skip


def _wrapped_for_checkpointing(layers) -> bool:
    """A layer wrapped for activation checkpointing by torch.distributed (the
    ``checkpoint_wrapper`` module, the composable ``checkpoint``)."""
    for layer in layers:
        if type(layer).__name__ == "CheckpointWrapper" or hasattr(layer, "_checkpoint_wrapped_module"):
            return True
        if "checkpoint" in (_composable_registry(layer) or {}):
            return True
    return False


# the SiLU modules, by (module, name): no import while torch.compile traces (2.11 refuses it)
_SILU = {("torch.nn.modules.activation", "SiLU"), ("transformers.activations", "SiLUActivation")}


def _silu(mlp) -> bool:
    """The MLP's activation is SiLU (the module itself, not the config's ``hidden_act``: a
    model may have another module swapped in), with nothing hooked on it: the fused SwiGLU
    epilogue computes it. Any other activation module runs as a module, on codetta's g."""
    act = _act(mlp)
    kind = type(act)
    return (kind.__module__, kind.__name__) in _SILU and not (
        act._forward_hooks or act._forward_pre_hooks or "forward" in vars(act)
    )


def _causal_lm_loss(n, head_weight, labels, kwargs: dict, tied=None, row_scale=None):
    """Hugging Face's causal-LM loss (``ForCausalLMLoss``: tokens < t predict t, or the
    given ``shift_labels``; ``ignore_index``, -100 by default; mean, or a sum over
    ``num_items_in_batch``) through ``linear_cross_entropy``, in float32. ``row_scale``:
    the final norm's rstd, ``n`` then its h (``residual_rmsnorm_factors``)."""
    ignore = kwargs.get("ignore_index", -100)
    shift = kwargs.get("shift_labels")
    if shift is None:
        shift = torch.nn.functional.pad(labels, (0, 1), value=ignore)[..., 1:]
    shift = shift.to(n.device)
    num_items_in_batch = kwargs.get("num_items_in_batch")
    common = dict(ignore_index=ignore, loss_dtype=torch.float32, tied=tied, row_scale=row_scale)
    if num_items_in_batch is None:
        return linear_cross_entropy(n, head_weight, shift, **common)
    total = linear_cross_entropy(n, head_weight, shift, reduction="sum", **common)
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch


def _tied_lookup(emb, head) -> bool:
    """The embedding is a plain lookup into the LM head's own weight, nothing hooked on it:
    its gradient and the head's can be formed in one pass (``CODETTA_TIED_GRAD``)."""
    return SETTINGS.tied_grad and _plain_lookup(emb) and emb.weight is head.weight


def _plain_lookup(emb) -> bool:
    """``emb`` is an ``nn.Embedding`` doing a plain lookup (no max_norm, frequency scaling or
    sparse gradient), nothing hooked on it, its weight a plain tensor: its backward can
    be replaced by codetta's one pass (``CODETTA_EMBED_GRAD``, ``CODETTA_TIED_GRAD``)."""
    return (
        type(emb) is torch.nn.Embedding
        and emb.max_norm is None
        and not emb.scale_grad_by_freq
        and not emb.sparse
        and not (emb._forward_pre_hooks or emb._backward_hooks)
        and all(_input_grads_hook(h) for h in emb._forward_hooks.values())
        and _plain(emb.weight)  # (a Parameter, or its cast under CODETTA_AUTOCAST=cast)
        and not _global_module_hooks()
    )


# the forward hook transformers' ``enable_input_require_grads`` puts on the input
# embeddings (gradient checkpointing adds it; PEFT's twin is named without the s): its
# output made to require grad, which the lookups here do themselves (``_input_grads``)
_INPUT_GRADS_HOOKS = ("make_inputs_require_grads", "make_inputs_require_grad")


def _input_grads_hook(hook) -> bool:
    return getattr(hook, "__name__", None) in _INPUT_GRADS_HOOKS


def _input_grads(emb, h: torch.Tensor) -> torch.Tensor:
    """``h`` from a lookup that bypassed ``emb``'s forward (``_plain_lookup``): made to
    require grad where an input-grads hook on ``emb`` would have (a frozen table's output)."""
    if not h.requires_grad and torch.is_grad_enabled() and emb._forward_hooks:
        h.requires_grad_(True)
    return h


def _global_module_hooks() -> bool:
    m = torch.nn.modules.module
    return bool(m._global_forward_hooks or m._global_forward_pre_hooks or m._global_backward_hooks)


def _masks(base, h, attention_mask, position_ids, n_layers: int) -> list:
    """Each layer's attention mask, built as the model's own forward builds it."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    config = base.config
    if isinstance(attention_mask, dict):  # prepared by the caller, per layer type
        mapping = attention_mask
    else:
        args = _mask_args(create_causal_mask, config=config, inputs_embeds=h, attention_mask=attention_mask,
                          position_ids=position_ids)  # fmt: skip
        if config.model_type in ("mistral", "phi3") and getattr(config, "sliding_window", None) is not None:
            return [create_sliding_window_causal_mask(**args)] * n_layers
        mapping = {"full_attention": create_causal_mask(**args)}
        if getattr(base, "has_sliding_layers", False):
            mapping["sliding_attention"] = create_sliding_window_causal_mask(**args)
    types_ = getattr(config, "layer_types", None) or ["full_attention"] * n_layers
    return [mapping[types_[i]] for i in range(n_layers)]


_MASK_PARAMS: dict = {}  # mask builder -> its parameter names (read when a model is patched)


def _mask_params(fn) -> frozenset:
    params = _MASK_PARAMS.get(fn)
    if params is None:
        params = _MASK_PARAMS[fn] = frozenset(inspect.signature(fn).parameters)
    return params


def _read_mask_params() -> None:
    """Before any forward (torch.compile then finds plain dict entries, not a signature
    to trace)."""
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

    for fn in (create_causal_mask, create_sliding_window_causal_mask):
        _mask_params(fn)


def _mask_args(fn, **args) -> dict:
    """``args`` for transformers' mask builders, with no cache under the name this version
    uses (``cache`` since 5.2x, ``past_key_values`` before, which also took ``cache_position``;
    5.25 takes both, and warns when both are given), and the embeddings under this version's
    name for them (``input_embeds`` in 5.0 and 5.1, ``inputs_embeds`` from 5.2)."""
    params = _mask_params(fn)
    if "inputs_embeds" not in params and "input_embeds" in params:
        args["input_embeds"] = args["inputs_embeds"]
    for name in ("cache", "past_key_values"):
        if name in params:
            args[name] = None
            break
    if "cache_position" in params:
        h = args["inputs_embeds"]
        args["cache_position"] = torch.arange(h.shape[1], device=h.device)
    return {k: v for k, v in args.items() if k in params}


def _fused_rope(base, attn, position_ids):
    """The ``RoPE`` argument that rotates q and k in their GEMMs' epilogues with the
    model's own frequencies and attention scaling (read after ``rotary_emb`` ran, so a
    dynamic rope type has updated them), without q/k norms (``_layer_rope`` adds a
    layer's); None where it does not apply (a head_dim without a RoPE program, partial
    rotary)."""
    rotary = base.rotary_emb
    inv_freq = getattr(rotary, "inv_freq", None)
    if inv_freq is None or 2 * inv_freq.shape[0] not in RMS_ROPE:
        return None
    if 2 * inv_freq.shape[0] != attn.head_dim:
        return None  # partial rotary (rotating part of each head): Hugging Face's own
    # (a model cast to bf16 casts inv_freq too; Hugging Face's rotary embedding uses its
    # float32 copy, which of_rotary keeps per buffer and version, not made once per layer)
    return RoPE.of_rotary(rotary, position_ids)


def _layer_rope(rope, attn):
    """``rope`` for one layer: with its per-head q/k norms (Qwen3) where it has them; None
    where RoPE does not apply, or the two norms' eps differ."""
    if rope is None or not hasattr(attn, "q_norm"):
        return rope
    eps = attn.q_norm.variance_epsilon
    if attn.k_norm.variance_epsilon != eps:
        return None
    return rope._replace(qk_norm_weights=(attn.q_norm.weight, attn.k_norm.weight), qk_norm_eps=eps)


def _attention(attn, q, k, v, position_embeddings, mask, config, rotated=False, **kwargs):
    """The attention module's forward between its input projections and its output
    projection (Llama; Qwen3 adds per-head q/k norms; Mistral, Phi-3, Qwen2 and Qwen3 pass a sliding
    window): returns the heads' output as [..., heads * head_dim]. ``rotated``: q and
    k arrive with RoPE (and Qwen3's q/k norms) applied already."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    apply_rotary_pos_emb, eager_attention_forward = _HELPERS[type(attn).__module__]
    input_shape = q.shape[:-1]
    hidden_shape = (*input_shape, -1, attn.head_dim)
    q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
    if hasattr(attn, "q_norm") and not rotated:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if not rotated:
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    impl = config._attn_implementation
    if hasattr(ALL_ATTENTION_FUNCTIONS, "get_interface"):  # (5.1 on)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(impl, eager_attention_forward)
    else:  # (5.0: the models' own lookup)
        interface = eager_attention_forward if impl == "eager" else ALL_ATTENTION_FUNCTIONS[impl]
    extra = {}
    if hasattr(attn, "sliding_window"):
        extra["sliding_window"] = attn.sliding_window
    elif config.model_type in ("mistral", "phi3"):
        extra["sliding_window"] = getattr(config, "sliding_window", None)
    out, _ = interface(
        attn, q, k, v, mask, dropout=0.0 if not attn.training else attn.attention_dropout,
        scaling=attn.scaling, **extra, **kwargs,
    )  # fmt: skip
    return out.reshape(*input_shape, -1).contiguous()
