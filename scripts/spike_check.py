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
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loss_curve as lc  # noqa: E402

# each way of step_errors as a run of loss_curve.train
RUN_OF = {
    "autocast": "unpatched",
    "cast": "codetta",
    "cast:reference": "codetta:reference",
    "float32": "float32",
}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--at", type=int, default=23)
    p.add_argument("--follow", type=int, default=6)
    p.add_argument(
        "--small", action="store_true", help="the d-128 model of loss_curve --cpu on the CPU (a smoke test)"
    )
    args = p.parse_args(argv)
    where = dict(batch=(2, 32), device="cpu", size=lc.CPU_SIZE) if args.small else {}
    init, batches = lc.setup(True, args.at + args.follow + 1, seed=args.seed, **where)
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
        out = lc.train(
            init, batches[args.at : args.at + args.follow + 1], RUN_OF[w], True, start=kept[args.at]
        )
        print(f"  {w:>15}: " + " ".join(f"{v:.3f}" for v in out))


if __name__ == "__main__":
    main()
