"""Loss curves of a small Llama on a learnable synthetic token stream, patched against
unpatched, with the unpatched model's own run-to-run noise beside them
(``tests/test_hf.py::test_loss_curve_tracks_unpatched_on_gpu`` uses it; NOTES.md, runs 204+).

The stream: a fixed random bigram table over 64 of the vocabulary's tokens, two successors
each, sampled (the loss's floor is ln 2, reached well before 200 steps at the test's size).
Runs, each from the same initial weights and batches unless said:
  unpatched   the model's own forward
  again       the same again (only nondeterministic kernels differ)
  jittered    every gradient element moved by 2^-9 (about one bf16 rounding) every step:
              the per-step difference any other correct kernel makes
  moved       the initial weights moved by 2^-8 (about one bf16 rounding)
  codetta     the patched model (under ``--amp`` its cast mode)
  codetta:pingpong-off   the same with the ping-pong mainloop left out (CODETTA_PINGPONG=0)
  codetta:reference      the same with every codetta operator on its PyTorch reference
                         (``force_reference``: the math without the kernels)
  float32     the unpatched model with no autocast (under ``--amp``: float32 throughout, the
              near-exact curve both mixed-precision runs depart from; on the CPU, seeds 0-2,
              autocast departed from it by 0.061, 0.204 and 0.018 at steps 20-40 and the cast
              mode by 0.106, 0.007 and 0.023: NOTES.md)

Usage (repo root, GPU): python3 scripts/loss_curve.py [--amp] [--steps 200] [--seed N ...]
[--runs NAME ...] [--out FILE.json]
prints each run's 20-step means, then each codetta run's largest gap to the unpatched
curve against the noise runs' largest; last a table over the seeds: each run's largest gap
to the float32 curve. ``--replot FILE.json ...`` reads ``--out`` files instead of training,
``--plot FILE.png`` draws the first seed's curves and every seed's gaps.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import warnings

import torch
import transformers

import codetta
from codetta.integrations import hf
from codetta.kernels.settings import override

NOISE = ("again", "jittered", "moved")
# (the test's size: d 1024, 8 layers, V 32000, 8 x 512 tokens a step)
CPU_SIZE = dict(vocab_size=2048, hidden_size=128, intermediate_size=352, num_hidden_layers=4,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=256)  # fmt: skip
GPU_SIZE = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                num_attention_heads=16, num_key_value_heads=4, head_dim=64,
                max_position_embeddings=1024)  # fmt: skip


def setup(amp: bool, steps: int, batch=(8, 512), device="cuda", size=None, seed: int = 0):
    """(initial model, batches): the Llama (float32 under ``amp``, else bf16) and the stream;
    ``seed`` draws another initial model and stream (0: the test's)."""
    cfg = transformers.LlamaConfig(tie_word_embeddings=False, attn_implementation="sdpa", rms_norm_eps=1e-5,
                                   **(size or GPU_SIZE))  # fmt: skip
    torch.manual_seed(seed)
    init = transformers.LlamaForCausalLM(cfg).to(device, torch.float32 if amp else torch.bfloat16)
    g = torch.Generator(device=device).manual_seed(5 + seed)
    used = torch.randperm(cfg.vocab_size, device=device, generator=g)[:64]
    table = used[torch.randint(0, 64, (cfg.vocab_size, 2), device=device, generator=g)]
    rows, length = batch
    batches = []
    for _ in range(steps):
        ids = torch.empty(rows, length, dtype=torch.long, device=device)
        ids[:, 0] = used[torch.randint(0, 64, (rows,), device=device, generator=g)]
        choice = torch.randint(0, 2, (rows, length), device=device, generator=g)
        for t in range(1, length):
            ids[:, t] = table[ids[:, t - 1], choice[:, t]]
        batches.append(ids)
    return init, batches


def moved(init, device="cuda"):
    """A copy of the initial weights, each moved by 2^-8 of itself (about one bf16 rounding)."""
    m = copy.deepcopy(init)
    g = torch.Generator(device=device).manual_seed(9)
    with torch.no_grad():
        for p in m.parameters():
            p.copy_((p.float() * (1 + 2**-8 * torch.randn(p.shape, device=device, generator=g))).to(p.dtype))
    return m


def nudged(weights: dict, bits: float, seed: int) -> dict:
    """A copy of a state dict's float tensors each moved by 2^-``bits`` of themselves
    (``seed``'s draw): the same state with other rounding decisions in every low-precision
    way, each judged against its own float64 (a state in the loss's drop swings either
    way's error 3-4x from one such draw to the next: NOTES.md, run 214)."""
    out = {}
    for i, (n, t) in enumerate(weights.items()):
        if t.is_floating_point():
            g = torch.Generator(device=t.device.type).manual_seed(100003 * seed + i)
            # (in float32: a bf16 factor 1 + 2^-10 x would round to 1)
            t = (t.float() * (1 + 2**-bits * torch.randn(t.shape, device=t.device, generator=g))).to(t.dtype)
        out[n] = t
    return out


def train(init, batches, name: str, amp: bool, lr=3e-4, keep=(), kept=None, start=None) -> torch.Tensor:
    """One run (module docstring) from ``init``: its loss at every step. ``keep``: steps
    before which the run's state is copied into ``kept[step]`` as (weights, AdamW state);
    ``start``: such a state to run from instead (``init`` then gives the structure)."""
    device = next(init.parameters()).device
    m = moved(init, device.type) if name == "moved" else copy.deepcopy(init)
    if start is not None:
        m.load_state_dict(start[0])
    patched = name.startswith("codetta")
    if patched:
        codetta.apply_codetta(m, autocast="cast")
    settings = {"codetta:pingpong-off": {"pingpong": False}, "codetta:reference": {"force_reference": True}}
    jg = torch.Generator(device=device.type).manual_seed(11)
    opt = torch.optim.AdamW(m.parameters(), lr=lr, fused=device.type == "cuda")
    if start is not None:
        opt.load_state_dict(copy.deepcopy(start[1]))
    losses = []
    with fused_guard(name if patched else None), override(**settings.get(name, {})):
        for step, ids in enumerate(batches):
            if step in keep:
                kept[step] = (copy.deepcopy(m.state_dict()), copy.deepcopy(opt.state_dict()))
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp and name != "float32"):
                loss = m(input_ids=ids, labels=ids, use_cache=False).loss
            loss.backward()
            if name == "jittered":
                with torch.no_grad():
                    for p in m.parameters():
                        p.grad.mul_(1 + 2**-9 * torch.randn(p.grad.shape, device=device, generator=jg))
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    return torch.tensor(losses)


@contextlib.contextmanager
def fused_guard(name: str | None):
    """Raises when the patched model ``name`` fell back to its own forward inside (the
    drop-in warns once per reason and process: its memory of warnings is cleared first,
    so a fallback shows whatever ran before); ``None``: no check."""
    hf._FALLBACK_WARNED.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    if name is not None and [w for w in caught if "runs its own forward" in str(w.message)]:
        raise RuntimeError(f"{name}: the fused path fell back")


def smooth(x: torch.Tensor, window: int) -> torch.Tensor:
    return x.unfold(0, window, window).mean(1)


WAYS = ("autocast", "cast", "cast:reference", "float32")


def _loss_and_grads(model, ids, way: str) -> tuple[float, dict]:
    """(loss, {name: gradient in float64}) of ``model`` (float32 weights) at ``ids`` by ``way``:
    autocast to bf16, the cast mode, the cast mode on its operators' PyTorch references,
    float32, or float64."""
    m = copy.deepcopy(model)
    if way == "float64":
        m.double()
    if way.startswith("cast"):
        codetta.apply_codetta(m, autocast="cast")
    amp = way not in ("float32", "float64")
    reference = override(force_reference=True) if way == "cast:reference" else contextlib.nullcontext()
    with fused_guard(way if way.startswith("cast") else None), reference:
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=amp):
            loss = m(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
    return loss.item(), {n: p.grad.double() for n, p in m.named_parameters()}


def kind(name: str) -> str:
    """A parameter's kind: its name without the layer index (``self_attn.q_proj.weight``)."""
    parts = [p for p in name.split(".") if not p.isdigit()]
    return ".".join(parts[-2:])


def step_errors(init, snapshot, ids, nxt, ways=WAYS) -> dict:
    """One training step taken apart at a run's state (``snapshot``: ``train``'s ``kept``
    entry; ``init`` gives the model's structure): per way, its loss at ``ids``, per parameter
    kind the relative error (norm) of its gradient and of the AdamW update made with it,
    each against float64's, and the float64 loss at ``nxt`` after that update. The update
    is taken in float64 from the saved AdamW state (its learning rate and betas too), so
    that only the gradients differ: a float32 step would round each update to the
    weight's float32 grid, ~2e-4 of an update on a norm weight near 1, for every way."""
    weights, opt_state = snapshot
    state = copy.deepcopy(init)
    state.load_state_dict(weights)
    before = {n: p.detach().double() for n, p in state.named_parameters()}
    out = {}
    for way in ("float64", *ways):
        loss, g = _loss_and_grads(state, ids, way)
        m = copy.deepcopy(state).double()
        opt = torch.optim.AdamW(m.parameters())
        opt.load_state_dict(copy.deepcopy(opt_state))  # (its state cast to float64 as it loads)
        for group in opt.param_groups:  # (the saved groups say fused: the plain loop, in float64)
            group.update(fused=False, foreach=False)
        for n, p in m.named_parameters():
            p.grad = g[n]
        opt.step()
        with torch.no_grad():
            after = m(input_ids=nxt, labels=nxt, use_cache=False).loss.item()
        update = {n: p.detach() - before[n] for n, p in m.named_parameters()}
        out[way] = {"loss": loss, "next": after, "grad": g, "update": update}
        del m, opt
    exact = out["float64"]
    for way in ways:
        errs = {}
        for k in sorted({kind(n) for n in exact["grad"]}):
            names = [n for n in exact["grad"] if kind(n) == k]
            errs[k] = tuple(
                (cat(out[way][what], names) - cat(exact[what], names)).norm().item()
                / cat(exact[what], names).norm().item()
                for what in ("grad", "update")
            )
        out[way]["errors"] = errs
    for res in out.values():
        del res["grad"], res["update"]
    return out


def cat(tensors: dict, names) -> torch.Tensor:
    return torch.cat([tensors[n].flatten() for n in names])


def compare(runs: dict, window: int, noise=NOISE) -> dict:
    """Per codetta run: (largest smoothed gap to the unpatched curve, final-window mean);
    and "noise": the largest gap and final-window spread of the ``noise`` runs present."""
    base = smooth(runs["unpatched"], window)
    final = runs["unpatched"][-window:].mean()
    noise = [n for n in noise if n in runs]
    out = {}
    if noise:
        spread = torch.stack([(smooth(runs[n], window) - base).abs() for n in noise]).amax(0)
        out["noise"] = (spread.max().item(), max(abs(runs[n][-window:].mean() - final).item() for n in noise))
    for name, run in runs.items():
        if name.startswith("codetta"):
            out[name] = ((smooth(run, window) - base).abs().max().item(), run[-window:].mean().item())
    return out


def one_seed(args, seed: int) -> dict:
    """Every run at one seed, its curve and comparisons printed; the runs' losses."""
    if args.cpu:
        init, batches = setup(args.amp, args.steps, batch=(8, 64), device="cpu", size=CPU_SIZE, seed=seed)
    else:
        init, batches = setup(args.amp, args.steps, seed=seed)
    reference = override(force_reference=True) if args.cpu else contextlib.nullcontext()
    with reference:
        runs = {
            n: train(init, batches, n, args.amp, lr=args.lr) for n in dict.fromkeys(["unpatched", *args.runs])
        }
    window = max(1, args.steps // 10)
    print(f"seed {seed}, {window}-step means:")
    for name, run in runs.items():
        print(f"{name:>22}: " + " ".join(f"{v:.3f}" for v in smooth(run, window)), flush=True)
    res = compare(runs, window)
    print(f"unpatched final {runs['unpatched'][-window:].mean():.4f}")
    for name, (gap, final) in res.items():
        what = "largest gap, final spread" if name == "noise" else "largest gap, final"
        print(f"{name:>22}: {what} {gap:.4f} {final:.4f}")
    return runs


def load(path: str) -> dict:
    """{seed: {run: losses}} from an ``--out`` file (one seed's older form too)."""
    with open(path) as f:
        data = json.load(f)
    seeds = data["seeds"] if "seeds" in data else {data["seed"]: data["runs"]}
    return {int(s): {k: torch.tensor(v) for k, v in runs.items()} for s, runs in seeds.items()}


def plot(every: dict, png: str, first_steps: int = 80) -> None:
    """Left: the first seed's per-step losses over the first steps; right: per seed, each
    mixed-precision run's largest gap to the float32 curve (10 windows), autocast's across."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    seed, runs = next(iter(every.items()))
    for name, run in runs.items():
        style = "k-" if name == "float32" else ("-" if name.startswith("codetta") else "--")
        left.plot(run[:first_steps].numpy(), style, label=name, lw=1.6 if name.startswith("codetta") else 1)
    left.set(xlabel="step", ylabel="loss", yscale="log", title=f"seed {seed}: the first {first_steps} steps")
    left.legend(fontsize=8)
    for name in sorted({n for r in every.values() for n in r} - {"unpatched", "float32"}):
        pts = []
        for runs in every.values():
            if "float32" in runs and name in runs:
                pts.append([gap(runs, n) for n in ("unpatched", name)])
        if pts:
            xy = torch.tensor(pts)
            right.scatter(xy[:, 0], xy[:, 1], label=name, s=25)
    top = right.get_xlim()[1]
    right.plot([0, top], [0, top], "k:", lw=1, label="equal")
    right.plot([0, top / 2], [0, top], "k--", lw=0.8, label="twice autocast's")
    right.set(xlabel="autocast's largest gap to float32", ylabel="the run's largest gap to float32",
              title=f"{len(every)} seeds: distance from the float32 curve")  # fmt: skip
    right.legend(fontsize=8, loc="center right")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--amp", action="store_true", help="float32 weights, bf16 autocast, the cast mode")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument(
        "--seed", type=int, nargs="+", default=[0], help="other initial models and streams (0: the test's)"
    )
    p.add_argument("--runs", nargs="+", default=["unpatched", *NOISE, "codetta"])
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument(
        "--cpu",
        action="store_true",
        help="a d-128 4-layer model on the CPU, 8 x 64 tokens a step, the operators on their PyTorch "
        "references (which round where the kernels do): many seeds in minutes",
    )
    p.add_argument("--out", help="also write every run's per-step losses to this JSON file")
    p.add_argument("--replot", nargs="+", metavar="JSON", help="train nothing: read runs from --out files")
    p.add_argument("--plot", metavar="PNG", help="the first seed's curves and every seed's gaps (matplotlib)")
    args = p.parse_args(argv)
    if args.replot:
        every = {}
        for path in args.replot:
            every.update(load(path))
    else:
        every = {seed: one_seed(args, seed) for seed in args.seed}
    if args.out and not args.replot:
        with open(args.out, "w") as f:
            json.dump({"amp": args.amp, "seeds": {s: {k: v.tolist() for k, v in runs.items()}
                                                  for s, runs in every.items()}}, f)  # fmt: skip
    if args.plot:
        plot(every, args.plot)
    gaps(every)


def gaps(every: dict) -> None:
    """Per seed, each run's largest gap to the float32 curve (its 10-window means): the
    table over seeds (seeds without a float32 run left out)."""
    every = {s: runs for s, runs in every.items() if "float32" in runs}
    if not every:
        return
    names = sorted(
        {n for runs in every.values() for n in runs} - {"float32"}, key=lambda n: (n != "unpatched", n)
    )
    print("per seed: each run's largest gap to the float32 curve (10-window means)")
    print(f"{'seed':>6} " + " ".join(f"{n[:22]:>22}" for n in names))
    for seed, runs in every.items():
        cells = [f"{gap(runs, n):.4f}" if n in runs else "-" for n in names]
        print(f"{seed:>6} " + " ".join(f"{c:>22}" for c in cells))
    pairs = [[gap(runs, n) for n in ("unpatched", "codetta")] for runs in every.values() if "codetta" in runs]
    if len(pairs) > 1:
        farther = sum(c > a for a, c in pairs)
        auto, cast = (sorted(x) for x in zip(*pairs))
        print(f"the cast mode farther from float32 than autocast at {farther} of {len(pairs)} seeds; summed "
              f"{sum(cast):.3f} against {sum(auto):.3f}, median {cast[len(cast) // 2]:.4f} against "
              f"{auto[len(auto) // 2]:.4f}")  # fmt: skip


def gap(runs: dict, name: str) -> float:
    """``name``'s largest gap to the float32 curve (10-window means)."""
    window = max(1, len(runs["float32"]) // 10)
    return (smooth(runs[name], window) - smooth(runs["float32"], window)).abs().max().item()


if __name__ == "__main__":
    main()
