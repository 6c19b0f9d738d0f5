"""One training step taken apart: at the state the cast mode's run of ``scripts/loss_curve.py``
reaches after N steps, each way of computing the gradient (autocast, the cast mode, the cast
mode on its PyTorch references, float32) against float64, per parameter kind, for the
gradient and the AdamW update made with it, and the loss that update leads to; then a few
more steps from that state by each way (NOTES.md, runs 206-207: the amp curve's spike at
seed 0 comes back from the state whichever way computes the steps, float32's included).

``--draws N``: instead, the gradient errors at that state by autocast and the cast mode N
times, each from the state's weights moved by 2^-``--jitter`` of themselves (draw 0 not
moved), each draw against its own float64 gradient: whether one way is worse at the state
or the two swing alike (a state in the loss's drop swung either way's error 3-4x: NOTES.md,
runs 206-210); per parameter kind the median and range over the draws, and per layer for
the kinds named by ``--layers``.

Usage (repo root, GPU): python3 scripts/spike_check.py [--seed 0] [--at 23] [--follow 6]
[--draws N --jitter 10 --layers v_proj.weight]
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
    p.add_argument("--draws", type=int, default=0)
    p.add_argument("--jitter", type=float, default=10.0, help="weights moved by 2^-JITTER of themselves")
    p.add_argument("--layers", nargs="*", default=["v_proj.weight"])
    p.add_argument("--ways", nargs="*", default=["autocast", "cast"], help="with --draws: two or more")
    args = p.parse_args(argv)
    if args.draws and len(args.ways) < 2:
        p.error("--draws compares ways: give --ways A B [...] (the ratio column: B's error over A's)")
    where = dict(batch=(2, 32), device="cpu", size=lc.CPU_SIZE) if args.small else {}
    init, batches = lc.setup(True, args.at + args.follow + 1, seed=args.seed, **where)
    kept = {}
    losses = lc.train(init, batches[: args.at + 1], "codetta", True, keep={args.at}, kept=kept)
    print("the cast mode's run to the state:", " ".join(f"{v:.3f}" for v in losses[: args.at]))
    if args.draws:
        draws(init, kept[args.at][0], batches[args.at], args)
        return
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


def draws(init, weights, ids, args) -> None:
    """``--draws``: each way's gradient error per kind (and per layer for ``--layers``) at
    ``weights`` moved slightly, ``args.draws`` times; a table of median [min, max]."""
    import copy

    state = copy.deepcopy(init)
    errs = {}  # (way, row) -> [error per draw]
    for d in range(args.draws):
        state.load_state_dict(lc.nudged(weights, args.jitter, d) if d else weights)
        _, exact = lc._loss_and_grads(state, ids, "float64")
        rows = {}
        for n in exact:
            rows.setdefault(lc.kind(n), []).append(n)
            if lc.kind(n) in args.layers:
                rows[n.replace("model.", "").replace("self_attn.", "")] = [n]
        for way in args.ways:
            _, got = lc._loss_and_grads(state, ids, way)
            for r, names in rows.items():
                e = (lc.cat(got, names) - lc.cat(exact, names)).norm() / lc.cat(exact, names).norm()
                errs.setdefault((way, r), []).append(e.item())
        print(f"draw {d}: " + " ".join(f"{w} {r} {errs[(w, r)][-1]:.2e}" for w in args.ways
                                       for r in args.layers if (w, r) in errs))  # fmt: skip
    print(f"gradient error (norm) over {args.draws} draws (weights moved by 2^-{args.jitter:g}): "
          "median [min, max] per way; last: the second way's over the first's, median [range]")  # fmt: skip
    for r in dict.fromkeys(r for _, r in errs):
        cells = []
        for w in args.ways:
            v = sorted(errs[(w, r)])
            cells.append(f"{v[len(v) // 2]:.2e} [{v[0]:.1e}, {v[-1]:.1e}]")
        ratios = sorted(c / a for c, a in zip(errs[(args.ways[1], r)], errs[(args.ways[0], r)]))
        mid = ratios[len(ratios) // 2]
        print(f"{r:>40} " + "  ".join(cells) + f"  {mid:.2f}x [{ratios[0]:.2f}, {ratios[-1]:.2f}]")


if __name__ == "__main__":
    main()
