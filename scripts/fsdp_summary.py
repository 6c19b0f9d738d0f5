"""Summary of scripts/fsdp_run.sh's runs (a folder of `codetta train` JSON files): the loss
curves compared pairwise against the measured run-to-run noise, tokens/s per GPU and
their ratios, as markdown; a PNG of the curves where matplotlib is installed.

    python scripts/fsdp_summary.py results/fsdp/<run>
"""

import json
import re
import statistics
import sys
from pathlib import Path

WINDOW = 10  # steps per point of a compared curve (means over windows)


def windows(losses):
    return [sum(losses[i : i + WINDOW]) / len(losses[i : i + WINDOW]) for i in range(0, len(losses), WINDOW)]


def gap(a, b):
    wa, wb = windows(a["losses"]), windows(b["losses"])
    return max(abs(x - y) for x, y in zip(wa, wb))


def pooled_summary(runs):
    """Runs repeated under <name>-rK (interleaved in one call): per variant, every run's
    median step and the median of all their timed steps pooled; ratios from the pooled."""
    groups: dict = {}
    for tag, r in runs.items():
        base = re.sub(r"-r[0-9]+$", "", tag)
        if r["world"] == 2 and r["steps"] > 20:
            groups.setdefault(base, []).append(r)
    if not any(len(g) > 1 for g in groups.values()):
        return
    pooled = {}
    print("\nRepeated runs (interleaved): ms per step")
    print("| variant | runs | each run's median | pooled median | vs 2gpu | vs 2gpu-compile |")
    print("|---|---|---|---|---|---|")
    for base, group in groups.items():
        steps = [t for r in group for t in r["step_ms"][r.get("time_from", 10) :]]
        pooled[base] = statistics.median(steps)
    for base, group in groups.items():
        cells = []
        for other in ("2gpu", "2gpu-compile"):
            cells.append(f"{pooled[other] / pooled[base]:.3f}" if other in pooled else "-")
        each = ", ".join(f"{r['median_step_ms']:.1f}" for r in group)
        print(f"| {base} | {len(group)} | {each} | {pooled[base]:.1f} | {cells[0]} | {cells[1]} |")
    print(
        "(vs: the other's pooled ms per step / this one's: a throughput ratio; bars: >= 1.10 vs 2gpu, "
        ">= 1.00 vs 2gpu-compile for codetta)"
    )


def main(folder):
    folder = Path(folder)
    runs = {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}
    if not runs:
        print(f"no runs in {folder}")
        return 1
    any_run = next(iter(runs.values()))
    print(
        f"# FSDP2 runs: {any_run['model']} ({any_run['layers']} layers, vocab {any_run['vocab']}), "
        f"sequences of {any_run['seq_len']} tokens"
    )
    print(f"\n{any_run['device']}, torch {any_run['torch']}, commit {any_run['commit']}\n")
    print(
        "| run | GPUs | sequences/step | steps | codetta | compile | loss, last 10 steps | ms/step "
        "| host ms to issue a step | tokens/s/GPU | peak GB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for tag, r in runs.items():
        last = sum(r["losses"][-10:]) / len(r["losses"][-10:])
        print(
            f"| {tag} | {r['world']} | {r['batch']} | {r['steps']} | {r['codetta']} | {r['compile']} "
            f"| {last:.4f} | "
            f"{r['median_step_ms']:.1f} | {r.get('median_host_ms', float('nan')):.1f} | "
            f"{r['tokens_per_s_per_gpu']:.0f} | {r['peak_memory_gb'] or 0:.1f} |"
        )
    noise = gap(runs["2gpu-moved"], runs["2gpu"]) if {"2gpu-moved", "2gpu"} <= runs.keys() else None
    pairs = [("2gpu", "1gpu"), ("2gpu-codetta", "1gpu-codetta"), ("1gpu-codetta", "1gpu"),
             ("2gpu-codetta", "2gpu"), ("2gpu-compile", "2gpu")]  # fmt: skip
    pairs = [(a, b) for a, b in pairs if a in runs and b in runs and runs[a]["steps"] == runs[b]["steps"]]
    if pairs or noise is not None:
        print(f"\nLoss curves: largest gap between {WINDOW}-step means")
    if noise is not None:
        print(f"- noise (unpatched, weights moved by ~one bf16 rounding): {noise:.4f}")
    for a, b in pairs:
        g = gap(runs[a], runs[b])
        verdict = (
            ""
            if noise is None
            else (" (within the noise)" if g <= noise else f" ({g / noise:.2f} x the noise)")
        )
        print(f"- {a} vs {b}: {g:.4f}{verdict}")
    print("\nThroughput (tokens/s per GPU, median step after the first 10)")
    for tag in [t for t in runs if t.startswith("2gpu-codetta")]:
        ours = runs[tag]["tokens_per_s_per_gpu"]
        for other, bar in [("2gpu", 1.10), ("2gpu-compile", 1.0)]:
            if other in runs:
                ratio = ours / runs[other]["tokens_per_s_per_gpu"]
                verdict = "met" if ratio >= bar else "MISSED"
                print(f"- {tag} / {other}: {ratio:.3f} (bar >= {bar:.2f}: {verdict})")
    pooled_summary(runs)
    for a, b in [("1gpu-codetta", "1gpu"), ("1gpu-half-codetta", "1gpu-half")]:
        if a in runs and b in runs:
            ratio = runs[a]["tokens_per_s_per_gpu"] / runs[b]["tokens_per_s_per_gpu"]
            print(f"- {a} / {b}: {ratio:.3f} (one GPU, no communication)")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return 0
    ref = next((t for t in ("1gpu", "2gpu") if t in runs), None)
    fig, axes = plt.subplots(1, 2 if ref else 1, figsize=(12 if ref else 7, 4), squeeze=False)
    ax = axes[0][0]
    for tag, r in runs.items():
        ax.plot(range(len(r["losses"])), r["losses"], label=tag, lw=1)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"{any_run['model']} under FSDP2, {any_run['device']}")
    ax.legend()
    if ref:  # the curves overlap: their differences from one reference run, window means
        ax = axes[0][1]
        base = windows(runs[ref]["losses"])
        for tag, r in runs.items():
            if tag != ref and r["steps"] == runs[ref]["steps"]:
                diff = [a - b for a, b in zip(windows(r["losses"]), base)]
                ax.plot([WINDOW * (i + 0.5) for i in range(len(diff))], diff, marker="o", ms=3, label=tag)
        ax.axhline(0, color="gray", lw=0.5)
        ax.set_xlabel("step")
        ax.set_ylabel(f"loss - {ref}'s ({WINDOW}-step means)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(folder / "loss_curves.png", dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "."))
