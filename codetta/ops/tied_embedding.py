"""An embedding lookup whose table is also the LM head's weight (tied embeddings), with
the table's whole gradient formed in one pass (``programs/embedding.py``).

    link = TiedLink()
    h = tied_embedding(ids, weight, padding_idx, link)      # = F.embedding(ids, weight, padding_idx)
    ...
    loss = linear_cross_entropy(n, weight, target, tied=link)

Without the link, autograd sums the weight's two gradients: the LM head's (cast from
float32 to the weight's dtype) and the embedding's (its own backward over a zero-filled
[V, d] table), each a [V, d] tensor, then their sum. With it, the loss's backward hands
its float32 weight gradient and scale to the link instead of returning a gradient, and
the embedding's backward, which runs last, returns the sum of both, rounded once. The
loss hands it over only if the engine will run the embedding's backward in this
backward pass (``torch._C._will_engine_execute_node``); otherwise it returns its
gradient as usual, so a graph in which the embedding's output does not reach the loss
still gets every gradient. Until the embedding's backward runs, the float32 gradient
(4 V d bytes) stays alive instead of its cast (2 V d bytes), and the pass itself takes a
float32 [T, d] scratch of run sums (T tokens; 134 MB at 16384 tokens and d 2048). The
step's peak, at the end of the forward, did not move (Llama-3.2-1B, run 119, NOTES.md).

``embedding(ids, weight, padding_idx)`` is the same lookup untied (no link): its
backward is the one pass without the head's term, ``programs/embedding.py``'s
``embedding_weight_grad`` (PyTorch's own zero-fills the [V, d] table, then sums and
scatters in two kernels over it). A tied lookup whose loss returned its own gradient gets
the same.

Eager mode only: under torch.compile, ``linear_cross_entropy`` ignores the link and the
lookup is a plain ``F.embedding`` in the traced graph.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

from ..programs.embedding import embedding_weight_grad, tied_weight_grad


def _origin(weight: torch.Tensor):
    """Where ``weight``'s gradient goes: the tensor itself (a leaf), the leaf behind a chain
    of casts (``.half()``, ``.to(dtype)``: autocast's), or else its autograd node (kept alive
    by the graph of every tensor made from it, so a weak reference to it holds while the
    lookup's output lives)."""
    node = weight.grad_fn
    while node is not None and type(node).__name__ == "ToCopyBackward0":
        nxt = [f for f, _ in node.next_functions if f is not None]
        if len(nxt) != 1:
            break
        node = nxt[0]
    if node is None:
        return weight
    return node.variable if type(node).__name__ == "AccumulateGrad" else node


class TiedLink:
    """One forward's tie between an embedding lookup and the loss over the same weight."""

    def __init__(self):
        self._node = None  # a weak reference to the lookup's autograd node
        self._weight = None  # a weak reference to the lookup's weight
        self._deposits: list[tuple[torch.Tensor, torch.Tensor]] = []

    def bind(self, out: torch.Tensor, weight: torch.Tensor) -> None:
        node = out.grad_fn
        self._node = None if node is None else weakref.ref(node)
        self._weight = weakref.ref(_origin(weight))

    def check_weight(self, weight: torch.Tensor) -> None:
        """Raise if the lookup this link is bound to read a weight whose gradient goes
        elsewhere than ``weight``'s (the loss would hand its gradient to the wrong weight):
        the same tensor, or casts of the same one, pass; an unbound link (no lookup with a
        gradient yet) passes."""
        bound = None if self._weight is None else self._weight()
        if bound is not None and bound is not _origin(weight):
            raise ValueError(
                "tied: this TiedLink's tied_embedding looked up another weight than linear_weight "
                "(tie a loss only to the lookup of the same tensor, or of a cast of it)"
            )

    def hand_over(self, dw32: torch.Tensor, scale: torch.Tensor) -> bool:
        """Called by the loss's backward: keep its float32 weight gradient (unscaled) and
        its scale for the lookup's backward and return True if that will run in this
        backward pass; else False (the loss then returns its gradient itself)."""
        node = None if self._node is None else self._node()
        if node is None or not _will_run(node):
            return False
        self._deposits.append((dw32, scale))
        return True

    def take(self):
        """(float32 gradient, scale) handed over since the last call, or None."""
        deposits, self._deposits = self._deposits, []
        if not deposits:
            return None
        if len(deposits) == 1:
            return deposits[0]
        # (two losses over one lookup: their scaled sum, scale 1)
        total = sum(d * s for d, s in deposits)
        return total, torch.ones((), dtype=torch.float32, device=total.device)


def _will_run(node) -> bool:
    """The engine will run ``node`` in the backward pass under way. Where it cannot say
    (a backward not run by the engine itself, e.g. compiled autograd), False: the loss
    then returns its own gradient, which is always correct."""
    try:
        return bool(torch._C._will_engine_execute_node(node))
    except RuntimeError:
        return False


class _Lookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight, ids, padding_idx, link):
        ctx.save_for_backward(ids)
        ctx.padding_idx, ctx.link, ctx.shape, ctx.dtype = padding_idx, link, weight.shape, weight.dtype
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, demb):
        (ids,) = ctx.saved_tensors
        flat = ids.reshape(-1)
        g = demb.reshape(-1, demb.shape[-1])
        held = None if ctx.link is None else ctx.link.take()
        if held is None:  # untied, or the loss returned its own gradient: the embedding's alone
            dw = embedding_weight_grad(g, flat, ctx.padding_idx, ctx.shape[0], ctx.dtype)
        else:
            dw = tied_weight_grad(held[0], held[1], g, flat, ctx.padding_idx, ctx.dtype)
        return dw, None, None, None


def tied_embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None,
                   link: TiedLink) -> torch.Tensor:  # fmt: skip
    """``F.embedding(ids, weight, padding_idx)``, tied through ``link`` to a
    ``linear_cross_entropy(..., tied=link)`` over the same ``weight`` (module docstring).
    ``padding_idx``: None or in [-V, V) (a negative one counted from the end, as
    ``F.embedding`` takes it)."""
    if not isinstance(link, TiedLink):
        raise TypeError(f"link must be a codetta.ops.TiedLink, got {type(link).__name__}")
    return _lookup(ids, weight, padding_idx, link)


def embedding(ids: torch.Tensor, weight: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
    """``F.embedding(ids, weight, padding_idx)`` whose weight gradient is formed in one pass
    over the table (module docstring); the same values, rounded once from float32 sums."""
    return _lookup(ids, weight, padding_idx, None)


def _lookup(ids, weight, padding_idx, link):
    if ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"ids must be int64 or int32, got {ids.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be [V, d], got {tuple(weight.shape)}")
    V = weight.shape[0]
    if padding_idx is not None and not -V <= padding_idx < V:
        raise ValueError(f"padding_idx must be None or in [-{V}, {V}), got {padding_idx}")
    if padding_idx is not None and padding_idx < 0:  # (as F.embedding: counted from the end)
        padding_idx += V
    if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and weight.requires_grad):
        return F.embedding(ids, weight, padding_idx)
    out = _Lookup.apply(weight, ids, padding_idx, link)
    if link is not None:
        link.bind(out, weight)
    return out
