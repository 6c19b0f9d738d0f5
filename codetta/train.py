"""``python -m codetta train``: train a Hugging Face Llama-family causal LM for some steps,
in one process or several (``torchrun``), under FSDP2 or DDP, with codetta on or off;
logs the loss and tokens/s per GPU, and writes every step's numbers as JSON.

    torchrun --nproc_per_node=2 -m codetta train --model llama3-1b --parallel fsdp
    torchrun --nproc_per_node=2 -m codetta train --model llama3-1b --parallel fsdp --no-codetta

Precision: FSDP2 keeps float32 parameters and optimizer state, computes in ``--dtype``
and reduces gradients in float32 (``MixedPrecisionPolicy``); DDP and one process
(``--parallel none``) keep the parameters in ``--dtype`` (as the benchmark does), or with
``--amp`` in float32, each forward under ``torch.autocast`` to ``--dtype`` (Hugging Face
Trainer's ``bf16=True``; fp16 with a ``GradScaler``, as its ``fp16=True``), which codetta
runs in its cast mode (docs/huggingface.md, "Mixed precision").

Data: a synthetic stream with a learnable rule (``--data synthetic``: over 64 tokens
in a fixed random order, each token is followed by the next or the one after, at
random, so the loss falls towards ln 2), or a flat file of token ids (``--data
tokens.bin --data-dtype uint16``). Each step takes the same global batch whatever
the number of processes: step s uses sequences [s*B, (s+1)*B) of the stream, each
process a contiguous share of them, split into ``--accum`` micro-batches whose
gradients are synchronised after the last one only (FSDP2's
``set_requires_gradient_sync``, DDP's ``no_sync``).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

# from each model's published config.json: what the widths table (codetta.models) lacks
_FULL = {
    "llama3-1b": dict(num_hidden_layers=16, rope_theta=500000.0, rms_norm_eps=1e-5),
    "llama3-3b": dict(num_hidden_layers=28, rope_theta=500000.0, rms_norm_eps=1e-5),
    "llama3-8b": dict(num_hidden_layers=32, rope_theta=500000.0, rms_norm_eps=1e-5),
    "llama3-70b": dict(num_hidden_layers=80, rope_theta=500000.0, rms_norm_eps=1e-5),
    "qwen3-0.6b": dict(num_hidden_layers=28, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen3-1.7b": dict(num_hidden_layers=28, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen3-4b": dict(num_hidden_layers=36, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen3-8b": dict(num_hidden_layers=36, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen3-14b": dict(num_hidden_layers=40, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen3-32b": dict(num_hidden_layers=64, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "mistral-7b": dict(num_hidden_layers=32, rope_theta=1000000.0, rms_norm_eps=1e-5),
    "qwen2.5-0.5b": dict(num_hidden_layers=24, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen2.5-1.5b": dict(num_hidden_layers=28, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen2.5-3b": dict(num_hidden_layers=36, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen2.5-7b": dict(num_hidden_layers=28, rope_theta=1000000.0, rms_norm_eps=1e-6),
    "qwen2.5-14b": dict(num_hidden_layers=48, rope_theta=1000000.0, rms_norm_eps=1e-5),
    "qwen2.5-32b": dict(num_hidden_layers=64, rope_theta=1000000.0, rms_norm_eps=1e-5),
    "qwen2.5-72b": dict(num_hidden_layers=80, rope_theta=1000000.0, rms_norm_eps=1e-5),
    "phi-4": dict(num_hidden_layers=40, rope_theta=250000.0, rms_norm_eps=1e-5),
}
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SYNTHETIC_TOKENS = 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="llama3-1b",
        help="a name from codetta.models.KNOWN, a config.json (or its folder), or a hub name",
    )
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the model's own)")
    p.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the model's own)")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch", type=int, default=8, help="sequences per step, all processes together")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step (gradient accumulation)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=10, help="steps of linear learning-rate warmup")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default="bf16")
    p.add_argument(
        "--amp",
        action="store_true",
        help="float32 parameters and AdamW state, each forward under torch.autocast to --dtype "
        "(fp16: with a GradScaler), as Hugging Face Trainer's bf16=True / fp16=True; --parallel "
        "none or ddp (FSDP2's mixed precision is its MixedPrecisionPolicy, always on)",
    )
    p.add_argument("--parallel", choices=["none", "fsdp", "ddp"], default="fsdp")
    p.add_argument(
        "--device",
        choices=["auto", "cuda", "cpu"],
        default="auto",
        help="where to train (auto: the GPU when there is one; cpu: gloo between processes, "
        "codetta's PyTorch reference path, for checking the wiring)",
    )
    p.add_argument(
        "--codetta",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="patch the model with codetta.apply_codetta (--no-codetta: the model as it is)",
    )
    p.add_argument(
        "--wrap-base",
        action="store_true",
        help="FSDP2: also fully_shard the base model (model.model), as some recipes do",
    )
    p.add_argument(
        "--compile", action="store_true", help="torch.compile each decoder layer (unpatched models only)"
    )
    p.add_argument(
        "--grad-checkpointing",
        action="store_true",
        help="Hugging Face's gradient checkpointing (model.gradient_checkpointing_enable())",
    )
    p.add_argument(
        "--precompile",
        action="store_true",
        help="before the first step, compile every codetta kernel of a micro-batch's forward and "
        "backward at once (codetta.precompile, GPU-measured on one process; this flag not yet run on a GPU)",
    )
    p.add_argument("--data", default="synthetic", help="'synthetic' or a flat file of token ids")
    p.add_argument("--data-dtype", choices=["uint16", "int32", "int64"], default="uint16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--perturb",
        action="store_true",
        help="move every initial weight by about one bf16 rounding (measures run-to-run noise)",
    )
    p.add_argument("--time-from", type=int, default=5, help="steps left out of the tokens/s figures")
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--out", default=None, help="JSON file for every step's loss and time (rank 0)")
    p.add_argument("--save", default=None, help="save the trained weights here (torch.save, rank 0)")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="profile this many steps after --time-from (rank 0): kernel table and GPU busy "
                        "time next to --out (or in the working folder); those steps run slower")  # fmt: skip
    p.add_argument("--host-profile", type=int, default=0, metavar="STEPS",
                   help="cProfile this many steps after --time-from (rank 0): where the host's time to "
                        "issue a step goes, by function, next to --out; those steps run slower")  # fmt: skip


def hf_config(spec: str, layers: int | None, vocab: int | None, seq_len: int):
    """A ``transformers`` config: a known model's from its widths, else read by
    ``AutoConfig`` (a config.json, its folder, or a hub name)."""
    import transformers

    from .models import KNOWN, hub_name_problem

    name = spec.lower()
    if name in KNOWN:
        w = KNOWN[name]
        cls = (
            transformers.Qwen3Config if w.qk_norm
            else transformers.Qwen2Config if w.qkv_bias
            else transformers.MistralConfig if name.startswith("mistral")
            else transformers.Phi3Config if name.startswith("phi")
            else transformers.LlamaConfig
        )  # fmt: skip
        cfg = cls(hidden_size=w.hidden, intermediate_size=w.intermediate, num_attention_heads=w.heads,
                  num_key_value_heads=w.kv_heads, head_dim=w.head_dim, vocab_size=w.vocab,
                  tie_word_embeddings=w.tied, max_position_embeddings=max(seq_len, 4096),
                  attn_implementation="sdpa", **_FULL[name])  # fmt: skip
    else:
        known = ", ".join(KNOWN)
        # (a hub name is org/name; a file or folder named here must be there; anything else
        # is a mistyped known name: said now, not after transformers' retries)
        problem = hub_name_problem(spec)
        if problem:
            raise SystemExit(f"codetta train: --model {spec}: not a known name ({known}); {problem}")
        try:  # (a config.json read as it is, whatever its name; a folder's config.json; a hub name)
            cfg = transformers.AutoConfig.from_pretrained(spec)
        except (OSError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise SystemExit(
                f"codetta train: --model {spec}: not a known name ({known}), nor a config "
                f"file or folder here, nor a hub config that could be read ({first})"
            ) from None
        from .integrations.hf import FAMILIES

        if getattr(cfg, "model_type", None) not in FAMILIES:
            raise SystemExit(
                f"codetta train: --model {spec}: model_type {getattr(cfg, 'model_type', None)!r} is not one "
                f"this trains ({', '.join(sorted(FAMILIES))})"
            )
        cfg._attn_implementation = "sdpa"
        cfg.max_position_embeddings = max(cfg.max_position_embeddings, seq_len)
    if layers is not None:
        cfg.num_hidden_layers = layers
        if getattr(cfg, "layer_types", None):
            cfg.layer_types = cfg.layer_types[:layers]
    if vocab is not None:
        cfg.vocab_size = vocab
    cfg.use_cache = False
    return cfg


class Stream:
    """The token stream: sequence g is ``tokens[g*T : (g+1)*T]`` (synthetic: made from g)."""

    def __init__(self, data: str, data_dtype: str, seq_len: int, vocab: int, seed: int):
        self.seq_len, self.seed = seq_len, seed
        if data == "synthetic":
            self.tokens = None
            order = torch.Generator().manual_seed(seed)
            self.used = torch.randperm(vocab, generator=order)[: min(vocab, SYNTHETIC_TOKENS)]
        else:
            dtype = getattr(torch, data_dtype)
            if not os.path.isfile(data):
                raise SystemExit(f"codetta train: --data {data}: no such file (a flat file of token ids)")
            n = os.path.getsize(data) // torch.empty((), dtype=dtype).element_size()
            if n < seq_len:
                raise SystemExit(f"codetta train: --data {data} holds {n} tokens, fewer than one sequence "
                                 f"({seq_len}) as {data_dtype}")  # fmt: skip
            self.tokens = torch.from_file(data, shared=False, size=n, dtype=dtype)
            low, top = _id_range(self.tokens)
            if low < 0 or top >= vocab:
                raise SystemExit(
                    f"codetta train: --data {data} holds token id {low if low < 0 else top}, outside the "
                    f"vocabulary [0, {vocab}) (read as {data_dtype}: --data-dtype says how the file "
                    "stores them)"
                )

    def sequences(self, first: int, count: int) -> torch.Tensor:
        T = self.seq_len
        if self.tokens is not None:
            n = self.tokens.numel() // T
            rows = [self.tokens[(g % n) * T : (g % n + 1) * T] for g in range(first, first + count)]
            return torch.stack(rows).long()
        k = self.used.numel()
        out = torch.empty(count, T, dtype=torch.long)
        for row, g in enumerate(range(first, first + count)):
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + g)
            start = torch.randint(k, (1,), generator=gen)
            hops = torch.randint(1, 3, (T,), generator=gen)
            hops[0] = 0
            out[row] = self.used[(start + hops.cumsum(0)) % k]
        return out


def _id_range(tokens: torch.Tensor) -> tuple[int, int]:
    """The smallest and largest id, a chunk at a time in int64 (uint16 has no min/max on the
    CPU, and a whole large file in int64 would take 4x its size)."""
    low, top, step = 0, 0, 1 << 24
    for i in range(0, tokens.numel(), step):
        chunk = tokens[i : i + step].to(torch.int64)
        low, top = min(low, int(chunk.min())), max(top, int(chunk.max()))
    return low, top


def check_arguments(args) -> None:
    """Refuse, in one line each, what would crash later or train nothing: counts below one,
    a non-finite or negative learning rate, fp16 parameters with AdamW (no --amp), FSDP2
    wrapping the base model apart from tied embeddings, a flag that would do nothing here
    (--wrap-base without FSDP2, --precompile without codetta), a --profile window past the run,
    and --out / --save paths that cannot be written (found before training, not after)."""
    least = dict.fromkeys(("batch", "accum", "steps", "log_every"), 1)
    least.update(dict.fromkeys(("warmup", "time_from", "profile", "host_profile"), 0))
    for name, low in least.items():
        if getattr(args, name) < low:
            raise SystemExit(
                f"codetta train: --{name.replace('_', '-')} must be >= {low}, got {getattr(args, name)}"
            )
    if args.seq_len < 2:
        raise SystemExit(f"codetta train: --seq-len must be >= 2 (a token and the next), got {args.seq_len}")
    for name, least in (("layers", 1), ("vocab", 2)):
        if getattr(args, name) is not None and getattr(args, name) < least:
            raise SystemExit(f"codetta train: --{name} must be >= {least}, got {getattr(args, name)}")
    if not (math.isfinite(args.lr) and args.lr >= 0):
        raise SystemExit(f"codetta train: --lr must be a finite number >= 0, got {args.lr}")
    for flag, on, needs, why in (
        ("--wrap-base", args.wrap_base, args.parallel == "fsdp", "is for --parallel fsdp"),
        ("--precompile", args.precompile, args.codetta, "compiles codetta's kernels: not with --no-codetta"),
    ):
        if on and not needs:
            raise SystemExit(f"codetta train: {flag} {why} (it would do nothing here)")
    if args.amp and args.dtype == "fp32":
        raise SystemExit("codetta train: --amp computes in --dtype bf16 or fp16 (fp32 is no mixed precision)")
    if args.amp and args.parallel == "fsdp":
        raise SystemExit(
            "codetta train: --amp is for --parallel none or ddp; under FSDP2 the parameters are "
            "float32 and the compute in --dtype already (its MixedPrecisionPolicy)"
        )
    if args.dtype == "fp16" and not args.amp and args.parallel != "fsdp":
        raise SystemExit(
            "codetta train: --dtype fp16 without --amp keeps the parameters and AdamW's state in fp16, "
            "which overflows within a few steps; pass --amp (fp16 autocast with a GradScaler, float32 "
            "parameters) or --dtype bf16"
        )
    for flag, steps in (("--profile", args.profile), ("--host-profile", args.host_profile)):
        if steps and args.time_from + steps > args.steps:
            raise SystemExit(
                f"codetta train: {flag} {steps} after --time-from {args.time_from} runs past --steps "
                f"{args.steps}"
            )
    for flag, path in (("--out", args.out), ("--save", args.save)):
        if path is None or int(os.environ.get("RANK", "0")) != 0:
            continue  # (rank 0 writes them: it alone tries)
        target = Path(path)
        if target.is_dir():
            raise SystemExit(f"codetta train: {flag} {path} is a folder; give a file name")
        try:  # (the folder made now, as it would be after training)
            target.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise SystemExit(f"codetta train: {flag} {path}: its folder cannot be made ({exc})") from None
        try:  # (a file made and removed: what can be written, whatever the permissions say)
            if target.exists():
                with open(target, "ab"):
                    pass
            else:
                target.touch()
                target.unlink()
        except OSError as exc:
            raise SystemExit(f"codetta train: {flag} {path} cannot be written ({exc})") from None


def _perturb(model, seed: int) -> None:
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed + 9)
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, device=p.device, generator=gen, dtype=torch.float32)
            p.copy_((p.float() * (1 + 2**-8 * noise)).to(p.dtype))


def _setup_distributed(parallel: str, where: str = "auto"):
    """(rank, world, device): from torchrun's environment, or one process of its own."""
    import torch.distributed as dist

    if where == "cuda" and not torch.cuda.is_available():
        raise SystemExit("codetta train: --device cuda, but torch sees no GPU")
    cuda = where == "cuda" or (where == "auto" and torch.cuda.is_available())
    if parallel == "none":
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise SystemExit("codetta train: --parallel none runs one process; use --parallel fsdp or ddp")
        return 0, 1, torch.device("cuda" if cuda else "cpu")
    if "RANK" not in os.environ:  # not under torchrun: a group of one
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        torch.cuda.set_device(local)
    dist.init_process_group(backend="nccl" if cuda else "gloo")
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    return dist.get_rank(), dist.get_world_size(), device


def build(args, device, world: int):
    """The model (patched or not, wrapped for ``args.parallel``) and its optimizer."""
    import transformers

    cfg = hf_config(args.model, args.layers, args.vocab, args.seq_len)
    dtype = _DTYPES[args.dtype]
    torch.manual_seed(args.seed)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    if args.parallel != "fsdp" and not args.amp:
        model.to(dtype)
    else:  # float32 parameters (a config may name another dtype: from_config then builds in it)
        model.float()
    if args.perturb:
        _perturb(model, args.seed)
    if args.grad_checkpointing:
        model.gradient_checkpointing_enable()
    if args.codetta:
        if args.compile:
            raise SystemExit("codetta train: --compile is for the unpatched model here (--no-codetta)")
        import codetta

        try:
            codetta.apply_codetta(model)
        except ValueError as exc:  # (a model the drop-in refuses, with its reason)
            raise SystemExit(f"codetta train: {exc} (--no-codetta trains the model as it is)") from None
    elif args.compile:
        for layer in model.model.layers:
            layer.compile()
    if args.parallel == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # (FSDP2's default mesh is on the GPU whenever there is one, whatever --device says)
        kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),
                  mesh=init_device_mesh(device.type, (world,)))  # fmt: skip
        if args.wrap_base and getattr(cfg, "tie_word_embeddings", False):
            raise SystemExit(
                "codetta train: --wrap-base with tied embeddings: FSDP2 cannot shard the base model "
                "apart from the LM head that shares its table; leave out --wrap-base"
            )
        for layer in model.model.layers:
            fully_shard(layer, **kw)
        if args.wrap_base:
            fully_shard(model.model, **kw)
        fully_shard(model, **kw)
    elif args.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    # on one GPU or under DDP the fused AdamW (Hugging Face Trainer's default, adamw_torch_fused:
    # one kernel per step, and a GradScaler's overflow check stays on the GPU); FSDP2's sharded
    # parameters keep the multi-tensor one (fused over DTensors is not run on two GPUs here)
    cuda = device.type == "cuda"
    how = {"fused": True} if cuda and args.parallel != "fsdp" else {"foreach": cuda}
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, **how)
    return model, opt, cfg


def _sync_context(model, parallel: str, sync: bool):
    if parallel == "fsdp":
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    if parallel == "ddp" and not sync:
        return model.no_sync()
    return contextlib.nullcontext()


def _precompile(model, args, stream, rank: int, per: int, device) -> None:
    """codetta.precompile over the first micro-batch's forward and backward (with the
    gradient sync of a step's last micro-batch: every process runs the same collectives)."""
    import codetta

    ids = stream.sequences(rank * args.accum * per, per).to(device)
    t0 = time.perf_counter()

    def step():
        with _autocast(args, device):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()

    with _sync_context(model, args.parallel, True):
        n = codetta.precompile(step, model)
    if rank == 0:
        print(f"codetta train: precompiled {n} kernels in {time.perf_counter() - t0:.1f} s", flush=True)


def _autocast(args, device):
    """The forward's context: autocast to ``--dtype`` under ``--amp``, else none."""
    if not args.amp:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_DTYPES[args.dtype])


def train(args) -> dict:
    import torch.distributed as dist

    check_arguments(args)
    if args.codetta and args.dtype == "fp32" and args.device != "cpu" and torch.cuda.is_available():
        raise SystemExit(
            "codetta train: --dtype fp32 on the GPU would run the model's own forward (codetta's "
            "kernels serve bf16 and fp16): pass --dtype bf16, --no-codetta, or --device cpu"
        )
    rank, world, device = _setup_distributed(args.parallel, args.device)
    per = args.batch // (world * args.accum)
    if per * world * args.accum != args.batch:
        raise SystemExit(
            f"codetta train: --batch {args.batch} does not split into {world} processes "
            f"x {args.accum} micro-batches"
        )
    model, opt, cfg = build(args, device, world)
    # fp16 autocast: the loss scaled so that small gradients survive fp16 (Trainer's fp16=True)
    scaler = torch.amp.GradScaler(device.type) if args.amp and args.dtype == "fp16" else None
    scale = scaler.get_scale() if scaler is not None else None
    stream = Stream(args.data, args.data_dtype, args.seq_len, cfg.vocab_size, args.seed)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, args.warmup)))
    cuda = device.type == "cuda"
    unit = "GPU" if cuda else "process"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    losses, step_ms, host_ms = [], [], []
    tokens_per_gpu = args.batch * args.seq_len / world
    model.train()
    if args.precompile and args.codetta:
        _precompile(model, args, stream, rank, per, device)
    profiler = host_profiler = None
    for step in range(args.steps):
        if args.profile and rank == 0 and step in (args.time_from, args.time_from + args.profile):
            profiler = _profile(profiler, args, step_ms)
        if args.host_profile and rank == 0 and step in (args.time_from, args.time_from + args.host_profile):
            host_profiler = _host_profile(host_profiler, args)
        # the step's batches, made before its clock starts (a data loader's work)
        batches = [stream.sequences(step * args.batch + (rank * args.accum + m) * per, per)
                   for m in range(args.accum)]  # fmt: skip
        t0 = time.perf_counter()
        total = torch.zeros((), device=device, dtype=torch.float32)
        for micro, ids in enumerate(batches):
            ids = ids.to(device, non_blocking=True)
            with _sync_context(model, args.parallel, micro == args.accum - 1):
                with _autocast(args, device):
                    loss = model(input_ids=ids, labels=ids).loss / args.accum
                (loss if scaler is None else scaler.scale(loss)).backward()
            total += loss.detach().float()
        if scaler is None:
            opt.step()
            sched.step()
        else:
            scaler.step(opt)  # (skipped when a gradient overflowed; the scale then shrinks)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        if world > 1:
            dist.all_reduce(total)  # (SUM: gloo has no AVG)
        # the host's time to issue the step (the GPU started on the first kernel): close
        # to the step's time when the host, not the GPU, sets the pace
        host_ms.append((time.perf_counter() - t0) * 1e3)
        value = total.item() / world  # (waits for the step's kernels)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        if scaler is not None:
            # read once the step is done (no wait mid-step): a skipped step shrank the scale
            # and leaves the schedule, as Trainer does
            scale, last_scale = scaler.get_scale(), scale
            if scale >= last_scale:
                sched.step()
        losses.append(value)
        if not math.isfinite(value):
            raise SystemExit(f"codetta train: loss {value} at step {step}")
        if rank == 0 and (step % args.log_every == 0 or step == args.steps - 1):
            print(f"step {step:5d}  loss {value:.4f}  {step_ms[-1]:8.1f} ms (host {host_ms[-1]:6.1f})  "
                  f"{tokens_per_gpu / step_ms[-1] * 1e3:10.0f} tokens/s/{unit}", flush=True)  # fmt: skip
    if profiler is not None:
        _profile(profiler, args, step_ms)
    if host_profiler is not None:
        _host_profile(host_profiler, args)
    # (--time-from past the run: every step is timed, and the result says so)
    timed_from = args.time_from if args.time_from < len(step_ms) else 0
    if timed_from != args.time_from and rank == 0:
        print(f"codetta train: --time-from {args.time_from} >= --steps {args.steps}: every step is timed, "
              "the first ones with their warm-up", flush=True)  # fmt: skip
    timed, timed_host = step_ms[timed_from:], host_ms[timed_from:]
    result = {
        "model": args.model, "layers": cfg.num_hidden_layers, "vocab": cfg.vocab_size,
        "parallel": args.parallel, "world": world, "codetta": args.codetta, "compile": args.compile,
        "perturb": args.perturb, "dtype": args.dtype, "amp": args.amp,
        "param_dtype": str(next(model.parameters()).dtype).removeprefix("torch."), "batch": args.batch,
        "seq_len": args.seq_len, "accum": args.accum, "steps": args.steps, "time_from": args.time_from,
        "timed_from": timed_from, "lr": args.lr, "warmup": args.warmup, "seed": args.seed, "data": args.data,
        "data_dtype": args.data_dtype, "grad_checkpointing": args.grad_checkpointing,
        "wrap_base": args.wrap_base, "precompile": args.precompile,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__, "commit": os.environ.get("CODETTA_COMMIT", "unknown"),
        "losses": losses, "step_ms": step_ms, "host_ms": host_ms,
        "median_step_ms": statistics.median(timed), "median_host_ms": statistics.median(timed_host),
        "tokens_per_s_per_gpu": tokens_per_gpu / statistics.median(timed) * 1e3,
        "peak_memory_gb": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,
    }  # fmt: skip
    if rank == 0:
        print(
            f"done: {world} process(es), median {result['median_step_ms']:.1f} ms/step "
            f"(host {result['median_host_ms']:.1f} ms to issue it), "
            f"{result['tokens_per_s_per_gpu']:.0f} tokens/s/{unit}, final loss {losses[-1]:.4f}",
            flush=True,
        )
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    if args.save:
        _save(model, args, rank)
    if args.parallel != "none":
        # the model, its optimizer and whatever collective work they still hold go while
        # the process group is alive (a 2-process CPU run once died at exit, in gloo's
        # teardown, after finishing: NOTES.md)
        model = opt = sched = None
        gc.collect()
        dist.barrier()
        dist.destroy_process_group()
    return result


def _profile(profiler, args, step_ms):
    """Start a torch.profiler over the next steps (``profiler`` None), or stop it and write
    its kernel table and the GPU's busy time per step."""
    from torch.profiler import ProfilerActivity, profile

    if profiler is None:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        profiler = profile(activities=activities)
        profiler.__enter__()
        profiler.first_step = len(step_ms)
        return profiler
    profiler.__exit__(None, None, None)
    steps = len(step_ms) - profiler.first_step
    wall = sum(step_ms[profiler.first_step :])
    events = profiler.key_averages()

    def device_us(e):
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    # kernel rows only: an operator's row repeats the time of the kernels it launched
    kernels = [e for e in events if getattr(getattr(e, "device_type", None), "name", "") == "CUDA"]
    nccl = sum(device_us(e) for e in kernels if "nccl" in e.key.lower()) / 1e3
    compute = sum(device_us(e) for e in kernels if "nccl" not in e.key.lower()) / 1e3
    head = (f"{steps} steps, {wall / max(steps, 1):.1f} ms each (wall); per step: GPU busy with compute "
            f"{compute / max(steps, 1):.1f} ms, NCCL kernels {nccl / max(steps, 1):.1f} ms\n")  # fmt: skip
    try:
        table = events.table(sort_by="self_device_time_total", row_limit=40)
    except (AttributeError, KeyError, ValueError):
        table = events.table(sort_by="self_cuda_time_total", row_limit=40)
    base = Path(args.out).with_suffix("") if args.out else Path("codetta-train")
    base.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{base}.profile.txt").write_text(head + table)
    print("profile: " + head.strip() + f" -> {base}.profile.txt", flush=True)
    return None


def _host_profile(profiler, args):
    """Start cProfile (``profiler`` None), or stop it and write the functions that took the
    host's time, by own time and by cumulative time."""
    import cProfile
    import io
    import pstats

    if profiler is None:
        profiler = cProfile.Profile()
        profiler.enable()
        return profiler
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    for order in ("tottime", "cumulative"):
        text.write(f"== {args.host_profile} steps by {order}\n")
        stats.sort_stats(order).print_stats(40)
    base = Path(args.out).with_suffix("") if args.out else Path("codetta-train")
    base.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{base}.host.txt").write_text(text.getvalue())
    print(f"host profile: {args.host_profile} steps -> {base}.host.txt", flush=True)
    return None


def _save(model, args, rank: int) -> None:
    """The full (unsharded) weights, in float32, under their usual names."""
    if args.parallel == "none":
        state = model.state_dict()
    else:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        state = get_model_state_dict(model, options=options)  # (every rank takes part)
    if rank == 0:
        Path(args.save).parent.mkdir(parents=True, exist_ok=True)
        torch.save({k.removeprefix("module."): v.detach().float().cpu() for k, v in state.items()}, args.save)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="codetta train", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    add_arguments(p)
    train(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
