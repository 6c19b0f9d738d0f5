"""Peak memory of the LM head + loss, forward + backward, beyond its inputs, the weight
and their gradients (issue 15's measure; GPU machine).

For each shape of ``codetta.bench.ce.CASES``: codetta's default (row chunks, float32
dW accumulator), its low-memory mode (``vocab_chunk`` slices of 2048, 4096, 8192
classes) and Liger's fused linear cross-entropy, each run once after a warm-up call:
the allocator's peak during ``autograd.grad(loss, (x, w))`` minus what was allocated
before it minus the two gradients it returns (x's and w's size). Also each variant's
loss against codetta's default (the same float32 math: within rounding).

Usage (repo root): PYTHONPATH=. python scripts/ce_memory.py
"""

from __future__ import annotations

import torch

from codetta.bench import ce
from codetta.ops import linear_cross_entropy

MIB = 2**20


def beyond_mib(fn, x, w, t) -> tuple[float, float]:
    """(peak MiB beyond inputs, weight and their gradients, the loss) of one fwd+bwd."""
    fn(x, w, t)  # warm-up: compile, tune, allocate workspaces
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = fn(x, w, t)
    grads = torch.autograd.grad(loss, (x, w))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    own = sum(g.numel() * g.element_size() for g in grads)
    return (peak - own) / MIB, float(loss.detach())


def main() -> None:
    variants = {"codetta": ce.codetta}
    for chunk in (2048, 4096, 8192):
        variants[f"codetta:vocab_chunk={chunk}"] = lambda x, w, t, c=chunk: linear_cross_entropy(
            x, w, t, vocab_chunk=c
        )
    liger = ce.liger_fn()
    if liger is not None:
        variants["liger"] = liger
    print(f"{'case':28s} {'variant':28s} {'MiB beyond':>11s} {'loss - codetta':>15s}")
    for tokens, d, V in ce.CASES:
        p = ce.problem(tokens, d, V)
        (x, w), t = p["leaves"], p["target"]
        ref = None
        for name, fn in variants.items():
            mib, loss = beyond_mib(fn, x, w, t)
            ref = loss if ref is None else ref
            print(f"T {tokens} d {d} V {V:<10d} {name:28s} {mib:11.1f} {loss - ref:15.2e}", flush=True)
        del p, x, w, t
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
