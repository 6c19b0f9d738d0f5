"""What every pass of ``linear_cross_entropy`` needs of its options and targets
(``cross_entropy.py``, the chunked path, and ``ce_sliced.py``, the low-memory one): the
options as one tuple, the rows counted and their class weights, each row's gradient
scale and coefficients, each row's loss, and the targets out of range."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..kernels.reductions import two_sum
from ..programs.ce import cap_rows, pick_stored


def scales(valid, denom, reduction: str, grad: torch.Tensor | None):
    """Per-row gradient scale: 0 for ignored rows; 1/denom (mean), 1 (sum), grad[m] (none).
    As PyTorch's: denom (the counted rows' class-weight sum) may be negative; every row
    ignored gives a zero gradient; counted rows whose weights sum to 0 a non-finite one."""
    if reduction == "none":
        return torch.where(valid, grad.float(), 0.0)
    if reduction == "mean":
        return torch.where(valid, 1.0 / denom, 0.0)
    return valid.float()


# fp16's gradients are formed at a power-of-2 gain (``gain``): the largest row's entries
# near this magnitude, not at the mean's 1 / rows
GAIN_TARGET = 16.0


def gain(scale, opts: CEOptions, dtype: torch.dtype, wt: torch.Tensor | None = None):
    """A power of 2 (a 0-dim float32 tensor, on the device: no host sync) that the loss's
    gradients are formed at before the incoming gradient is known, or None (no gain).

    Only for float16: its narrow exponent range makes a mean's gradient (p - onehot) /
    rows subnormal or zero where p is small (at 4000 rows and V 32000, p / rows ~ 1e-8
    is below fp16's smallest subnormal, 6e-8), so forming it at scale 1 and multiplying
    by the incoming gradient after (a GradScaler's 2^16) would lose what PyTorch, which
    multiplies first, keeps. With the gain every entry is at most ~2 x GAIN_TARGET (twice
    the row's bound below, at |lse| 1), dX at most
    ~4 x GAIN_TARGET x max|W|, and the backward divides it out exactly. bf16 has
    float32's exponent range: no gain.

    A row's terms are bounded by |scale| (|w[t]| + eps max|w| + 2 z_loss |lse|) (w: the
    class weights, 1 without; ``wt`` each row's w[target], ``row_weights``; eps: label
    smoothing, whose term alone reads every class's weight); the gain is sized by that
    bound at |lse| 1 (a float16 entry has ~2000x room above GAIN_TARGET). A class no row
    targets does not size it without smoothing, as it does not enter PyTorch's gradient
    (sized by the largest weight of any class, a huge, inf or NaN weight there left every
    gradient at zero or NaN), and z_loss's term, not scaled by the class weight, does."""
    if dtype != torch.float16:
        return None
    if not scale.numel():  # (no rows: nothing is formed; one shape for every M)
        return torch.ones((), dtype=torch.float32, device=scale.device)
    weighted = opts.weight is not None
    bound = wt.abs() if weighted else 1.0
    if opts.smoothing:
        bound = bound + opts.smoothing * (opts.weight.abs().max() if weighted else 1.0)
    bound = bound + 2 * abs(opts.z_loss)
    m = scale.abs()
    m = torch.where(m == 0, 0.0, m * bound).max()  # (an ignored row's 0 x inf is not NaN)
    g = torch.exp2(torch.floor(torch.log2(GAIN_TARGET / m)))  # (m = 0: inf, clamped)
    return g.clamp(2.0**-60, 2.0**60)


class CEOptions(NamedTuple):
    bias: torch.Tensor | None  # [V], input's dtype
    weight: torch.Tensor | None  # [V] class weights, fp32
    smoothing: float
    z_loss: float
    softcap: float  # 0: none
    # [M] float32 or None: the logits are row_scale[m] * (x @ W^T) (CE_LOGITS_SCALED); never
    # with a bias or a softcap (``linear_cross_entropy`` forms x * row_scale for those)
    row_scale: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        return self.bias is None and not self.softcap


def scaled_pick(logits, target, opts: CEOptions, rows=slice(None)):
    """Each row's target logit from a stored chunk (``pick_stored``), times the row's scale
    (``row_scale``'s rows ``rows``: the same float32 product as CE_LOGITS_SCALED's), capped
    as the kernels cap the chunk (``cap_rows``)."""
    picked = pick_stored(logits, target)
    if opts.row_scale is not None:
        picked = picked * opts.row_scale[rows]
    return cap_rows(picked, opts.softcap, logits.dtype)


def row_weights(tc, valid, opts: CEOptions):
    """w[target[m]] for the rows counted (0 for ignored rows), fp32."""
    if opts.weight is None:
        return valid.float()
    return torch.where(valid, opts.weight[tc.clamp(0, opts.weight.shape[0] - 1).long()], 0.0)


class TargetRows(NamedTuple):
    bad: torch.Tensor | None  # rows whose target is outside [0, V) (GPU; the CPU raises)
    valid: torch.Tensor  # rows counted (target != ignore_index)
    wt: torch.Tensor  # w[target] of the counted rows, 0 elsewhere (fp32)
    w_sum: object  # sum of the class weights (V without)


def target_rows(target, V: int, ignore_index: int, opts: CEOptions) -> TargetRows:
    """What every pass needs of the targets (here, not in the wrapper: torch.compile traces it)."""
    bad = bad_targets(target, V, ignore_index)
    valid = target != ignore_index
    w_sum = float(V) if opts.weight is None else opts.weight.sum()
    return TargetRows(bad, valid, row_weights(target, valid, opts), w_sum)


def logits_bias(x, V: int, opts: CEOptions):
    """The bias CE_LOGITS_EXT adds: the caller's, a zero one under soft-capping alone, or
    None (the plain program)."""
    if opts.bias is None and not opts.plain:
        return torch.zeros(V, dtype=x.dtype, device=x.device)
    return opts.bias


def coefs(lse, wc, opts: CEOptions, V: int, w_sum) -> dict:
    """The gradient pass's per-row coefficients a, b (none: a = b = 1); lse: the rows'
    [2, M] (hi, lo) log-sum-exps."""
    eps = opts.smoothing
    if eps or opts.z_loss:
        a = (1 - eps) * wc + eps / V * w_sum + 2 * opts.z_loss * lse[0]
        return dict(a=a, b=(1 - eps) * wc)
    if opts.weight is not None:
        return dict(a=wc, b=wc)
    return {}


def row_loss(lse, picked, wc, sums, opts: CEOptions, V: int, w_sum):
    """Each row's loss from its log-sum-exp (fp32 [2, M], hi + lo), its target's (capped)
    logit and, with label smoothing, sum_n w[n] c[m, n] (the chunked pass's docstring,
    ``cross_entropy.py``). lse - c[t] is formed as (hi - c[t]) + lo: exact where c[t] is
    near hi, as PyTorch's (c[t] - max) - log(sum)."""
    hi, lo = lse[0], lse[1]
    eps = opts.smoothing
    loss = (1 - eps) * wc * ((hi - picked) + lo)
    if opts.z_loss:
        loss = loss + opts.z_loss * hi * hi
    if eps:
        loss = loss + eps / V * ((hi * w_sum - sums) + lo * w_sum)
    return loss


def combine_lse(parts: list) -> torch.Tensor:
    """The log-sum-exp over several column slices of the same rows from each slice's
    [2, M] (hi, lo) pair, as one [2, M] pair (``ce_sliced``): max + log sum exp(lse_s -
    max), each slice's hi - max exact where it matters, lo added after."""
    if len(parts) == 1:
        return parts[0]
    hi, lo = torch.stack(parts).unbind(1)  # [S, M] each
    top = hi.max(0).values
    top = torch.where(top.isfinite(), top, 0.0)
    return torch.stack(two_sum(top, torch.log(torch.exp((hi - top) + lo).sum(0))))


def checks_on_host(device: torch.device) -> bool:  # (a test switches the GPU behaviour on for CPU tensors)
    return device.type != "cuda"


def bad_targets(target, V: int, ignore_index: int):
    """The rows whose target is outside [0, V) and not ``ignore_index``. On the CPU they
    raise, as PyTorch does. On the GPU, looking would stop the host until the GPU got
    there (one synchronization per step, in the middle of it: the host can no longer
    queue work ahead, which FSDP2's overlap of communication relies on), so they are
    returned instead and their losses and gradients become NaN (never a silent wrong
    loss; PyTorch itself stops the process with a device-side assert)."""
    bad = ((target < 0) | (target >= V)) & (target != ignore_index)
    if not checks_on_host(target.device):
        return bad
    if bool(bad.any()):
        raise IndexError(f"target values must be in [0, {V}) or ignore_index={ignore_index}")
    return None
