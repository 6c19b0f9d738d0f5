"""Two tuned tables in one run: a model step with the shipped table against the same step
with an earlier table's picks (GPU machine).

The earlier table (``BEFORE``: a file in the shipped format, e.g. ``git show
<commit>:codetta/kernels/tuned/nvidia-h200.json > before.json``) is given to the second
variant as its user tuning cache (the Chooser asks the user's cache before the shipped
table), holding only the entries that differ from the shipped table's; every other key
runs the shipped pick in both. Each variant is a training step (or forward + backward,
``--step fwd-bwd``) of its own copy of the model, as in ``bench --parts model``; both are
timed with the floor under paired and sustained-block timing (``--rounds`` repeats).
Prints each variant's time / floor and before / after, and writes ``$OUT/table-ab.json``.

Usage (repo root, GPU): python scripts/table_ab.py BEFORE [--cases llama-3.2-1B 1B-layers]
    [--batch 1] [--step train|fwd-bwd] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import torch

from codetta.bench import harness
from codetta.bench import model as mb
from codetta.kernels import device, tuning
from codetta.kernels.configs import config_from_dict
from codetta.kernels.settings import override


def before_cache(before: dict) -> tuple[Path, int]:
    """A tuning-cache folder holding the entries of ``before`` that the shipped table
    lacks or picks otherwise: (the folder, how many)."""
    shipped = tuning.CHOOSER.shipped(0)
    folder = Path(tempfile.mkdtemp(prefix="codetta-before-"))
    differ = {}
    for key, entry in before.items():
        cfg = config_from_dict(entry)
        if shipped.get(key) != cfg:
            differ[key] = cfg
    with override(cache_dir=folder):
        cache = tuning.CHOOSER.cache(0)
        for key, cfg in differ.items():
            cache.put(key, cfg)  # (rewrites the file each time: a few hundred entries at most)
    tuning.CHOOSER.clear()
    return folder, len(differ)


def run_case(case: str, folder: Path, batch: int, step_kind: str) -> dict:
    config = mb.model_config(case)
    train = step_kind == "train"
    base = mb.make_model(config)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, mb.SEQ), device="cuda", generator=g)
    fns = {"floor": mb.floor_step(config, batch, mb.SEQ)}
    # (the shipped variant with an empty cache of its own: no pick of an earlier tuning here)
    for name, changes in (("shipped", harness.ab_settings("shipped")),
                          ("before", {"cache_dir": folder, "autotune": False})):  # fmt: skip
        step = mb.variant_step("codetta", base, ids, ids, changes=changes, optimizer=train)
        step.precompile()
        step()
        fns[name] = step
    del base
    times = harness.compare(fns, precompile=False)
    mb.check_after_timing(case, fns)
    host = {k: harness.host_ms(fn) for k, fn in fns.items()}
    label = mb.case_label(case, step_kind, batch)
    b, s, o = times["floor"], times["shipped"], times["before"]
    print(f"== {label}: floor {b.paired:.2f} / {b.sustained:.2f} ms (paired / sustained)")
    for name in ("shipped", "before"):
        t = times[name]
        print(f"   {name:<8} {t.paired:8.2f} / {t.sustained:8.2f} ms, x floor {t.paired / b.paired:.3f} / "
              f"{t.sustained / b.sustained:.3f}, host {host[name]:.1f} ms to issue a step"
              + (f"  ({harness.round_spread(t, b)})" if t.rounds else ""))  # fmt: skip
    print(f"   before / shipped {o.paired / s.paired:.3f} / {o.sustained / s.sustained:.3f}")
    return {
        "case": label,
        "ms": {k: dict(paired=t.paired, sustained=t.sustained, rounds=t.rounds) for k, t in times.items()},
        "host_ms": host,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("before", help="a tuned table in the shipped format (the picks to set against)")
    ap.add_argument("--cases", nargs="+", default=["llama-3.2-1B"], choices=list(mb.CASES))
    ap.add_argument("--batch", type=int, default=1, help=f"sequences of {mb.SEQ} tokens per step")
    ap.add_argument("--step", default="train", choices=list(mb.STEPS))
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    harness.OPTIONS.rounds = args.rounds
    before = json.loads(Path(args.before).read_text())["entries"]
    folder, n = before_cache(before)
    print(f"{device.name(0)}: {n} entries of {args.before} differ from the shipped table's")
    rows = [run_case(case, folder, args.batch, args.step) for case in args.cases]
    out = Path(os.environ.get("OUT", "."))
    (out / "table-ab.json").write_text(json.dumps({"differing": n, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
