"""The drop-in on odd batch shapes, vocabularies and masks: patched against unpatched tiny
Llama / Qwen3 / Mistral models (sliding window 4), one training step each, fp32 through
the interpreter; right padding, packed sequences (position_ids), ignored labels.

Usage (repo root, CPU): TRITON_INTERPRET=1 PYTHONPATH=. python scripts/fuzz/fuzz_hf.py START COUNT
(a line a seed: the two losses, the largest relative gradient difference; a gradient past
1e-3 is judged against float64, within twice the unpatched model's error, for gradients
that are zero in exact arithmetic and rounding noise on both sides, plus one float32 ulp
of their module's gradients, ``zero_scale``; "<-- CHECK" past that or on a missing
gradient; a 1-token batch has no loss token: nan for both).

On a GPU (FUZZ_DEVICE=cuda FUZZ_DTYPE=bfloat16): wider models and longer batches in that
dtype, and each patched result (each token's loss, every parameter's gradient) is held to
twice the unpatched model's error in the same dtype against the unpatched model in
float64; the line names the worst ratio and "<-- CHECK" when a result exceeds the bound or
is missing. FUZZ_AUTOCAST=1 (CPU or GPU): the models keep float32 parameters and both run
under torch.autocast to FUZZ_DTYPE (Hugging Face Trainer's bf16=True; the drop-in's cast
mode), held to the same bound against autocast's own error. On such tiny
models a gradient's largest element can pass 2x by chance: seeds 0-39 on the CPU in fp16,
6 of 34 cases with a loss token had one (at most 2.45x), none in relative norm (at most
1.77x); a model held in fp16 in plain PyTorch, 25 and 4 (NOTES.md).

FUZZ_FAMILIES=llama,qwen2,qwen3,mistral,phi3 draws the family from that list (default
llama,qwen3,mistral, the list earlier seeds were drawn from; qwen2: q, k and v biases of
the projections' outputs' size; phi3: the fused qkv_proj and gate_up_proj)."""

import contextlib
import copy
import os
import random
import sys

import torch
import torch.nn.functional as F
import transformers
from fuzz_common import DEVICE, DTYPE, ON_GPU, compare

import codetta


def model(family, tied, V, seed=0, width=(64, 96, 16)):
    torch.manual_seed(seed)
    d, f, hd = width
    common = dict(vocab_size=V, hidden_size=d, intermediate_size=f, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=hd, max_position_embeddings=4096,
                  tie_word_embeddings=tied, attn_implementation="sdpa", rms_norm_eps=1e-5)  # fmt: skip
    if family == "mistral":
        cfg, cls = transformers.MistralConfig(sliding_window=4, **common), transformers.MistralForCausalLM
    elif family == "llama":
        cfg, cls = transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    elif family == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif family == "phi3":  # (its default pad id is past these vocabularies)
        cfg = transformers.Phi3Config(pad_token_id=None, bos_token_id=None, eos_token_id=None, **common)
        cls = transformers.Phi3ForCausalLM
    else:  # qwen3
        cfg, cls = transformers.Qwen3Config(**common), transformers.Qwen3ForCausalLM
    m = cls(cfg)
    with torch.no_grad():  # (the default init's norms are all ones: give them real scales)
        for n, p in m.named_parameters():
            if "norm" in n:
                p.copy_(torch.rand_like(p) + 0.5)
            elif n.endswith(".bias"):  # (Qwen2's, zeros by default: tests/test_hf.py's scale)
                p.copy_(0.2 * torch.randn_like(p))
    return m


AUTOCAST = os.environ.get("FUZZ_AUTOCAST") == "1"
FAMILIES = os.environ.get("FUZZ_FAMILIES", "llama,qwen3,mistral").split(",")
if set(FAMILIES) - {"llama", "qwen2", "qwen3", "mistral", "phi3"}:
    sys.exit(f"FUZZ_FAMILIES: llama, qwen2, qwen3, mistral or phi3, got {FAMILIES}")


def amp(m):
    """Autocast to DTYPE around a float32 model's calls under FUZZ_AUTOCAST=1, else nothing."""
    on = AUTOCAST and next(m.parameters()).dtype == torch.float32
    return torch.autocast(DEVICE, dtype=DTYPE) if on else contextlib.nullcontext()


def step(m, kw):
    m.train()
    m.zero_grad(set_to_none=True)
    with amp(m):
        out = m(**kw)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def inputs(rng, seed, V, B, S, kind):
    ids = torch.randint(0, V, (B, S), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    kw = {"input_ids": ids, "labels": labels, "use_cache": False}
    if kind == "padding":
        mask = torch.ones_like(ids)
        for b in range(B):
            cut = rng.randint(1, S)
            mask[b, cut:] = 0
            labels[b, cut:] = -100
        kw["attention_mask"] = mask
    elif kind == "packed" and S > 1:
        cut = rng.randint(1, S - 1)
        kw["position_ids"] = torch.tensor([list(range(cut)) + list(range(S - cut))] * B)
    elif kind == "ignore":
        labels[:, : S // 2] = -100
    return kw


def on_device(base, kw) -> tuple:
    """The three models of a check against float64 (the unpatched one in float64, the
    unpatched and the patched ones in DTYPE, or in float32 under autocast to DTYPE with
    FUZZ_AUTOCAST=1) and the batch, on DEVICE."""
    kw = {k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in kw.items()}
    base = base.to(DEVICE)
    low = torch.float32 if AUTOCAST else DTYPE
    plain = copy.deepcopy(base).to(low)
    patched = codetta.apply_codetta(copy.deepcopy(base).to(low), autocast="cast" if AUTOCAST else None)
    return base.double(), plain, patched, kw


def predicted(m, kw) -> tuple:
    """The logits (float64) of the tokens a label predicts, from a forward without labels,
    and those labels."""
    with torch.no_grad(), amp(m):
        logits = m(**{k: v for k, v in kw.items() if k != "labels"}).logits[:, :-1].double()
    labels = kw["labels"][:, 1:]
    keep = labels != -100
    return logits[keep], labels[keep]


def token_losses(m, kw) -> torch.Tensor:
    """Each predicted token's loss (float64) from the model's logits."""
    return F.cross_entropy(*predicted(m, kw), reduction="none")


def against_float64(seed, base, kw) -> tuple:
    """The patched model in DTYPE against 2x the unpatched one's error (same dtype), both
    measured against the unpatched model in float64: (worst ratio, bad results). The loss
    is judged token by token (from each model's logits): the batch's loss is a mean of
    per-token errors of either sign (std ~1e-2 at bf16, run 180), so the ratio of two such
    means is noise (run 180: 0.02 and 0.42 of the expected spread gave a "ratio" of 26);
    it is printed, not bounded. The gradients are bounded as they come."""
    ref, plain, patched, kw = on_device(base, kw)
    (l64, g64), (l0, g0), (l1, g1) = (step(m, kw) for m in (ref, plain, patched))
    if torch.isnan(l64):  # (no token to predict: nan losses and gradients on every side)
        return f"loss {l0.item()} {l1.item()}", ("no loss token", 0.0), []
    t64, t0, t1 = (token_losses(m, kw) for m in (ref, plain, patched))
    names = ["token losses", *g64]
    ours, same = [t1, *(g1.get(n) for n in g64)], [t0, *(g0[n] for n in g64)]
    bad = compare(names, ours, [t64, *g64.values()], same)
    worst = max(
        ((n, (b.double() - r).abs().max().item() / max((a.double() - r).abs().max().item(), 1e-30))
         for n, a, b, r in zip(names, same, [b if b is not None else a for a, b in zip(same, ours)],
                               [t64, *g64.values()])),
        key=lambda kv: kv[1],
    )  # fmt: skip
    return f"loss {l0.item():.5f} {l1.item():.5f} (float64 {l64.item():.5f})", worst, bad


def zero_scale(name: str, g64: dict):
    """For a gradient that is zero in exact arithmetic (its float64 value below float32's
    resolution of its module's gradients, e.g. the q and k projections' where each query
    sees one key), the largest float64 gradient of its module (``...self_attn``): the scale
    of the terms that cancel, whose float32 ulp bounds the noise either side can leave (on
    seed 3514 the noise is 1-3e-9 on both sides against an ulp of 5e-8: the 2x ratio of the
    two noises' maxima moved with the CPU's vector instruction set, NOTES.md); else None
    (the gradient's own scale)."""
    module = name.rsplit(".", 2)[0] + "."
    scale = max(g.abs().max().item() for n, g in g64.items() if n.startswith(module))
    return scale if g64[name].abs().max().item() < 2.0**-24 * scale else None


def case(seed: int) -> tuple:
    """A seed's model (float32, on the CPU) and batch: (description, model, inputs)."""
    rng = random.Random(seed)
    fam, tied = rng.choice(FAMILIES), rng.random() < 0.5
    V = rng.choice([128, 130, 257, 96])
    B, S = rng.choice([(1, 1), (1, 2), (1, 3), (3, 5), (2, 9), (4, 7), (1, 17), (2, 16)])
    kind = rng.choice(["padding", "packed", "ignore", "none"])
    width = (64, 96, 16)
    if ON_GPU:  # (wider layers, longer rows and real vocabularies, from their own draws)
        g = random.Random(seed + 1_000_003)
        width = g.choice([width, (256, 704, 64), (1024, 2816, 128)])
        V, S = g.choice([V, 32001, 50257, 128256]), S * g.choice([1, 16, 64])
    base = model(fam, tied, V, seed, width)
    kw = inputs(rng, seed, V, B, S, kind)
    desc = dict(fam=fam, tied=tied, V=V, B=B, S=S, kind=kind) | (dict(width=width) if ON_GPU else {})
    return desc, base, kw


def main(start: int, count: int) -> None:
    what = f"autocast to {DTYPE} over float32" if AUTOCAST else DTYPE if ON_GPU else torch.float32
    print("device", DEVICE, "dtype", what, flush=True)
    for seed in range(start, start + count):
        desc, base, kw = case(seed)
        if ON_GPU or AUTOCAST:
            try:
                losses, worst, bad = against_float64(seed, base, kw)
            except Exception as e:
                print("seed", seed, desc, "EXC", type(e).__name__, str(e)[:300], flush=True)
                continue
            print("seed", seed, desc, losses, worst, "" if not bad else f"{bad} <-- CHECK", flush=True)
            continue
        patched = codetta.apply_codetta(copy.deepcopy(base))
        try:
            l0, g0 = step(base, kw)
            l1, g1 = step(patched, kw)
        except Exception as e:
            print("seed", seed, desc, "EXC", type(e).__name__, str(e)[:300], flush=True)
            continue
        rel = {n: ((g1[n] - g0[n]).abs().max() / (g0[n].abs().max() + 1e-12)).item() for n in g0 if n in g1}
        worst = max(rel.items(), key=lambda kv: kv[1]) if rel else ("-", 0.0)
        same_loss = bool(torch.isnan(l0) and torch.isnan(l1)) or abs(l0 - l1) <= 1e-4 * max(1, abs(l0))
        ok = same_loss and worst[1] < 1e-3 and set(g0) == set(g1)
        note = ""
        if same_loss and set(g0) == set(g1) and not ok:
            # a gradient that is zero in exact arithmetic (a query that sees one key: its q and
            # k gradients) is float32 rounding noise on both sides, ~1e-9, and their relative
            # difference means nothing: those past 1e-3 are judged against float64 instead
            _, g64 = step(copy.deepcopy(base).double(), kw)
            far = [n for n in g0 if rel[n] >= 1e-3]
            bad = compare(far, [g1[n] for n in far], [g64[n] for n in far], [g0[n] for n in far],
                          [zero_scale(n, g64) for n in far])  # fmt: skip
            ok = not bad
            note = f"float64: {'within' if ok else 'past'} 2x PyTorch's error (+ a module ulp) for {len(far)}"
        print("seed", seed, desc, f"loss {l0.item():.5f} {l1.item():.5f}", worst, note,
              "" if ok else "<-- CHECK", flush=True)  # fmt: skip


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
