"""FSDP2 (``torch.distributed.fsdp.fully_shard``) under the drop-in's fused forward.

FSDP2 gathers a wrapped module's parameters in a hook that runs before the module's
forward, frees them after it, gathers them again when the gradient reaches the
forward's outputs, and reduce-scatters their gradients when the gradient reaches the
forward's inputs. The fused forward (``integrations.hf``) never calls a decoder
layer's forward, and one operator at each layer boundary uses two layers' parameters
(the down projection of one, the next one's input norm and q/k/v projections), so no
module forward marks the span a layer's parameters are used in.

``Spans`` runs each wrapped layer's FSDP2 hooks around that span itself: layer j's
span opens just before the boundary operator into layer j (its input: the residual
stream) and closes just after the boundary operator out of layer j (its outputs: the
next residual stream and projections, or the loss). Neighbouring spans overlap by one
operator, so both layers' parameters are gathered while it runs, forward and
backward, and a layer's gradients are reduce-scattered only once the operator that
opened its span has formed them. A wrapped base model (``model.model``, whose forward
is not called either) is an outer span: its own parameters (embeddings, final norm)
are gathered for the whole forward. No extra communication: each span gathers and
reduce-scatters once per step, as the layer's own forward would.

Uses FSDP2's per-module state (``_get_fsdp_state``, ``_pre_forward``,
``_post_forward``): private API, checked on torch 2.11 (two H200s, NOTES.md) and 2.13
(the CPU tests); a torch without them gets a clear error, not a wrong step. Modules
not wrapped by ``fully_shard`` (no FSDP, DDP, one GPU) make every call here a no-op.
"""

from __future__ import annotations

import warnings

import torch


def _fsdp_module_class():
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed, or before FSDP2
        return None
    return FSDPModule


def _distributed() -> bool:
    """Whether a process group exists: FSDP2 shards over one (``fully_shard`` makes its
    device mesh from it), so without one no module is wrapped and there is nothing to look
    for. (Walking every layer's submodules on each forward was 2 % of the drop-in's own
    host time on the CPU: 3.77 -> 3.70 ms a two-layer forward + backward, NOTES.md.)"""
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized()


def _states(modules) -> list:
    """The FSDP2 states of ``modules`` and their submodules, each once, outermost first."""
    cls = _fsdp_module_class()
    if cls is None or not _distributed():
        return []
    seen, out = set(), []
    for top in modules:
        for m in top.modules():
            if isinstance(m, cls):
                state = m._get_fsdp_state()
                if id(state) not in seen:
                    seen.add(id(state))
                    out.append((m, state))
    return out


def supported(state) -> bool:
    return all(hasattr(state, name) for name in ("_pre_forward", "_post_forward"))


class Spans:
    """The FSDP2 hooks of a list of spans, each given as the modules whose parameters the
    span uses (a decoder layer; the final norm and the LM head)."""

    def __init__(self, spans, outer=()):
        self._states = [_states(modules) for modules in spans]
        # modules wrapped around all the spans (the base model, when it is wrapped too):
        # their own parameters (embeddings, final norm) are gathered for the whole forward
        self._outer = [(m, s) for m, s in _states(outer) if any(m is o for o in outer)]
        for states in self._states + [self._outer]:
            for module, state in states:
                if not supported(state):
                    raise RuntimeError(
                        f"codetta: this torch's FSDP2 lacks the hooks the fused forward drives "
                        f"({type(module).__name__}); use torch 2.11 or newer, or codetta.revert(model)"
                    )
        self.active = any(self._states) or bool(self._outer)
        if self.active:
            _quiet_view_warnings()

    def open_outer(self) -> None:
        """The outer modules' forward starts (before anything reads their parameters)."""
        for module, state in self._outer:
            state._pre_forward(module, (), {})

    def close_outer(self, outputs):
        for module, state in reversed(self._outer):
            outputs = state._post_forward(module, (), outputs)
        return outputs

    def open(self, j: int, *tensors: torch.Tensor):
        """Span j starts; ``tensors`` are its inputs (use the returned ones: FSDP2 hooks the
        reduce-scatter of the span's gradients onto them)."""
        for module, state in self._states[j]:
            tensors, _ = state._pre_forward(module, tensors, {})
        return tensors

    def close(self, j: int, outputs):
        """Span j ends; ``outputs`` are its outputs (FSDP2 gathers the span's parameters
        again when their gradients arrive). Returns them (maybe cast by FSDP2)."""
        for module, state in reversed(self._states[j]):
            outputs = state._post_forward(module, (), outputs)
        return outputs


_VIEWS_QUIET = [False]


def _quiet_view_warnings() -> None:
    """Once per process: no FSDP2 warning (torch 2.13) that a Llama / Qwen2 / Qwen3 / Mistral / Phi-3 module
    returned a view (an in-place op on it would drop the hook that gathers its parameters
    for the backward). The fused forward's spans end in views (the residual stream and q,
    k, v reshaped to [batch, seq, ...]) that nothing changes in place, so it was a false
    alarm on every layer class; one filter, installed once (a ``catch_warnings`` around
    each span reset the process's record of warnings shown, so every other warning came
    again on every forward). The same families' modules run unpatched in the process are
    not warned either."""
    if _VIEWS_QUIET[0] or torch.compiler.is_compiling():
        return
    _VIEWS_QUIET[0] = True
    warnings.filterwarnings(
        "ignore",
        message=r"FSDP2-wrapped module \(FSDP(Llama|Qwen2|Qwen3|Mistral|Phi3)\w*\) returned a view tensor",
    )
