"""The host's time per training step, and where it goes (GPU machine).

Under FSDP2 on two GPUs (NOTES.md, issue 16) each GPU gets half the tokens, so half
the GPU work per step, while the host's work per step stays: codetta's step there
ran with its GPU idle part of the time. This measures, for a Llama model step of the
model benchmark (``codetta.bench.model``) at a given number of tokens: the host's
time to issue a step (the queue is drained first, and the GPU's time per step is
measured apart), and a cProfile of the codetta variant's steps (the host's hot spots).

Usage: python scripts/host_step.py [case] [batch] [variants...]
(defaults: llama-3.2-1B, batch 4 of 2048 tokens = one FSDP2 rank's 8192, eager codetta)
"""

import sys

import torch

from codetta.bench import model as mb
from codetta.bench.harness import profile_calls

SEQ = 2048


def host_and_gpu_ms(step, n: int = 8) -> tuple[float, float]:
    """(host ms to issue a step with the GPU already idle, GPU ms per step back to back)."""
    host = mb.host_ms(step, n)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        step()
    end.record()
    torch.cuda.synchronize()
    return host, start.elapsed_time(end) / n


def main() -> None:
    case = sys.argv[1] if len(sys.argv) > 1 else "llama-3.2-1B"
    batch = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    variants = sys.argv[3:] or ["eager", "codetta"]
    config = mb.model_config(case, max_position_embeddings=SEQ)
    base = mb.make_model(config)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, SEQ), device="cuda", generator=g)
    for name in variants:
        step = mb.variant_step(name, base, ids, ids.clone())
        for _ in range(3):
            step()
        host, gpu = host_and_gpu_ms(step)
        print(f"== {case} {name}, {batch * SEQ} tokens: host {host:.1f} ms to issue a step, "
              f"GPU {gpu:.1f} ms per step back to back")  # fmt: skip
        if not name.startswith("codetta"):
            continue
        profile_calls(step, 3, f"{name}: cProfile of 3 steps", sync_each=True)


if __name__ == "__main__":
    main()
