"""Environment switches, read once at import, and the public hooks that change them.
An on/off switch (default 0 or 1 below) takes 0 / 1, or false / true, off / on, no / yes
in any case; unset or empty keeps its default; any other value is refused at import with
the variable's name.

| variable | default | meaning |
|---|---|---|
| ``CODETTA_AUTOTUNE`` | 0 | 1: tune a shape on the hot path when first met, if neither the user's |
|  |  | tuning cache nor the shipped table knows it (seconds per shape); 0: the |
|  |  | nearest known entry or a rule picks (``tuning.Chooser``) |
| ``CODETTA_TUNE_SECONDS`` | 1.0 | paired timing per shape when ``CODETTA_AUTOTUNE=1`` tunes one |
| ``CODETTA_TUNE_METHOD`` | paired | how tuning times its candidates: ``paired`` (call by call, side |
|  |  | by side: the cycles a config takes) or ``sustained`` (each candidate in settled |
|  |  | blocks of its own: its time at the clock its own power draw sets, NOTES.md) |
|  |  | or ``both`` (the candidate whose worse ratio to the best of each method is least) |
| ``CODETTA_SHIPPED`` | 1 | 0: ignore the tuned table shipped with codetta (``kernels/tuned/``) |
| ``CODETTA_PINGPONG`` | 1 | 0: leave the sm_90 ping-pong mainloop out of the choice |
| ``CODETTA_PINGPONG_POLICY`` | all | ``epilogue-bound``: the ping-pong mainloop a candidate only |
|  |  | where its epilogue overlap pays (``tuning.pingpong_pays``), the portable mainloop |
|  |  | elsewhere (it draws less power, NOTES.md); ``all``: wherever it can run |
| ``CODETTA_TAIL_SPLIT`` | 1 | 0: never split a partial last wave along K |
| ``CODETTA_TAIL_LAUNCH`` | 0 | 1: a last partial wave split along K in a launch of its own: the |
|  |  | ping-pong mainloop's candidates include a tail split (run on the portable |
|  |  | mainloop), and a portable config's tail too large to split within its launch is |
|  |  | split so (GPU-tested, run 101; opt-in: NOTES.md) |
| ``CODETTA_TUNE_VERBOSE`` | 0 | 1: print every candidate's time while tuning |
| ``CODETTA_SM_MARGIN`` | 0 | SMs a persistent GEMM leaves free for kernels on other streams |
|  |  | (NCCL's collectives; under FSDP2 on two GPUs 8, with ``NCCL_MAX_NCHANNELS=8``, |
|  |  | was steadier but level with the default, NOTES.md) |
| ``CODETTA_CE_CHUNK_MB`` | 1024 | MiB of logits per row chunk of ``linear_cross_entropy`` (larger: |
|  |  | fewer fp32 read-modify-writes of the head's weight gradient; NOTES.md) |
| ``CODETTA_CE_VOCAB_CHUNK`` | 0 | > 0: ``linear_cross_entropy``'s low-memory mode by default (its |
|  |  | ``vocab_chunk``: classes per vocabulary slice, a multiple of 8), the |
|  |  | Hugging Face drop-in's loss included |
| ``CODETTA_QKV_ONE_LAUNCH`` | 0 | 1: a norm's q, k and v projections with RoPE (no per-head q/k |
|  |  | norm, attention scaling 1) as one GEMM over the three weights (N parts: |
|  |  | each output its own tensor), and the three weight gradients of any |
|  |  | three next weights as one (M parts); GPU-tested, not faster (NOTES.md) |
| ``CODETTA_SWIGLU_KEEP_Y`` | auto | 0: a SwiGLU MLP keeps g and u for its backward, not y = silu(g) * u |
|  |  | too: the down projection's dX epilogue forms y again from the stored g and u |
|  |  | (``DSWIGLU_Y``) for its weight gradient; one [M, f] activation less per layer |
|  |  | (a third of the MLP's), an [M, f] write more in the backward. 1: y kept. auto: |
|  |  | y formed again at model widths d >= 4096, where it costs no time (runs 112, |
|  |  | 116: the 8B-width slice's step 0.994-1.006x, its peak 10.8 -> 9.5 GB), kept |
|  |  | below (Llama-3.2-1B: peak 18.7 -> 15.0 GB for +0.9-1.3 % of step time) |
| ``CODETTA_OVERWRITE_SAVED`` | 1 | 0: a SwiGLU's backward writes dg and du into new tensors instead |
|  |  | of over the saved g and u (``swiglu_mlp``, and an internal SwiGLU: the drop-in's), |
|  |  | two [M, f] tensors more at its peak (the switch for an A/B; run 107: 0.7 % slower) |
| ``CODETTA_TIED_GRAD`` | 1 | 0: with tied embeddings, the Hugging Face drop-in's LM head returns |
|  |  | its weight gradient itself and the embedding's backward its own (PyTorch sums |
|  |  | them), instead of one pass forming both (``ops/tied_embedding.py``; the switch |
|  |  | for an A/B) |
| ``CODETTA_CE_FINISH`` | 1 | 0: the LM head + loss keeps dW in float32 until its backward scales and |
|  |  | casts it (one more pass over a float32 [V, d]: 0.73 ms at V 128256, d 4096, run |
|  |  | 129), instead of its last row chunk's GEMM rounding it into the weight's dtype in |
|  |  | the forward (``FINISH_F32``); 1 GB less at the peak of the untied 8B slice (9.53 |
|  |  | against 10.50 GB, below Liger's 10.16) for 0.2-0.4 % of its step (run 139) |
| ``CODETTA_CE_DX_F32`` | 0 | 1: the LM head + loss keeps dX in float32 from its forward to its |
|  |  | backward's scale by the incoming gradient (one rounding, as dB), instead of |
|  |  | rounding it in the forward and again after the scale (an incoming gradient not a |
|  |  | power of 2: dX 1.2x PyTorch's error at the median with a softcap, NOTES.md); |
|  |  | M x d x 2 bytes more until the backward; opt-in: 0.2-2.1 % of the loss's |
|  |  | time on the H200 (run 193) |
| ``CODETTA_CE_NORM_FACTORS`` | 1 | 0: the Hugging Face drop-in's final RMSNorm forms its output n for |
|  |  | the loss, instead of handing h and rstd on (``row_scale``: the logits GEMM's |
|  |  | epilogue applies rstd, one pass over [M, d] less each way; NOTES.md) |
| ``CODETTA_CE_PROBS`` | 0 | 1 (experimental; on an H200's bench ce, run 237, geomean 1.4 % faster |
|  |  | than the default paired, 2.4 % sustained; a tie in an H100's model step, |
|  |  | run 240): the |
|  |  | plain LM head + loss in bf16 or float32 stores q = exp(l - ref) for a |
|  |  | per-row reference instead of its logits, so no gradient pass runs over the |
|  |  | chunk (``CE_PROBS``; ``ops/cross_entropy.py``; NOTES.md, "A lead for the loss") |
| ``CODETTA_EMBED_GRAD`` | 1 | 0: an untied embedding in the Hugging Face drop-in is the model's own |
|  |  | ``nn.Embedding`` (PyTorch's backward) instead of ``codetta.ops.embedding`` (its |
|  |  | weight gradient in one pass over the table; the switch for an A/B) |
| ``CODETTA_AUTOCAST`` | cast | what the Hugging Face drop-in does under ``torch.autocast`` to |
|  |  | another dtype than the parameters' (AMP over float32 parameters: Hugging Face |
|  |  | Trainer's ``bf16=True``): ``cast`` runs the fused path on the projections' weights |
|  |  | cast to autocast's dtype for the forward (as autocast casts them; gradients reach |
|  |  | the float32 parameters) over a float32 residual stream, as autocast keeps it (its |
|  |  | loss and gradients within 2x autocast's own error against float64: NOTES.md); |
|  |  | ``own-forward`` runs the model's own forward (autocast itself, no codetta; warns once) |
| ``CODETTA_COMPILE_WORKERS`` | 0 | child processes compiling kernels at once (``precompile``, the |
|  |  | tuner; ``compile_pool.py``): 0, one per CPU core; 1, none (every compile in |
|  |  | this process, one by one: for hosts where forking is unsafe, e.g. RDMA |
|  |  | memory registered without fork support) |
| ``CODETTA_DIRECT_LAUNCH`` | 1 | 0: every kernel launch through Triton's own ``kernel[grid](...)`` |
|  |  | path; 1: a launch whose signature was seen before hands the compiled kernel |
|  |  | its arguments directly (``direct.py``: less host time a launch, NOTES.md) |
| ``CODETTA_CACHE_DIR`` | ``$XDG_CACHE_HOME/codetta`` | where the tuning cache lives |

Tests and benchmarks change them through :func:`override`, never by setting
the environment after import or by patching module globals.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path


@dataclasses.dataclass
class Settings:
    autotune: bool = False
    tune_seconds: float = 1.0
    tune_method: str = "paired"
    shipped: bool = True
    pingpong: bool = True
    # "all": the ping-pong mainloop is a candidate wherever it can run; "epilogue-bound":
    # only where its epilogue overlap pays (tuning.pingpong_pays), the portable mainloop
    # elsewhere (it draws less power, so the whole step runs at a higher clock, NOTES.md)
    pingpong_policy: str = "all"
    tail_split: bool = True
    tail_launch: bool = False
    tune_verbose: bool = False
    sm_margin: int = 0
    ce_chunk_mb: int = 1024
    ce_vocab_chunk: int = 0
    qkv_one_launch: bool = False
    # False: a SwiGLU MLP's backward forms y again from g and u (DSWIGLU_Y) instead of
    # keeping it from the forward
    swiglu_keep_y: bool | None = None  # None: auto (``keeps_y``)
    # False: SwiGLU backwards write dg, du into new tensors, not over the saved g, u
    overwrite_saved: bool = True
    # False: a tied embedding's two gradients formed apart (ops/tied_embedding.py)
    tied_grad: bool = True
    # False: an untied embedding's backward is PyTorch's (ops/tied_embedding.py: embedding)
    embed_grad: bool = True
    # False: the loss's dW stays float32 until the backward (ops/cross_entropy.py: _finishes)
    ce_finish: bool = True
    # True: the loss's dX stays float32 until the backward's scale (ops/cross_entropy.py)
    ce_dx_f32: bool = False
    ce_probs: bool = False
    # False: the drop-in's final norm forms its output n for the loss, instead of handing
    # on h and rstd (ops/residual_rmsnorm.py: residual_rmsnorm_factors; integrations/hf.py)
    ce_norm_factors: bool = True
    # under torch.autocast to another dtype than the parameters': "own-forward" or "cast"
    # (integrations/hf.py)
    autocast: str = "cast"
    compile_workers: int = 0
    direct_launch: bool = True
    cache_dir: Path = Path("~/.cache/codetta")
    # test hooks: fill every output with NaN before a launch (an unwritten element
    # cannot pass); run CPU calls through the PyTorch references even where the
    # Triton interpreter is on
    poison_outputs: bool = False
    force_reference: bool = False
    # untuned choices (autotune off) take the ping-pong mainloop's first candidate
    # where it can run, instead of the portable mainloop's
    prefer_pingpong: bool = False
    # an id of the other fields' values, restamped by every override (entry and exit):
    # caches of per-call decisions key on it, so switching back to earlier settings (A/B
    # benchmark variants taking turns) finds their entries again
    generation: int = dataclasses.field(default=0, repr=False, compare=False)

    @classmethod
    def from_env(cls, env=os.environ) -> Settings:
        def flag(name: str, default: bool) -> bool:
            return _flag(name, env.get(name, ""), default)

        cache = env.get("CODETTA_CACHE_DIR") or os.path.join(
            env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "codetta"
        )
        return cls(
            autotune=flag("CODETTA_AUTOTUNE", False),
            tune_seconds=_positive("CODETTA_TUNE_SECONDS", env.get("CODETTA_TUNE_SECONDS", "1.0")),
            tune_method=_choice(
                "CODETTA_TUNE_METHOD", env.get("CODETTA_TUNE_METHOD", "paired"), TUNE_METHODS
            ),
            shipped=flag("CODETTA_SHIPPED", True),
            pingpong=flag("CODETTA_PINGPONG", True),
            pingpong_policy=_choice(
                "CODETTA_PINGPONG_POLICY", env.get("CODETTA_PINGPONG_POLICY", "all"), PINGPONG_POLICIES
            ),  # fmt: skip
            tail_split=flag("CODETTA_TAIL_SPLIT", True),
            tail_launch=flag("CODETTA_TAIL_LAUNCH", False),
            tune_verbose=flag("CODETTA_TUNE_VERBOSE", False),
            sm_margin=_whole("CODETTA_SM_MARGIN", env.get("CODETTA_SM_MARGIN", "0")),
            ce_chunk_mb=_whole("CODETTA_CE_CHUNK_MB", env.get("CODETTA_CE_CHUNK_MB", "1024"), least=1),
            ce_vocab_chunk=_whole(
                "CODETTA_CE_VOCAB_CHUNK", env.get("CODETTA_CE_VOCAB_CHUNK", "0"), multiple=8
            ),  # fmt: skip
            qkv_one_launch=flag("CODETTA_QKV_ONE_LAUNCH", False),
            swiglu_keep_y=_auto_flag("CODETTA_SWIGLU_KEEP_Y", env.get("CODETTA_SWIGLU_KEEP_Y", "auto")),
            overwrite_saved=flag("CODETTA_OVERWRITE_SAVED", True),
            tied_grad=flag("CODETTA_TIED_GRAD", True),
            embed_grad=flag("CODETTA_EMBED_GRAD", True),
            ce_finish=flag("CODETTA_CE_FINISH", True),
            ce_dx_f32=flag("CODETTA_CE_DX_F32", False),
            ce_probs=flag("CODETTA_CE_PROBS", False),
            ce_norm_factors=flag("CODETTA_CE_NORM_FACTORS", True),
            autocast=_choice("CODETTA_AUTOCAST", env.get("CODETTA_AUTOCAST", "cast"), AUTOCAST_MODES),
            compile_workers=_whole("CODETTA_COMPILE_WORKERS", env.get("CODETTA_COMPILE_WORKERS", "0")),
            direct_launch=flag("CODETTA_DIRECT_LAUNCH", True),
            cache_dir=Path(cache),
        )

    def keeps_y(self, d: int) -> bool:
        """Whether a SwiGLU MLP of model width d keeps y for its backward
        (``CODETTA_SWIGLU_KEEP_Y``; auto: below ``KEEP_Y_BELOW``)."""
        return self.swiglu_keep_y if self.swiglu_keep_y is not None else d < KEEP_Y_BELOW


# auto: y formed again in the backward from this model width up (its extra [M, f] write
# shrinks against the GEMMs' M f d work as d grows; NOTES.md, runs 112 and 116)
KEEP_Y_BELOW = 4096
PINGPONG_POLICIES = ("all", "epilogue-bound")
AUTOCAST_MODES = ("own-forward", "cast")
TUNE_METHODS = ("paired", "sustained", "both")
# the settings that take one of a few words (checked by ``override`` as at import)
_CHOICES = {"tune_method": TUNE_METHODS, "pingpong_policy": PINGPONG_POLICIES, "autocast": AUTOCAST_MODES}


_ON, _OFF = ("1", "true", "on", "yes"), ("0", "false", "off", "no")


def _flag(name: str, value: str, default: bool | None, words: str = "0 or 1") -> bool | None:
    """An on/off switch: 1 / true / on / yes or 0 / false / off / no (any case); unset or
    empty: the default. Anything else is an error, never read as on (``false`` once was)."""
    word = value.strip().lower()
    if not word:
        return default
    if word not in _ON + _OFF:
        raise ValueError(f"{name} must be {words} (or false / true, off / on, no / yes), got {value!r}")
    return word in _ON


def _auto_flag(name: str, value: str) -> bool | None:
    """``_flag`` with ``auto`` (or empty) for None."""
    return None if value.strip().lower() == "auto" else _flag(name, value, None, "0, 1 or auto")


def _choice(name: str, value: str, choices: tuple) -> str:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _positive(name: str, value: str) -> float:
    try:
        number = float(value)
    except ValueError:
        number = -1.0
    if not number > 0 or number == float("inf"):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    return number


def _whole(name: str, value: str, least: int = 0, multiple: int = 1) -> int:
    try:
        number = int(value)
    except ValueError:
        number = least - 1
    if number < least:
        raise ValueError(f"{name} must be a whole number >= {least}, got {value!r}")
    if number % multiple:
        raise ValueError(f"{name} must be a multiple of {multiple}, got {value!r}")
    return number


_STATES: dict = {}


def _restamp() -> None:
    state = tuple(getattr(SETTINGS, f.name) for f in dataclasses.fields(Settings) if f.name != "generation")
    SETTINGS.generation = _STATES.setdefault(state, len(_STATES))


SETTINGS = Settings.from_env()
_restamp()


@contextlib.contextmanager
def override(**changes):
    """Change settings inside a ``with`` block (tests, A/B benchmark variants)."""
    unknown = set(changes) - ({f.name for f in dataclasses.fields(Settings)} - {"generation"})
    if unknown:
        raise TypeError(f"unknown codetta settings: {sorted(unknown)}")
    for k, v in changes.items():
        if k in _CHOICES:
            _choice(k, v, _CHOICES[k])
    old = {k: getattr(SETTINGS, k) for k in changes}
    for k, v in changes.items():
        setattr(SETTINGS, k, v)
    _restamp()
    try:
        yield SETTINGS
    finally:
        for k, v in old.items():
            setattr(SETTINGS, k, v)
        _restamp()
