"""What a training step launches, counted on the CPU: codetta's GEMMs (by program), its row
passes (by kernel) and the PyTorch operators around them, for eager Hugging Face and for
the codetta drop-in on the same tiny Llama (the interpreter runs the kernels; the counts do
not depend on the widths).

Where a step is host-bound (two 1B-width layers at 4096 tokens: NOTES.md, runs 189-191),
its host time is about launches x host time per launch, so this is the census a thinner
host path has to shrink. PyTorch operators that launch no kernel on a GPU (views,
allocations, metadata) are counted apart. On the CPU a few paths differ from the GPU's: SDPA
is one CPU kernel here and one or two on the GPU, and the loss checks its targets on the
host here (NOTES.md has the GPU's profile).

Usage (repo root): python scripts/launch_census.py [--layers 2] [--tokens 64]
"""

from __future__ import annotations

import argparse
import collections
import os

if __name__ == "__main__":  # (run as a program; imported by a test, it must not switch the
    # interpreter on for the rest of that process: a GPU test process then ran torch.compile's
    # own kernels through it, run 250)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from codetta.bench import model as mb  # noqa: E402
from codetta.kernels import launch, precompile  # noqa: E402

# aten operators that launch no GPU kernel: views, allocations, metadata
NO_KERNEL = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "as_strided", "slice",
    "select", "unsqueeze", "squeeze", "detach", "alias", "split", "split_with_sizes", "unbind",
    "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "lift_fresh",
    "sym_size", "sym_stride", "sym_numel", "is_same_size", "_has_compatible_shallow_copy_type",
}  # fmt: skip


KERNEL_MARK = "codetta kernel"  # (the interpreter's own aten operators run under it: not counted)


def _aten_ops(prof) -> tuple[collections.Counter, collections.Counter]:
    """(ops that launch kernels, ops that launch none) among the profile's outermost aten
    operators (those inside codetta's custom ops too, none inside its kernels)."""
    kernels, free = collections.Counter(), collections.Counter()
    for ev in prof.events():
        if not ev.name.startswith("aten::"):
            continue
        up, inner = ev.cpu_parent, False
        while up is not None and not inner:
            inner = up.name.startswith("aten::") or up.name == KERNEL_MARK
            up = up.cpu_parent
        if not inner:
            name = ev.name.removeprefix("aten::")
            (free if name in NO_KERNEL else kernels)[name] += 1
    return kernels, free


def census(step) -> dict:
    """{"gemm": Counter(program), "rows": Counter(kernel), "aten": Counter, "free": Counter}
    of one ``step()``."""
    gemms, rows = collections.Counter(), collections.Counter()
    run, row_launch = launch._run, precompile.launch

    def counted_run(call, cfg, outs, ws, warmup=False):
        if not warmup:
            gemms[call.program.name] += 1
        with torch.profiler.record_function(KERNEL_MARK):
            return run(call, cfg, outs, ws, warmup)

    def counted_launch(kernel, grid, *args, **kwargs):
        rows[getattr(kernel, "__name__", None) or kernel.fn.__name__] += 1
        with torch.profiler.record_function(KERNEL_MARK):
            return row_launch(kernel, grid, *args, **kwargs)

    launch._run, precompile.launch = counted_run, counted_launch
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
    finally:
        launch._run, precompile.launch = run, row_launch
    kernels, free = _aten_ops(prof)
    return {"gemm": gemms, "rows": rows, "aten": kernels, "free": free}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    config = mb.model_config("1B-layers", hidden_size=64, intermediate_size=128, num_attention_heads=4,
                             num_key_value_heads=2, head_dim=16, max_position_embeddings=args.tokens,
                             num_hidden_layers=args.layers)  # fmt: skip
    # (float16: the interpreter runs bfloat16 GEMMs through the PyTorch reference instead)
    base = mb.make_model(config, device="cpu", dtype=torch.float16)
    ids = torch.randint(0, config.vocab_size, (1, args.tokens))
    results = {}
    for name in ("eager", "codetta"):
        step = mb.variant_step(name, base, ids, ids, optimizer=False)
        step()  # (first call: tuning memo, derived tables)
        results[name] = census(step)
    print(f"one forward + backward of {args.layers} Llama layers, the LM head and the loss:")
    for name, c in results.items():
        n_aten, n_free = sum(c["aten"].values()), sum(c["free"].values())
        print(f"\n== {name}: {sum(c['gemm'].values())} codetta GEMMs, {sum(c['rows'].values())} codetta row "
              f"passes, {n_aten} PyTorch ops that launch kernels, {n_free} that launch none")  # fmt: skip
        for key in ("gemm", "rows", "aten"):
            if c[key]:
                print(f"   {key:5s} " + ", ".join(f"{k} {v}" for k, v in c[key].most_common()))


if __name__ == "__main__":
    main()
