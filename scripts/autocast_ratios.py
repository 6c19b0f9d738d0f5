"""How far ``CODETTA_AUTOCAST=cast`` is from autocast itself, per gradient, over seeds.

For each seed: a tiny Llama (test_hf's widths: d 64, 2 layers, 4/2 heads of 16, norm
weights from [0.5, 1.5)), float32 parameters, one training step (labels, the loss) in
float64 (the reference), under ``torch.autocast`` (the unpatched model: its residual
stream stays float32), in the model held in the low dtype, and patched under autocast
with the cast mode (its residual stream in the low dtype). Per parameter gradient, the
error against float64 as a relative Frobenius norm and as a max abs error (the tests'
``err``); prints per seed the median and largest ratio of the cast mode's error to
autocast's, and of the held model's to autocast's: how much of the cast mode's distance
from autocast is that of any model held in the low dtype (NOTES.md).

Usage (CPU, repo root): TRITON_INTERPRET=1 python scripts/autocast_ratios.py [seeds] [dtype]
(dtype float16, the default, runs the interpreter's kernels; bfloat16 the programs'
PyTorch references, the interpreter's bfloat16 dot products being wrong)
"""

from __future__ import annotations

import copy
import os
import statistics
import sys

if __name__ == "__main__":  # (run as a program; imported by a test, it must not switch the
    # interpreter on for the rest of that process: a GPU test process then ran torch.compile's
    # own kernels through it, run 250)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import codetta  # noqa: E402
from codetta.kernels.settings import override  # noqa: E402


def model_of(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                   max_position_embeddings=64, tie_word_embeddings=False,
                                   attn_implementation="sdpa", rms_norm_eps=1e-5)  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand_like(p) + 0.5)
    return model


def step(model, ids, labels, low=None, cast=False):
    """(loss, {name: gradient in float64}) of one step, under autocast to ``low`` if given."""
    model.zero_grad(set_to_none=True)
    ctx = torch.autocast("cpu", dtype=low) if low is not None else torch.autocast("cpu", enabled=False)
    with ctx, override(autocast="cast" if cast else "own-forward"):
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward()
    return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()}


def ratios(seed: int, low) -> dict:
    """{measure: {variant: [per-gradient error / autocast's]}} for one seed."""
    base = model_of(seed)
    g = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, 128, (2, 12), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100
    _, want = step(copy.deepcopy(base).double(), ids, labels)
    _, amp = step(copy.deepcopy(base), ids, labels, low)
    _, held = step(copy.deepcopy(base).to(low), ids, labels)
    _, cast = step(codetta.apply_codetta(copy.deepcopy(base)), ids, labels, low, cast=True)
    measures = {
        "frobenius": lambda x, ref: ((x - ref).norm() / ref.norm()).item(),
        "max abs": lambda x, ref: (x - ref).abs().max().item(),
    }
    out = {}
    for what, err in measures.items():
        out[what] = {
            name: [err(got[n], want[n]) / err(amp[n], want[n]) for n in want]
            for name, got in (("cast", cast), ("held", held))
        }
    return out


def main() -> None:
    seeds = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    low = getattr(torch, sys.argv[2]) if len(sys.argv) > 2 else torch.float16
    print(f"error / autocast's error against float64, per gradient ({low}, {seeds} seeds)")
    for seed in range(seeds):
        for what, by in ratios(seed, low).items():
            line = ", ".join(
                f"{name} median {statistics.median(r):.2f} max {max(r):.2f}" for name, r in by.items()
            )
            print(f"seed {seed} {what:9s}: {line}")


if __name__ == "__main__":
    main()
