"""The model part of the benchmark: whole training steps of Hugging Face Llama models.

A step is forward (``labels=``, Hugging Face's loss), backward and an AdamW step
(``bench --step fwd-bwd``: forward and backward only, no optimizer, the measure of issue
12's decoder-layer bar), on 16384 tokens (4 x 4096; ``bench --batch N``: N x 4096, the rows
then named '<case> @<tokens>') in bf16, timed step after step
(sustained blocks; paired too). Variants: eager, Liger (its full patch, fused linear
cross-entropy included), torch.compile (of the whole model, as a user writes it),
torch.compile:regional (each decoder layer and the loss compiled apart, the masks made
eagerly), codetta (the drop-in) and codetta + torch.compile, each on its own copy of the
same initial weights.
Why two compile variants: with torch < 2.14, Hugging Face never skips the causal mask
while dynamo traces (transformers' masking_utils: dynamo then reports it is exporting),
so a compiled whole model hands SDPA a materialized [B, 1, S, S] mask and cuDNN's masked
kernels run instead of its causal ones; regional compilation leaves the mask to eager
code, which passes ``is_causal`` (NOTES.md, run 122). The floor is the cuBLAS time of the step's GEMMs
(forward, dX and dW of every projection and the LM head) plus the attention
kernel's (SDPA) forward and backward, measured in the same run. Reported: time /
floor, tokens/s, peak memory, and the first step's loss of every variant (they
must agree).
"""

from __future__ import annotations

import contextlib
import copy
import gc
import math
import sys

import torch
import torch.nn.functional as F

from ..kernels.tuning import CHOOSER
from .harness import (
    OPTIONS,
    Results,
    Row,
    ab_settings,
    ab_variants,
    compare,
    host_ms,
    peak_memory_gb,
    print_config_sources,
    round_extra,
    round_spread,
)

BATCH, SEQ = 4, 4096
# name: (LlamaConfig overrides, layers)
_1B = dict(
    hidden_size=2048, intermediate_size=8192, num_attention_heads=32, num_key_value_heads=8, head_dim=64
)
_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8, head_dim=128
)
CASES = {
    "1B-layers": dict(_1B, num_hidden_layers=2, vocab_size=128, tie_word_embeddings=False),
    "8B-layers": dict(_8B, num_hidden_layers=2, vocab_size=128, tie_word_embeddings=False),
    "llama-3.2-1B": dict(_1B, num_hidden_layers=16, vocab_size=128256, tie_word_embeddings=True),
    "8B-4layers+head": dict(_8B, num_hidden_layers=4, vocab_size=128256, tie_word_embeddings=False),
    # Qwen3-8B's widths (per-head q/k RMSNorm, rope_theta 1e6): two layers, as the Llama
    # layer cases (a Qwen3Config: ``model_config``)
    "qwen3-8B-layers": dict(
        _8B,
        intermediate_size=12288,
        num_hidden_layers=2,
        vocab_size=128,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        model_type="qwen3",
    ),
    # Qwen2.5-7B's widths (q, k and v biases, 28 / 4 heads): two layers (a Qwen2Config)
    "qwen2.5-7B-layers": dict(
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_key_value_heads=4,
        head_dim=128,
        num_hidden_layers=2,
        vocab_size=128,
        tie_word_embeddings=False,
        rope_theta=1000000.0,
        model_type="qwen2",
    ),
}
VARIANTS = ("eager", "liger", "torch.compile", "torch.compile:regional", "codetta", "codetta+compile")
# codetta under other settings, for A/B runs next to the peers: "codetta:<how>" runs the
# drop-in with these settings in force during its steps only
SETTING_VARIANTS = {
    "no-pingpong": {"pingpong": False},
    "epilogue-bound": {"pingpong_policy": "epilogue-bound"},
    "qkv-one-launch": {"qkv_one_launch": True},
    "recompute-y": {"swiglu_keep_y": False},
    "keep-y": {"swiglu_keep_y": True},
    "no-overwrite": {"overwrite_saved": False},
    "no-tied-grad": {"tied_grad": False},
    "no-embed-grad": {"embed_grad": False},
    "no-ce-finish": {"ce_finish": False},
    # the final norm's output n formed for the loss (instead of h and rstd handed on)
    "no-norm-factors": {"ce_norm_factors": False},
    # the loss's dX kept in float32 to the backward's scale (one rounding; NOTES.md)
    "ce-dx-f32": {"ce_dx_f32": True},
    # the loss's logits chunks at 2 GiB (half as many passes over the float32 dW, 1 GiB more)
    "ce-chunk-2g": {"ce_chunk_mb": 2048},
    # 4 GiB: at 16384 tokens and V 128256 every row in one chunk, no float32 dW sum at all, the
    # head's dW one GEMM over all rows as the compile's (at d 4096 the same peak as 2 GiB chunks)
    "ce-chunk-4g": {"ce_chunk_mb": 4096},
    # both memory-for-speed trades at once (y kept, 2 GiB chunks): on an H100 at 8B width the
    # head's float32 dW passes and y's second forming cost ~2 and ~1 ms a step (runs 270-271)
    "more-memory": {"swiglu_keep_y": True, "ce_chunk_mb": 2048},
    # the loss without its gradient pass (CODETTA_CE_PROBS: experimental, NOTES.md)
    "ce-probs": {"ce_probs": True},
    # every launch through Triton's own path (the host time the direct launches save)
    "no-direct": {"direct_launch": False},
}
ALL_VARIANTS = VARIANTS + ("codetta+compile:regional",) + tuple(f"codetta:{how}" for how in SETTING_VARIANTS)


def model_config(case: str, **over):
    """The case's Hugging Face config: a LlamaConfig, or a Qwen3Config / Qwen2Config for a
    case that says ``model_type="qwen3"`` / ``"qwen2"``."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    kw = dict(max_position_embeddings=SEQ, rms_norm_eps=1e-5, attn_implementation="sdpa", rope_theta=500000.0)
    kw.update(CASES[case])
    kw.update(over)
    kind = kw.pop("model_type", "llama")
    return {"qwen3": Qwen3Config, "qwen2": Qwen2Config}.get(kind, LlamaConfig)(**kw)


def make_model(config, device="cuda", dtype=torch.bfloat16, seed=0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)


class ModuleSwap:
    """Records what a monkey patch changes in a module's namespace (``with`` block) and
    undoes it on exit; ``patched()`` puts the patch back for the duration of a block."""

    def __init__(self, module):
        self.module, self.changes = module, {}

    def __enter__(self):
        self.before = dict(vars(self.module))
        return self

    def __exit__(self, *exc):
        after = vars(self.module)
        self.changes = {k: v for k, v in after.items() if self.before.get(k, _MISSING) is not v}
        for k in self.changes:
            if k in self.before:
                setattr(self.module, k, self.before[k])
            else:
                delattr(self.module, k)
        return False

    @contextlib.contextmanager
    def patched(self):
        saved = {k: vars(self.module).get(k, _MISSING) for k in self.changes}
        for k, v in self.changes.items():
            setattr(self.module, k, v)
        try:
            yield
        finally:
            for k, v in saved.items():
                if v is _MISSING:
                    delattr(self.module, k)
                else:
                    setattr(self.module, k, v)


_MISSING = object()


def variant_step(
    name: str, base_model, ids, labels, changes: dict | None = None, optimizer: bool = True,
    amp: bool = False, attention_mask=None,
):  # fmt: skip
    """One training step of variant ``name`` on its own copy of ``base_model`` and an
    optimizer of its own; None where the variant is unavailable (Liger not installed).
    ``changes``: codetta settings its steps run under (default: the variant's own,
    ``SETTING_VARIANTS``; the A/B variants of ``--tuned-ab`` pass theirs). ``optimizer=False``
    (``bench --step fwd-bwd``): forward and backward only, the gradients dropped after each
    step and the weights never changed (issue 12's decoder-layer bar is of forward +
    backward; the floor has no optimizer either). ``amp``: the forward under autocast to
    bfloat16 (``base_model`` in float32), codetta under ``CODETTA_AUTOCAST=cast``. The step
    takes an optional sequence length: the first ``tokens`` of each row of ``ids`` and
    ``labels`` (and of ``attention_mask``, a padding mask the model is given where not
    None; scripts/varlen_step.py: a new token count each step)."""
    import codetta
    from codetta.kernels import settings

    name, _, how = name.partition(":")
    known = how in SETTING_VARIANTS if name == "codetta" else how == "regional" and name.endswith("compile")
    if how and not known:
        raise ValueError(f"unknown variant {name}:{how}; known: {', '.join(ALL_VARIANTS)}")
    changes = SETTING_VARIANTS.get(how, {}) if changes is None else changes
    if amp and name.startswith("codetta"):
        changes = {**changes, "autocast": "cast"}
    model = copy.deepcopy(base_model).train()
    run = model
    swap = None
    if name == "liger":
        try:
            from liger_kernel.transformers import _apply_liger_kernel_to_instance

            # Liger also replaces module-level names of the modeling module (its rotary
            # function, the RMSNorm and MLP classes): they are swapped in for its steps
            # only, so the other variants (and models built later) run Hugging Face's own
            with ModuleSwap(sys.modules[type(model).__module__]) as swap:
                _apply_liger_kernel_to_instance(model=model)
        except Exception as exc:  # noqa: BLE001 - not installed, or not compatible with this transformers
            print(f"  liger unavailable: {type(exc).__name__}: {exc}", file=sys.stderr)
            return None
    elif name in ("codetta", "codetta+compile"):
        codetta.apply_codetta(model)
    if name.endswith("compile"):
        if how == "regional":
            compile_regions(model)
        else:
            run = torch.compile(model)
    fused = ids.device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=fused) if optimizer else None
    losses = []

    def step(tokens: int | None = None):
        with (settings.override(**changes) if changes else contextlib.nullcontext(),
              swap.patched() if swap is not None else contextlib.nullcontext()):  # fmt: skip
            return _step(tokens)

    def forward_backward(tokens: int | None = None):
        cut = slice(None, tokens)
        mask = {} if attention_mask is None else {"attention_mask": attention_mask[:, cut]}
        with torch.autocast(ids.device.type, dtype=torch.bfloat16) if amp else contextlib.nullcontext():
            out = run(input_ids=ids[:, cut], labels=labels[:, cut], use_cache=False, **mask)
        out.loss.backward()
        return out

    def _step(tokens):
        out = forward_backward(tokens)
        if opt is not None:
            opt.step()
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        if len(losses) < 1:
            losses.append(out.loss.detach().float().item())
        step.last_loss = out.loss.detach()  # (no host sync per step; read after the timing)

    step.losses, step.trains = losses, opt is not None
    if name == "codetta":  # (the drop-in; not under torch.compile)

        def warm():
            """Every kernel of the step's forward and backward compiled at once before
            its first run (codetta.precompile: device time saved)."""
            with settings.override(**changes) if changes else contextlib.nullcontext():
                codetta.precompile(forward_backward, model)

        step.precompile = warm
    return step


def compile_regions(model) -> None:
    """Regional compilation, in place: every decoder layer (``nn.Module.compile``: one
    compiled code for the identical layers), the final norm and the model's loss
    function; the embedding, the rotary tables, the masks and the LM head's GEMM run
    eagerly (the mask then takes Hugging Face's ``is_causal`` path, module docstring)."""
    inner = model.model
    for layer in inner.layers:
        layer.compile()
    inner.norm.compile()
    model.loss_function = torch.compile(model.loss_function)


def step_gemms(config, tokens: int):
    """(M, N, K) of every forward GEMM of a step (each also runs as dX and dW backward)."""
    d, f = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    per_layer = [(tokens, q, d), (tokens, kv, d), (tokens, kv, d), (tokens, d, q)]  # q, k, v, o
    per_layer += [(tokens, f, d), (tokens, f, d), (tokens, d, f)]  # gate, up, down
    return per_layer * config.num_hidden_layers + [(tokens, config.vocab_size, d)]


def floor_step(config, batch: int, seq: int, device="cuda", dtype=torch.bfloat16):
    """The floor: every GEMM of the step on cuBLAS (forward, dX, dW) and SDPA forward +
    backward per layer, on preallocated tensors."""
    tokens = batch * seq
    mats = []
    for M, N, K in dict.fromkeys(step_gemms(config, tokens)):
        count = step_gemms(config, tokens).count((M, N, K))
        a = torch.randn(M, K, device=device, dtype=dtype)
        w = torch.randn(N, K, device=device, dtype=dtype) * K**-0.5
        g = torch.randn(M, N, device=device, dtype=dtype)
        mats.append((a, w, g, count))
    h, kvh, hd = config.num_attention_heads, config.num_key_value_heads, config.head_dim
    q = torch.randn(batch, h, seq, hd, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(batch, kvh, seq, hd, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(batch, kvh, seq, hd, device=device, dtype=dtype, requires_grad=True)
    do = torch.randn(batch, h, seq, hd, device=device, dtype=dtype)

    def run():
        for a, w, g, count in mats:
            for _ in range(count):
                a @ w.t()
                g @ w
                g.t() @ a
        for _ in range(config.num_hidden_layers):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            torch.autograd.grad(o, (q, k, v), do)

    return run


def step_flops(config, tokens: int, seq: int = SEQ) -> float:
    """GEMMs (forward, dX, dW) plus causal attention (forward 2 B S^2 H hd, backward 2.5x)."""
    gemm = sum(6 * M * N * K for M, N, K in step_gemms(config, tokens))
    attn = config.num_hidden_layers * 7 * tokens * seq * config.num_attention_heads * config.head_dim
    return gemm + attn


STEPS = ("train", "fwd-bwd")  # what a timed step is: a training step, or forward + backward only


def case_label(case: str, step_kind: str = "train", batch: int = BATCH, amp: bool = False) -> str:
    """A row's case name: what was timed (' fwd+bwd' unless a training step), at a batch
    other than the default 4 x 4096 tokens the tokens per step ('@4096'), and ' amp' for
    a step under autocast over float32 parameters."""
    label = case if batch == BATCH else f"{case} @{batch * SEQ}"
    label = label if step_kind == "train" else f"{label} fwd+bwd"
    return f"{label} amp" if amp else label


def run_case(
    res: Results,
    case: str,
    variants=VARIANTS,
    step_kind: str = "train",
    batch: int = BATCH,
    amp: bool = False,
) -> None:
    """``amp``: the model's parameters (and AdamW's state) in float32, each step's forward
    under ``torch.autocast`` to bfloat16 (what Hugging Face Trainer's ``bf16=True`` runs);
    codetta under ``CODETTA_AUTOCAST=cast``. The floor stays bfloat16 GEMMs and SDPA: the
    ratios include what autocast costs (each projection's weight cast every step)."""
    if step_kind not in STEPS:
        raise ValueError(f"unknown step {step_kind!r}; known: {', '.join(STEPS)}")
    if batch < 1:
        raise ValueError(f"batch must be >= 1 sequence of {SEQ} tokens, got {batch}")
    config = model_config(case)
    train = step_kind == "train"
    label = case_label(case, step_kind, batch, amp)  # (the rows say what was timed)
    tokens = batch * SEQ
    base = make_model(config, dtype=torch.float32 if amp else torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, SEQ), device="cuda", generator=g)
    labels = ids.clone()
    fns = {"floor": floor_step(config, batch, SEQ)}
    seen = set(CHOOSER.served)  # (the keys an earlier case picked: said there)
    for name in _progress(variants, f"{case}: building"):
        step = variant_step(name, base, ids, labels, optimizer=train, amp=amp)
        if step is None:
            print(f"  {case}: {name} left out", file=sys.stderr)
            continue
        if hasattr(step, "precompile"):
            try:
                step.precompile()
            except Exception as exc:  # noqa: BLE001 - only time is lost: the first step compiles
                print(f"  {case}: {name}: precompile failed ({type(exc).__name__}: {exc})", file=sys.stderr)
        fns[name] = step
        del step  # (fns holds it, so a variant left out below frees its model)
        # compile (what precompile left), tune, allocate optimizer state
        run_or_leave_out(fns, name, case, fns[name])
    add_ab_steps(
        fns,
        lambda changes, base=base: variant_step(
            "codetta", base, ids, labels, changes=changes, optimizer=train, amp=amp
        ),
    )
    del base
    losses = {k: fn.losses[0] for k, fn in fns.items() if getattr(fn, "losses", None)}
    ref = losses.get("eager")
    for k, loss in losses.items():
        print(f"  {case}: first-step loss {k:<16} {loss:.5f}")
        if ref is not None and abs(loss - ref) > 2e-2 * abs(ref):
            raise AssertionError(f"{case}: {k}'s first-step loss {loss} is not eager's {ref}")
    print_config_sources(seen, case)
    mem = {}
    for k in list(fns):
        peak = run_or_leave_out(fns, k, case, peak_memory_gb, fns[k])
        if k in fns:  # (a variant left out has no row, so no peak either)
            mem[k] = peak
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    times = compare(fns, precompile=False)  # (each codetta step precompiled itself, above)
    check_after_timing(case, fns)
    # every variant's model and optimizer state stay alive through the timing: where the
    # caching allocator runs out of room it frees its cache and retries (a device-wide
    # synchronize), a cost that a process training one model would not pay
    retries = torch.cuda.memory_stats().get("num_alloc_retries", 0) - retries
    reserved = torch.cuda.memory_reserved() / 2**30
    print(f"  {case}: caching allocator retries during timing: {retries} ({reserved:.1f} GiB reserved)")
    host = {k: host_ms(fn) for k, fn in fns.items()}
    flops = step_flops(config, tokens)
    b = times["floor"]
    for name, t in times.items():
        extra = {"tokens_per_s": tokens / (t.sustained / 1e3), "host_ms": host[name], **round_extra(t)}
        res.add(Row(label, name, t.paired, flops, b.paired, mem[name], sustained_ms=t.sustained,
                    baseline_sustained_ms=b.sustained, extra=extra))  # fmt: skip
        print(f"  {label:<34} {name:<18} {tokens / (t.sustained / 1e3) / 1e3:8.1f} k tokens/s (sustained), "
              f"host {host[name]:.1f} ms to issue a step")  # fmt: skip
        if t.rounds:
            print(f"  {label:<34} {name:<18} x floor {round_spread(t, b)} ({len(t.rounds)})")


def run_or_leave_out(fns: dict, name: str, case: str, call, *args):
    """``call(*args)``, or, where it runs out of GPU memory, variant ``name`` taken out of
    ``fns`` with the reason (its model, gradients and AdamW state freed) and None. Every
    variant's model and optimizer state live in one process through the paired timing, so
    on an 80 GB card the 1B step's eager variant (its logits alone 7.8 GB) or the regional
    compile under ``--amp`` does not fit beside three others (runs 262 and 265, an H100);
    the run goes on with the variants that fit instead of ending in a traceback. The
    floor, the table's baseline, is never left out."""
    oom = None
    try:
        return call(*args)
    except torch.OutOfMemoryError as exc:
        if name == "floor":
            raise
        oom = str(exc).split(".")[0]  # (outside the except block: its frames hold tensors)
    del fns[name], call, args
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    print(f"  {case}: {name} left out: {oom} with {len(fns) + 1} variants' models and optimizer "
          f"states in one process; time it in a run with fewer (--variants)", file=sys.stderr)  # fmt: skip
    return None


def add_ab_steps(fns: dict, build) -> dict:
    """Under ``bench --tuned-ab``: codetta's A/B variants (the shipped table, tuned here)
    added to ``fns``, each a step of its own, ``build(settings changes)``: a model and an
    optimizer of its own, as every variant has, so each starts from the same weights and
    takes about as many steps in the timing (run 104's three shared codetta's model and
    trained it three times as far). Each runs once here: a tuned variant tunes every shape
    now, outside the memory measurement. (Each holds a model of its own: ~10 GB more of
    weights, gradients and AdamW state at Llama-3.2-1B.)"""
    for name in ab_variants() if OPTIONS.tuned_ab and "codetta" in fns else ():
        step = build(ab_settings(name.partition(":")[2]))
        step()
        fns[name] = step
    return fns


def check_after_timing(case: str, fns: dict) -> None:
    """Each variant's loss at its last timed step: finite and below its first step's, or
    the run stops: a table of steps that trained on broken weights is not a result (run 98:
    a dry run had left codetta's weights garbage, and its steps timed 17 % faster). Every
    step trains on the same batch, so hundreds of healthy AdamW steps lower the loss a lot
    (run 103: eager's went from 12.16 to 8.44); garbage gradients walk the weights at random
    and do not. Each variant's first and last loss are printed."""
    for name, fn in fns.items():
        first, last = getattr(fn, "losses", None), getattr(fn, "last_loss", None)
        if not first or last is None:
            continue
        value = float(last.float().item())
        print(f"  {case}: loss {name:<24} {first[0]:.5f} at its first step, {value:.5f} after the timing")
        if not getattr(fn, "trains", True):  # forward + backward only: the weights never moved
            if not math.isfinite(value) or abs(value - first[0]) > 1e-3 * abs(first[0]):
                raise AssertionError(f"{case}: {name}'s loss went from {first[0]:.5f} at its first step "
                                     f"to {value} after the timing with its weights unchanged: a step "
                                     "broke them")  # fmt: skip
            continue
        if not math.isfinite(value) or value >= first[0]:
            raise AssertionError(f"{case}: {name}'s loss went from {first[0]:.5f} at its first step "
                                 f"to {value} after the timing: it did not train, its weights are "
                                 "broken")  # fmt: skip


def _progress(items, desc):
    try:
        from tqdm import tqdm

        return tqdm(list(items), desc=desc, file=sys.stderr)
    except ImportError:
        return list(items)


def run(out_dir: str, cases=("1B-layers", "8B-layers", "llama-3.2-1B", "8B-4layers+head"), variants=VARIANTS,
        step_kind: str = "train", batch: int = BATCH, amp: bool = False) -> Results:  # fmt: skip
    res = Results("model_step", baseline="floor (cuBLAS GEMMs + SDPA fwd+bwd)")
    for case in cases:
        what = "training step" if step_kind == "train" else "forward + backward"
        print(f"== {what}, {case}, {batch} x {SEQ} tokens" + (", autocast over float32" if amp else ""))
        run_case(res, case, variants, step_kind, batch, amp)
        torch.cuda.empty_cache()
        res.write(out_dir)  # after each case: a run cut short keeps what it measured
    print(res.table())
    return res
