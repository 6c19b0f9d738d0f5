"""``python -m codetta tune``: tune every GEMM a model's training step runs through codetta.

What a step asks of the GEMMs is recorded, not written down by hand: the model's
codetta operators run forward and backward under ``kernels.launch.recording()`` on
the CPU at a small token count (no compute), and every recorded call is scaled to
the token counts asked for. Each distinct tuning key is then tuned on the GPU
(or found in the user's cache / the shipped table), and the result can be written
as a table in the shipped format (maintainers: ``--out codetta/kernels/tuned/``).

The operators recorded are those that exist (``codetta.ops``), called as the
Hugging Face drop-in calls them (``codetta/integrations/hf.py``) at the layer
boundaries of a Llama-family decoder: the attention output projection with the
residual and the MLP's norm (next GEMMs: gate and up, [f, d] each), the MLP's
down projection with the residual and the next layer's norm (next GEMMs: q, k, v),
and, for the last layer, the LM head + loss operator over its chunks of rows
(``codetta.ops.linear_cross_entropy`` with the final norm's rstd as its row scale; the
last down projection and final norm run in PyTorch there).
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from .kernels import configs
from .kernels.engines import PINGPONG, TRITON
from .kernels.launch import RecordedCall, recording
from .kernels.program import Kind
from .kernels.settings import SETTINGS, override
from .kernels.tuning import CACHE_FORMAT, Chooser, policy_allows
from .models import Widths
from .ops.cross_entropy import linear_cross_entropy, rows_per_chunk
from .ops.residual_rmsnorm import (
    SwiGLU,
    residual_rmsnorm,
    residual_rmsnorm_linear,
    residual_rmsnorm_swiglu,
)
from .ops.rope import RoPE
from .programs.rope import RMS_ROPE

TOKEN_BUCKETS = (4096, 8192, 16384, 32768, 65536)
# the probe's token count and the LM head's probe vocabulary (the real one allocates a [V, d]
# fp32 accumulator on the CPU: 4 GB at 70B widths), scaled to the model's afterwards: per
# model, the first multiples of 8 from these that no width of its GEMMs equals (_probe_dims)
_PROBE_TOKENS = 104
_PROBE_VOCAB = 152


def _probe_dims(w: Widths) -> tuple[int, int]:
    """``(tokens, vocab)`` for the probes of ``w``: each a multiple of 8 that no dimension of
    the model's GEMMs equals (the widths, the paired / concatenated ones, and the probe's
    own row counts: 1-3 chunks of rows), so that ``_scaled`` replaces only what they stand
    for."""
    kv = w.kv_heads * w.head_dim
    widths = {w.hidden, w.intermediate, 2 * w.intermediate, w.q_width, kv, 2 * kv, w.q_width + kv,
              w.qkv_width, w.head_dim, w.vocab}  # fmt: skip
    tokens = next(t for t in range(_PROBE_TOKENS, 1 << 30, 8) if widths.isdisjoint((t, 2 * t, 3 * t)))
    taken = widths | {tokens, 2 * tokens, 3 * tokens}
    vocab = next(v for v in range(_PROBE_VOCAB, 1 << 30, 8) if v not in taken)
    return tokens, vocab


def _probe(w: Widths, dtype: torch.dtype) -> list[RecordedCall]:
    """The GEMMs of one layer as the Hugging Face drop-in runs it (forward and backward):
    o_proj + residual -> norm -> gate/up + SwiGLU, then down_proj + residual -> norm ->
    next q, k (RoPE in their epilogues), v (dSwiGLU in its dX epilogue), and the last
    layer's down_proj + final norm (the LM head + loss: ``_probe_loss``); then the two K1
    of a float32 residual stream (the cast mode under autocast)."""
    named = {"hidden": w.hidden, "intermediate": w.intermediate, "q (heads x head_dim)": w.q_width,
             "k / v (kv_heads x head_dim)": w.kv_heads * w.head_dim}  # fmt: skip
    odd = [f"{name} {v}" for name, v in named.items() if v % 8]
    if odd:  # (as apply_codetta refuses such a model)
        raise ValueError(f"model {w.name}: widths not multiples of 8 (TMA moves 16-byte rows): "
                         f"{', '.join(odd)}")  # fmt: skip
    T, d, f, kv = _probe_dims(w)[0], w.hidden, w.intermediate, w.kv_heads * w.head_dim

    def t(*shape, dt=dtype):
        return torch.empty(*shape, dtype=dt).requires_grad_()

    with override(force_reference=True), recording() as rec:
        x, act = residual_rmsnorm_swiglu(t(T, w.q_width), t(d, w.q_width), t(T, d), t(d, dt=torch.float32),
                                         t(f, d), t(f, d))  # fmt: skip
        qk = {"qk_norm_weights": (t(w.head_dim), t(w.head_dim))} if w.qk_norm else {}
        rope = (
            RoPE(torch.arange(T), torch.rand(w.head_dim // 2), interleaved=w.rope_interleaved, **qk)
            if w.head_dim in RMS_ROPE and not w.partial_rotary
            else None
        )
        bias = [t(w.q_width), t(kv), t(kv)] if w.qkv_bias else None  # (Qwen2's)
        x2, zs = residual_rmsnorm_linear(act, t(d, f), x, t(d, dt=torch.float32), [t(w.q_width, d), t(kv, d),
                                         t(kv, d)], rope=rope, bias=bias)  # fmt: skip
        x3, n = residual_rmsnorm(
            SwiGLU(*(t(T, f) for _ in range(3))), t(d, f), t(T, d), t(d, dt=torch.float32)
        )
        outs = [x2, *zs, x3, n]
        torch.autograd.backward(outs, [torch.empty_like(o) for o in outs])
        # the drop-in's cast mode (autocast): a float32 residual stream, whose K1 is its own
        # program (RESIDUAL_RMS_F32); its other GEMMs are the ones above
        f32 = torch.float32
        xm, actm = residual_rmsnorm_swiglu(t(T, w.q_width), t(d, w.q_width), t(T, d, dt=f32), t(d, dt=f32),
                                           t(f, d), t(f, d))  # fmt: skip
        residual_rmsnorm(actm, t(d, f), xm, t(d, dt=f32))  # (K1 alone: no next GEMM)
        return list(rec)


def _probe_loss(w: Widths, dtype: torch.dtype, chunks: int = 3) -> list[RecordedCall]:
    """The fused LM head + loss of a training step (its row chunk recorded as the probe,
    the vocabulary as ``_PROBE_VOCAB``: ``_scaled`` makes both the real ones). Three
    chunks: the first chunk's dW GEMM stores, the middle ones' add to it, the last one's
    adds and rounds (three programs); one chunk: a plain GEMM into the weight's dtype."""
    (T, V), d = _probe_dims(w), w.hidden
    # (the final norm's rstd as the loss's row scale, as the drop-in passes it: its own
    # logits program, CE_LOGITS_SCALED, unless CODETTA_CE_NORM_FACTORS=0)
    scaled = SETTINGS.ce_norm_factors
    with override(force_reference=True), recording() as rec:
        n = torch.empty(chunks * T, d, dtype=dtype, requires_grad=True)
        head = torch.empty(V, d, dtype=dtype, requires_grad=True)
        target = torch.zeros(chunks * T, dtype=torch.long)
        row_scale = torch.ones(chunks * T, requires_grad=True) if scaled else None
        linear_cross_entropy(n, head, target, chunk_rows=T, row_scale=row_scale).backward()
        return list(rec)


def _scaled(
    call: RecordedCall, probe: tuple[int, int], tokens: int, vocab: int | None = None
) -> RecordedCall:
    """A probe's call with the probe's token count (and vocabulary, for the LM head's
    calls), ``probe`` (``_probe_dims``), replaced by the real ones."""

    def s(x):
        if x == probe[0]:
            return tokens
        return vocab if vocab is not None and x == probe[1] else x

    ops = tuple(
        (n, None if shape is None else tuple(s(x) for x in shape), dt) for n, shape, dt in call.operands
    )
    return replace(call, M=s(call.M), N=s(call.N), K=s(call.K), operands=ops)


def model_calls(w: Widths, tokens=TOKEN_BUCKETS, dtype=torch.bfloat16, pingpong: bool = True) -> dict:
    """``{tuning key: RecordedCall}``: one call per distinct key of the model's step over
    the token counts (keys bucket shapes to powers of two, so many calls share one)."""
    probe, loss, single = _probe(w, dtype), _probe_loss(w, dtype), _probe_loss(w, dtype, chunks=1)
    dims, out = _probe_dims(w), {}
    for t in tokens:
        chunk = rows_per_chunk(t, w.vocab, torch.finfo(dtype).bits // 8)
        head = single if chunk >= t else loss  # (all the rows in one chunk: its own dW GEMM)
        for call in [_scaled(c, dims, t) for c in probe] + [_scaled(c, dims, chunk, w.vocab) for c in head]:
            # keyed as the launcher keys it: with or without the ping-pong mainloop, as the
            # program and the ping-pong policy setting allow
            pp = pingpong and call.program.pingpong and policy_allows(call)
            out.setdefault(Chooser.key(call, pp), call)
    return out


def _tensor(shape, dtype, transposed: bool, device):
    if transposed:
        return torch.randn(shape[1], shape[0], device=device).to(dtype).t()
    return torch.randn(*shape, device=device).to(dtype)


def call_inputs(call: RecordedCall, device="cuda") -> tuple:
    """``(a, weight, operands)``: fresh random data of a recorded call's shapes and layout."""
    paired = {op.name for op in call.program.inputs if op.kind is Kind.PAIRED_WEIGHT}
    part_a = {op.name for op in call.program.inputs if op.kind in (Kind.K_PART_A, Kind.M_PART)}
    part_w = {op.name for op in call.program.inputs if op.kind in (Kind.K_PART_B, Kind.N_PART)}
    # (M and N are the output's: with M or N parts, a and the weight hold what the parts leave)
    kinds = {op.name: op.kind for op in call.program.inputs}
    rows = {kind: sum(shape[0] for name, shape, _ in call.operands if kinds.get(name) is kind)
            for kind in (Kind.M_PART, Kind.N_PART)}  # fmt: skip
    a = _tensor((call.M - rows[Kind.M_PART], call.K), call.dtype, call.a_t, device) * 0.5
    weight = _tensor((call.N - rows[Kind.N_PART], call.K), call.dtype, call.b_t, device) * call.K**-0.5
    operands = {}
    for name, shape, dt in call.operands:
        if name in paired or name in part_w:  # a second weight (or a K part's), laid out as the first
            operands[name] = _tensor(shape, dt, call.b_t, device) * shape[1] ** -0.5
        elif name in part_a:  # a K part's A, laid out as a
            operands[name] = _tensor(shape, dt, call.a_t, device) * 0.5
        elif shape is None:
            operands[name] = 1e-5 if name == "eps" else 1.0 / call.N
        elif dt in (torch.int32, torch.int64):
            operands[name] = torch.randint(0, call.N, shape, dtype=dt, device=device)
        else:
            operands[name] = torch.rand(*shape, device=device).to(dt) + 0.5
    return a, weight, operands


NOMINAL_TFLOPS = 650.0  # an H200's bf16 GEMM rate at the power cap, roughly (NOTES.md)


def estimated_us(call: RecordedCall) -> float:
    """The call's GEMM time at ``NOMINAL_TFLOPS``, in us: what ``tune --shorter-than`` sorts
    by (before e6f33ba the tuner timed a GEMM shorter than its launch's ~110 us of host
    time at the host's pace, NOTES.md: those keys are the ones to tune again)."""
    return 2.0 * call.M * call.N * call.k_total / (NOMINAL_TFLOPS * 1e6)


def run_call(call: RecordedCall, device="cuda", force: bool = False, seconds: float = 1.0):
    """Tune one recorded call on the GPU (fresh random data of its shapes and layout)."""
    from .kernels.launch import tune

    a, weight, operands = call_inputs(call, device)
    return tune(a, weight, epilogue=call.program, force=force, seconds=seconds, **operands)


def known_programs() -> dict:
    """``{"name@source_key": Program}`` (a tuning key's first field): every program the
    ``codetta.programs`` package names, and those every known model's step records at
    every token bucket (programs made per call, such as the RoPE ones)."""
    from . import models
    from . import programs as progs
    from .kernels.program import Program

    found = [p for p in vars(progs).values() if isinstance(p, Program)]
    for w in models.KNOWN.values():
        found += [call.program for call in model_calls(w, TOKEN_BUCKETS).values()]
    return {f"{p.name}@{p.source_key}": p for p in found}


def entry_usable(program, cfg, pingpong: bool) -> bool:
    """Whether a table entry's ``cfg`` is among the configurations the chooser picks from
    for ``program`` under the current settings (the mainloops' candidates; it takes a
    shipped or cached entry only then, ``tuning.Chooser.known``)."""
    from .kernels.tuning import program_candidates

    return cfg in program_candidates(program, pingpong)


def table(keys, gpu: str, capability, num_sms: int, entries: dict) -> dict:
    """A shipped-format table of ``keys`` from ``entries`` ({key: Config}). Written by the
    command, it also lists as ``pending`` the keys it was asked for and has not tuned yet
    (a run cut short), so what the table does not cover is data, not a guess."""
    import triton

    return {
        "format": CACHE_FORMAT,
        "identity": {
            "gpu": gpu,
            "capability": list(capability),
            "num_sms": num_sms,
            "triton": triton.__version__,
        },
        "entries": {k: asdict(entries[k]) for k in sorted(keys) if k in entries},
    }


def _progress(items, desc):
    try:
        from tqdm import tqdm

        return tqdm(items, desc=desc, file=sys.stderr)
    except ImportError:
        total = len(items)

        def gen():
            for i, x in enumerate(items, 1):
                print(f"{desc}: {i}/{total}", file=sys.stderr, flush=True)
                yield x

        return gen()


def main(args) -> int:
    start = time.monotonic()
    from .models import KNOWN, widths_of

    specs = args.model or []
    if args.all_known:
        specs += list(KNOWN)
    if args.widths:
        d, f, h, kv, hd, v = args.widths
        if min(args.widths) < 1 or h % kv:
            print(f"--widths {' '.join(map(str, args.widths))}: every width must be >= 1 and heads a "
                  "multiple of kv_heads", file=sys.stderr)  # fmt: skip
            return 2
        specs.append(Widths("custom", d, f, h, kv, hd, v))
    if min(args.tokens) < 1:
        print(f"--tokens must be >= 1 each, got {args.tokens}", file=sys.stderr)
        return 2
    if not specs:
        print(
            "name a model (--model), --all-known, or --widths d f heads kv_heads head_dim vocab",
            file=sys.stderr,
        )
        return 2
    tokens = tuple(args.tokens)
    calls: dict = {}
    for spec in specs:
        w = widths_of(spec)
        if getattr(args, "rope_interleaved", False):
            w = replace(w, name=f"{w.name} (interleaved RoPE)", rope_interleaved=True)
        found = model_calls(w, tokens)
        print(f"{w.name}: {len(found)} tuning keys over {len(tokens)} token counts", file=sys.stderr)
        for k, c in found.items():
            calls.setdefault(k, c)
    if getattr(args, "program", None):
        known = {c.program.name for c in calls.values()}
        unknown = sorted(set(args.program) - known)
        if unknown:
            have = ", ".join(sorted(known))
            print(f"--program: {', '.join(unknown)} not among the models' programs: {have}", file=sys.stderr)
            return 2
        calls = {k: c for k, c in calls.items() if c.program.name in args.program}
    if getattr(args, "shorter_than", None) is not None:
        calls = {k: c for k, c in calls.items() if estimated_us(c) < args.shorter_than}
    print(f"{len(calls)} distinct tuning keys", file=sys.stderr)
    if args.list:
        if getattr(args, "gpu", None):
            return _list_coverage(calls, args.gpu)
        for k in sorted(calls):
            print(k)
        return 0
    if args.pending:
        # a change of the drop-in's plan (new programs, chunk sizes) lists its new keys as
        # pending in an existing table, so the shipped-table test sees them asked for
        if not args.out or not Path(args.out).is_file():
            print("--pending needs --out naming an existing table file", file=sys.stderr)
            return 2
        out = Path(args.out)
        data = json.loads(out.read_text())
        data["pending"] = sorted(set(calls) - set(data.get("entries", {})))
        out.write_text(json.dumps(data, indent=1) + "\n")
        print(f"{len(data['pending'])} keys pending in {out}", file=sys.stderr)
        return 0
    if not torch.cuda.is_available():
        print("tuning needs a CUDA GPU (--list prints the keys without one)", file=sys.stderr)
        return 2
    from .kernels import device as dev

    out = None
    if args.out:
        out = Path(args.out)
        if out.is_dir() or args.out.endswith("/"):
            out = out / (configs.gpu_slug(dev.name(0)) + ".json")
    if getattr(args, "method", None) is not None:
        with override(tune_method=args.method):
            return _tune_all(args, calls, out, start)
    return _tune_all(args, calls, out, start)


def _list_coverage(calls: dict, gpu: str) -> int:
    """``tune --list --gpu NAME``: each key of ``calls`` ({key: RecordedCall}) with where its
    configuration comes from on that GPU (the shipped tables only: a user's tuning cache
    comes first at run time): its own table, another GPU's (lent), the same shape's entry
    of the program it is ``tuned_like``, or neither."""
    from .kernels.tuning import shipped_gpus, shipped_table

    idents = shipped_gpus()
    if gpu not in idents:
        print(f"--gpu {gpu!r}: no shipped table names it; the tables are for: {', '.join(sorted(idents))}",
              file=sys.stderr)  # fmt: skip
        return 2
    entries = shipped_table(gpu, tuple(idents[gpu]["capability"]), idents[gpu]["num_sms"])
    counts: dict = {}
    for key in sorted(calls):
        like = calls[key].program.tuned_like
        sibling = None
        if like is not None:  # (the untuned key takes that program's pick at the same shape)
            stand_in = replace(calls[key], program=like)
            sibling = Chooser.key(stand_in, not key.endswith("|no-pingpong"))
        if key not in entries and sibling in entries:
            prog = calls[key].program
            same = entries[sibling] in TRITON.candidates(prog) + PINGPONG.candidates(prog)
            where = f"none, {like.name}'s {'pick' if same else 'nearest usable entry'} (tuned_like)"
        elif key not in entries:
            where = "none (nearest entry or rule)"
        else:
            where = f"lent ({entries.borrowed[key]})" if key in entries.borrowed else "own"
        counts[where] = counts.get(where, 0) + 1
        print(f"{key}  {where}")
    print(f"{gpu}: " + ", ".join(f"{n} {w}" for w, n in sorted(counts.items())), file=sys.stderr)
    return 0


def _tune_seconds(tuned: list, call) -> float:
    """How long tuning ``call`` will take, from the keys tuned so far ([(estimated us,
    seconds)]): a fixed part (compiles, the timing's fixed seconds: the shortest tuning
    seen) plus a part that grows with the GEMM's time (the scouting and timing runs: from
    the last key tuned, the largest so far, keys going cheapest first), with a quarter
    to spare."""
    fixed = min(sec for _, sec in tuned)
    est, sec = tuned[-1]
    per_us = max(0.0, sec - fixed) / max(est, 1.0)
    return 1.25 * (fixed + per_us * estimated_us(call))


def _tune_all(args, calls: dict, out, start: float | None = None) -> int:
    """Tune ``calls`` cheapest first; ``start``: when the command began (``time.monotonic``),
    from which ``--time-limit`` counts (recording the models' calls and CUDA's start count;
    the interpreter's and torch's start before ``main`` do not: gpu_call.sh leaves 30 s)."""
    old = json.loads(out.read_text()) if out is not None and out.exists() and args.merge else {}
    # (with --merge the table keeps its entries and the keys it lists as pending: a run
    # over some models or token counts leaves the others' pending keys listed)
    old = {"entries": old.get("entries", {}), "pending": old.get("pending", [])}
    picked, sources = {}, {}
    # cheapest first: a run cut short keeps the most keys (the table is written as it goes:
    # after every key actually tuned, which takes seconds to minutes, and every 10 others)
    order = sorted(calls.items(), key=lambda kv: kv[1].M * kv[1].N * kv[1].K)
    limit = getattr(args, "time_limit", None)
    start = time.monotonic() if start is None else start
    tuned, left = [], []  # tuned: (estimated us, seconds it took) of each key tuned
    for i, (key, call) in enumerate(_progress(order, "codetta tune"), 1):
        if limit is not None and tuned and time.monotonic() - start + _tune_seconds(tuned, call) > limit:
            left = [k for k, _ in order[i - 1 :]]
            break
        began = time.monotonic()
        cfg, source = run_call(call, force=args.force, seconds=args.seconds)
        if limit is not None and source == "tuned":
            tuned.append((estimated_us(call), time.monotonic() - began))
        picked[key] = cfg
        sources[source] = sources.get(source, 0) + 1
        if out is not None and (source == "tuned" or i % 10 == 0 or i == len(order)):
            _write_table(out, picked, old, calls)
    print("configurations: " + ", ".join(f"{n} {s}" for s, n in sorted(sources.items())), file=sys.stderr)
    if left:
        # (stopped before a key whose tuning would pass the limit, estimated from the keys
        # tuned; these stay pending in the table; some may have entries already, which
        # would have taken no tuning: the estimate cannot tell them apart without a GPU look)
        if out is not None:
            _write_table(out, picked, old, calls)
        print(f"--time-limit {limit:g} s: stopped with {len(left)} of {len(order)} keys not reached:",
              file=sys.stderr)  # fmt: skip
        for k in left:
            print(f"  not reached: {k}", file=sys.stderr)
    if out is not None:
        kept = len(set(old["entries"]) - set(picked))
        print(f"wrote {len(picked)} entries (+{kept} kept) to {out}", file=sys.stderr)
    return 0


def _write_table(out: Path, picked: dict, old: dict, requested) -> None:
    """Write ``picked`` over ``old``'s entries ({"entries": ..., "pending": [...]}, what
    --merge keeps); pending: the keys asked for now or listed before, not tuned."""
    from .kernels import device as dev

    data = table(picked, dev.name(0), dev.capability(0), dev.num_sms(0), picked)
    data["entries"] = dict(sorted({**old["entries"], **data["entries"]}.items()))
    data["pending"] = sorted((set(requested) | set(old["pending"])) - set(data["entries"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(out)
