"""One training step taken apart: at the state a run of ``scripts/loss_curve.py`` reaches
after N steps, each way of computing the gradient (autocast, the cast mode, the cast mode
on its PyTorch references, float32) against float64, per parameter, and the loss one AdamW
step with each gradient leads to (NOTES.md, run 206: the amp curve's spike at seed 0).

Usage (repo root, GPU): python3 scripts/spike_check.py [--seed 0] [--at 23] [--follow 6]
  --at      the state: the cast-mode run after this many steps (its own trajectory)
  --follow  then this many more steps from that state by each way, losses printed
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import loss_curve  # noqa: E402

import codetta  # noqa: E402
from codetta.kernels.settings import override  # noqa: E402

WAYS = ("autocast", "cast", "cast:reference", "float32")


def grads(model, ids, way: str) -> tuple[float, dict]:
    """(loss, {name: gradient in float64}) of ``model`` (float32 weights) computed by ``way``."""
    m = copy.deepcopy(model)
    if way.startswith("cast"):
        codetta.apply_codetta(m, autocast="cast")
    dev = ids.device.type
    with override(force_reference=way == "cast:reference"):
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=way != "float32"):
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    return loss.item(), {n: p.grad.double() for n, p in m.named_parameters()}


def exact(model, ids) -> tuple[float, dict]:
    m = copy.deepcopy(model).double()
    loss = m(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.item(), {n: p.grad for n, p in m.named_parameters()}


def group(name: str) -> str:
    """A parameter's kind: the layer index left out."""
    parts = [p for p in name.split(".") if not p.isdigit()]
    return ".".join(parts[-2:])


def step_with(model, opt_state, grad: dict, lr: float):
    """The model after one AdamW step with ``grad``, from the optimizer state ``opt_state``."""
    m = copy.deepcopy(model)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, fused=torch.cuda.is_available())
    opt.load_state_dict(copy.deepcopy(opt_state))
    for n, p in m.named_parameters():
        p.grad = grad[n].to(p.dtype)
    opt.step()
    return m, opt


def train_steps(model, opt, batches, way: str) -> list[float]:
    m = model
    if way.startswith("cast"):
        codetta.apply_codetta(m, autocast="cast")
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
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--small", action="store_true", help="a tiny model on the CPU (a smoke test)")
    args = p.parse_args(argv)
    lr = args.lr
    dev = "cpu" if args.small else "cuda"
    small = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
    )
    init, batches = loss_curve.setup(
        True,
        args.at + args.follow + 1,
        batch=(2, 32) if args.small else (8, 512),
        device=dev,
        size=small if args.small else None,
        seed=args.seed,
    )
    # the cast mode's own trajectory to the state
    run = copy.deepcopy(init)
    codetta.apply_codetta(run, autocast="cast")
    opt = torch.optim.AdamW(run.parameters(), lr=lr, fused=torch.cuda.is_available())
    losses = []
    for ids in batches[: args.at]:
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = run(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    print("cast-mode run to the state:", " ".join(f"{v:.3f}" for v in losses))
    state = copy.deepcopy(init)
    state.load_state_dict(run.state_dict())
    opt_state = opt.state_dict()
    del run, opt
    ids = batches[args.at]
    loss64, g64 = exact(state, ids)
    print(f"state after {args.at} steps: float64 loss {loss64:.5f}")
    res = {w: grads(state, ids, w) for w in WAYS}
    kinds = sorted({group(n) for n in g64})
    print(f"{'relative error (norm)':>28} " + " ".join(f"{w:>15}" for w in WAYS))
    for k in kinds:
        names = [n for n in g64 if group(n) == k]
        ref = torch.cat([g64[n].flatten() for n in names])
        row = []
        for w in WAYS:
            got = torch.cat([res[w][1][n].flatten() for n in names])
            row.append(((got - ref).norm() / ref.norm()).item())
        print(f"{k:>28} " + " ".join(f"{v:15.3e}" for v in row))
    # the worst single tensors of the cast mode, against autocast's error on them
    ratios = []
    for n in g64:
        ea = (res["autocast"][1][n] - g64[n]).norm()
        ec = (res["cast"][1][n] - g64[n]).norm()
        ratios.append(((ec / ea.clamp_min(1e-30)).item(), n, ea.item(), ec.item(), g64[n].norm().item()))
    print("the cast mode's largest error / autocast's, per tensor:")
    for r, n, ea, ec, gn in sorted(ratios, reverse=True)[:8]:
        print(f"  {r:7.2f}x {n}: autocast {ea:.3e}, cast {ec:.3e}, |g| {gn:.3e}")
    print(
        f"{'loss at the step':>28} "
        + " ".join(f"{res[w][0]:15.5f}" for w in WAYS)
        + f"  (float64 {loss64:.5f})"
    )
    # one AdamW step with each gradient (float64's too): the update's error against float64's
    # update, per kind, and the next batch's loss in float64
    nxt = batches[args.at + 1]
    before = {n: q.detach().double() for n, q in state.named_parameters()}
    deltas, after = {}, {}
    for w, g in [("float64", g64)] + [(w, res[w][1]) for w in WAYS]:
        m, _ = step_with(state, opt_state, g, lr)
        deltas[w] = {n: q.detach().double() - before[n] for n, q in m.named_parameters()}
        with torch.no_grad():
            after[w] = m.double()(input_ids=nxt, labels=nxt, use_cache=False).loss.item()
        del m
    print(f"{'AdamW update error (norm)':>28} " + " ".join(f"{w:>15}" for w in WAYS))
    for k in kinds:
        names = [n for n in g64 if group(n) == k]
        ref = torch.cat([deltas["float64"][n].flatten() for n in names])
        row = [(torch.cat([deltas[w][n].flatten() for n in names]) - ref).norm() / ref.norm() for w in WAYS]
        print(f"{k:>28} " + " ".join(f"{v.item():15.3e}" for v in row))
    print(
        f"{'next batch, float64 loss':>28} "
        + " ".join(f"{after[w]:15.5f}" for w in WAYS)
        + f"  (float64's step {after['float64']:.5f})"
    )
    # each way on from the state for --follow steps
    print(f"{args.follow} more steps from the state, each way (losses):")
    for w in WAYS:
        m = copy.deepcopy(state)
        o = torch.optim.AdamW(m.parameters(), lr=lr, fused=torch.cuda.is_available())
        o.load_state_dict(copy.deepcopy(opt_state))
        out = train_steps(m, o, batches[args.at : args.at + args.follow + 1], w)
        print(f"  {w:>15}: " + " ".join(f"{v:.3f}" for v in out))
        del m, o


if __name__ == "__main__":
    main()
