"""The drop-in on odd batch shapes and vocabularies: patched vs unpatched tiny Llama/Qwen3
models, one training step each, fp32 through the interpreter.

Usage (repo root, CPU): TRITON_INTERPRET=1 PYTHONPATH=. python scripts/fuzz/fuzz_hf.py START COUNT
(a line a seed: the losses, the largest relative gradient difference, "<-- CHECK" past 1e-3)."""

import copy
import random
import sys

import torch
import transformers

import codetta


def model(family, tied, V, seed=0):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=V,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        tie_word_embeddings=tied,
        attn_implementation="sdpa",
        rms_norm_eps=1e-5,
    )
    cfg, cls = (
        (transformers.LlamaConfig(**common), transformers.LlamaForCausalLM)
        if family == "llama"
        else (transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM)
    )
    m = cls(cfg)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(torch.rand_like(p) + 0.5)
    return m


def step(m, kw):
    m.train()
    m.zero_grad(set_to_none=True)
    out = m(**kw)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


for seed in range(int(sys.argv[1]), int(sys.argv[1]) + int(sys.argv[2])):
    rng = random.Random(seed)
    fam, tied = rng.choice(["llama", "qwen3"]), rng.random() < 0.5
    V = rng.choice([128, 130, 257, 96])
    B, S = rng.choice([(1, 1), (1, 2), (3, 5), (1, 17), (2, 9), (5, 3)])
    base = model(fam, tied, V, seed)
    patched = copy.deepcopy(base)
    codetta.apply_codetta(patched)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, S), generator=g)
    kw = {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
    desc = dict(fam=fam, tied=tied, V=V, B=B, S=S)
    try:
        l0, g0 = step(base, kw)
        l1, g1 = step(patched, kw)
    except Exception as e:
        print("seed", seed, desc, "EXC", type(e).__name__, str(e)[:300], flush=True)
        continue
    worst = max(
        ((n, ((g1[n] - g0[n]).abs().max() / (g0[n].abs().max() + 1e-12)).item()) for n in g0),
        key=lambda t: t[1],
    )
    same_loss = (torch.isnan(l0) and torch.isnan(l1)) or abs(l0 - l1) <= 1e-4 * max(1, abs(l0))
    missing = set(g0) ^ set(g1)
    print(
        "seed",
        seed,
        desc,
        "loss",
        f"{l0.item():.5f} {l1.item():.5f}",
        "worst grad rel",
        worst,
        "missing",
        missing,
        "" if same_loss and worst[1] < 1e-3 and not missing else "<-- CHECK",
        flush=True,
    )
