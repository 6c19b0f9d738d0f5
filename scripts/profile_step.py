"""Where a training step's GPU time goes: torch.profiler over a few steps of the model
benchmark's variants (GPU machine). Usage: python scripts/profile_step.py [case] [variants...]"""

import sys

import torch

from codetta.bench import model as mb

case = sys.argv[1] if len(sys.argv) > 1 else "1B-layers"
variants = sys.argv[2:] or ["eager", "codetta"]
config = mb.llama_config(case)
base = mb.make_model(config)
g = torch.Generator(device="cuda").manual_seed(1)
ids = torch.randint(0, config.vocab_size, (mb.BATCH, mb.SEQ), device="cuda", generator=g)
for name in variants:
    step = mb.variant_step(name, base, ids, ids.clone())
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.device_time_total for e in events) / 3 / 1e3
    print(f"== {case} {name}: {total:.2f} ms of kernels per step")
    rows = sorted(events, key=lambda e: -e.device_time_total)[:28]
    for e in rows:
        print(f"  {e.device_time_total / 3 / 1e3:8.3f} ms  x{e.count // 3:<4d} {e.key[:110]}")
