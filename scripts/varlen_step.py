"""A model's training step when every step has a token count not seen before (a data
loader that pads each batch to its longest sequence, no packing; by default the rows carry
no padding, see VARLEN_PAD), against steps of one count: the time per step (synchronized)
of Hugging Face eager, the codetta drop-in and Liger (where installed; each variant's step
is ``bench.model.variant_step``'s); then, per variant, the host's time to issue a step and
the GPU's kernel time per step (torch.profiler, its longest kernels listed) at one count
and at new counts; then a cProfile of codetta's new-count steps (GPU machine).

Usage (repo root): python scripts/varlen_step.py [case] [layers] [batch] [variants...]
(defaults: llama-3.2-1B, 16 layers, batch 4 of up to 2048 tokens, eager codetta liger).
VARLEN_SDPA=flash|efficient|math|cudnn: SDPA on that backend alone (run 297: PyTorch's
default SDPA spent ~100 ms of host time per step on a new count, every variant alike; run
298: that default was cuDNN's, which plans each new shape; flash does not).
VARLEN_PAD=1: right-padded rows (a padding mask, labels -100 there), as a loader that pads
each batch to its longest sequence hands them: row i holds 2048 - 64 (i + 1) tokens and
every step's count is above them all, so each row ends in padding and SDPA gets a mask
(which its flash backend cannot take: run it with VARLEN_SDPA=efficient or cudnn).
"""

import contextlib
import os
import statistics
import sys
import time

import torch

from codetta.bench import model as mb
from codetta.bench.harness import host_ms, profile_calls


def gpu_kernel_ms(fn, calls: int) -> float:
    """The GPU's kernel time per call of ``fn`` (torch.profiler's CUDA activity), and its
    ten longest kernels printed (which SDPA backend ran)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) / 1e3 / calls
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:10]:
        print(f"     {e.self_device_time_total / 1e3 / calls:8.2f} ms  {e.count // calls:4d}x  {e.key[:90]}")
    return total


def ms_per_step(run, counts: list) -> tuple[float, float]:
    """Synchronized ms per step of ``run`` over the sequence lengths ``counts``: the median
    step and the mean (they part where one step was slow: run 302's one-count step on the
    memory-efficient backend, 238.1 ms against 204.3 of kernels, was a mean)."""
    torch.cuda.synchronize()
    times = []
    for n in counts:
        t0 = time.perf_counter()
        run(n)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), statistics.fmean(times)


def main() -> None:
    case = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1B"
    layers = int(sys.argv[2]) if len(sys.argv) > 2 else 16
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    config = mb.model_config(case, num_hidden_layers=layers)
    base = mb.make_model(config)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, 2048), device="cuda", generator=g)
    labels, mask = ids, None
    if os.environ.get("VARLEN_PAD") == "1":
        keep = (
            torch.arange(2048, device="cuda")[None, :]
            < 2048 - 64 * torch.arange(1, batch + 1, device="cuda")[:, None]
        )
        labels, mask = ids.masked_fill(~keep, -100), keep.long()
    lengths = iter(range(2045, 1024, -1))  # (no variant's step takes a count taken before)
    variants = sys.argv[4:] or ["eager", "codetta", "liger"]
    backend = os.environ.get("VARLEN_SDPA")
    with _sdpa(backend):
        for name in variants:
            what = f"{case}, {layers} layers, SDPA {backend or 'default'}"
            what += ", padded rows" if mask is not None else ""
            _variant(name, base, ids, labels, mask, lengths, what, batch)


def _sdpa(backend):
    if not backend:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                        "math": SDPBackend.MATH, "cudnn": SDPBackend.CUDNN_ATTENTION}[backend])  # fmt: skip


def _variant(name, base, ids, labels, mask, lengths, what, batch):
    """Variant ``name``'s ms per step at one count and at a new count each step."""
    run = mb.variant_step(name, base, ids, labels, attention_mask=mask)
    if run is None:
        print(f"  {name} unavailable")
        return
    for n in (2048, 2047, 2046, 2048):  # (both Triton specializations of M compiled)
        run(n)
    same = ms_per_step(run, [2048] * 8)
    new = ms_per_step(run, [next(lengths) for _ in range(8)])
    print(f"== {what}, {name}: {same[0]:.1f} ms per step at {batch}x2048 tokens, {new[0]:.1f} ms "
          f"at a new count each step (medians of 8; means {same[1]:.1f} / {new[1]:.1f})")  # fmt: skip
    # host or GPU? the host's time to issue a step (GPU idle at its start) and the GPU's
    # kernel time per step, each at one count and at new counts
    for label, counts in (("one count", lambda: 2048), ("new counts", lambda: next(lengths))):
        issue = host_ms(lambda c=counts: run(c()), 3)
        kernels = gpu_kernel_ms(lambda c=counts: run(c()), 2)
        print(f"   {name}, {label}: host {issue:.1f} ms to issue a step; GPU kernels {kernels:.1f} ms a step")
    if name == "codetta":
        profile_calls(lambda: run(next(lengths)), 3, f"{name}: cProfile of 3 steps, a new count each")
    run = None  # (its model and optimizer freed before the next variant's)
    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
