"""One training step taken apart: at the state the cast mode's run of ``scripts/loss_curve.py``
reaches after N steps, each way of computing the gradient (autocast, the cast mode, the cast
mode on its PyTorch references, float32) against float64, per parameter kind, for the
gradient and the AdamW update made with it, and the loss that update leads to; then a few
more steps from that state by each way (NOTES.md, runs 206-207: the amp curve's spike at
seed 0 comes back from the state whichever way computes the steps, float32's included).

Usage (repo root, GPU): python3 scripts/spike_check.py [--seed 0] [--at 23] [--follow 6]
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loss_curve as lc  # noqa: E402

import codetta  # noqa: E402
from codetta.kernels.settings import override  # noqa: E402

SMALL = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=64,
)


def follow(init, snapshot, batches, way: str) -> list[float]:
    """Losses of ``len(batches)`` steps by ``way`` from the state ``snapshot``."""
    m = copy.deepcopy(init)
    m.load_state_dict(snapshot[0])
    if way.startswith("cast"):
        codetta.apply_codetta(m, autocast="cast")
    opt = torch.optim.AdamW(m.parameters(), lr=3e-4, fused=batches[0].is_cuda)
    opt.load_state_dict(copy.deepcopy(snapshot[1]))
    out = []
    with override(force_reference=way == "cast:reference"):
        for ids in batches:
            with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=way != "float32"):
                loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            out.append(loss.item())
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--at", type=int, default=23)
    p.add_argument("--follow", type=int, default=6)
    p.add_argument("--small", action="store_true", help="a tiny model on the CPU (a smoke test)")
    args = p.parse_args(argv)
    dev = "cpu" if args.small else "cuda"
    init, batches = lc.setup(True, args.at + args.follow + 1, batch=(2, 32) if args.small else (8, 512),
                             device=dev, size=SMALL if args.small else None, seed=args.seed)  # fmt: skip
    kept = {}
    losses = lc.train(init, batches[: args.at + 1], "codetta", True, keep={args.at}, kept=kept)
    print("the cast mode's run to the state:", " ".join(f"{v:.3f}" for v in losses[: args.at]))
    res = lc.step_errors(init, kept[args.at], batches[args.at], batches[args.at + 1])
    print(f"state after {args.at} steps, float64 loss {res['float64']['loss']:.5f}")
    for i, what in enumerate(("gradient", "AdamW update")):
        print(f"{what + ' error (norm)':>31} " + " ".join(f"{w:>15}" for w in lc.WAYS))
        for k in res["cast"]["errors"]:
            print(f"{k:>31} " + " ".join(f"{res[w]['errors'][k][i]:15.3e}" for w in lc.WAYS))
    print(f"{'loss at the step':>31} " + " ".join(f"{res[w]['loss']:15.5f}" for w in lc.WAYS))
    print(f"{'next batch after the step':>31} " + " ".join(f"{res[w]['next']:15.5f}" for w in lc.WAYS)
          + f"  (float64's step: {res['float64']['next']:.5f})")  # fmt: skip
    print(f"from the state, each way: the loss at its step and {args.follow} more")
    for w in lc.WAYS:
        out = follow(init, kept[args.at], batches[args.at : args.at + args.follow + 1], w)
        print(f"  {w:>15}: " + " ".join(f"{v:.3f}" for v in out))


if __name__ == "__main__":
    main()
