"""Validation of a GEMM call and its program's operands, and the frozen call object
the rest of the launcher works on.

Every check raises a ``TypeError`` (wrong type or dtype) or ``ValueError`` (shape,
device, layout) that names the argument. Operators call these helpers with their
own argument names, so a user reads ``w_o`` rather than an internal name.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .program import Kind, Program, caller_shape

GEMM_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
VECTOR_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_tensor(name: str, t) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def address(name: str, t: torch.Tensor) -> int:
    """``t.data_ptr()``; a tensor without storage of its own (torch.func's wrappers under
    grad, vjp or vmap) refused with a message that says so."""
    try:
        return t.data_ptr()
    except RuntimeError:
        if torch._C._functorch.is_functorch_wrapped_tensor(t):
            raise TypeError(
                f"{name} is a torch.func transform's tensor (grad, vjp, vmap, jacrev): codetta's "
                "kernels read real tensors; differentiate with torch.autograd instead"
            ) from None
        raise


def check_same_device(tensors: dict) -> torch.device:
    """All named tensors on one device (the first one's); returns it."""
    items = [(k, v) for k, v in tensors.items() if isinstance(v, torch.Tensor)]
    first, dev = items[0][0], items[0][1].device
    for k, v in items[1:]:
        if v.device != dev:
            raise ValueError(f"{k} is on {v.device} but {first} is on {dev}: move them to one device")
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"{first}: device {dev} is not supported (cuda, or cpu)")
    return dev


def check_dtype(name: str, t: torch.Tensor, allowed, what: str = "") -> None:
    if t.dtype not in allowed:
        names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
        raise TypeError(f"{name} must be {what or names}, got {t.dtype}")


def check_gemm_dtype(name: str, t: torch.Tensor, on_gpu_too: bool = True) -> None:
    """A GEMM operand: bf16/fp16 (fp32 on CPU, for tests; ``on_gpu_too=False`` leaves the
    GPU's refusal of fp32 to a later call, so a dtype mismatch is reported first)."""
    check_dtype(name, t, GEMM_DTYPES, "bfloat16 or float16 (float32 on CPU only)")
    if on_gpu_too and t.device.type == "cuda" and t.dtype == torch.float32:
        # (under torch.autocast a float32 operand is the usual mistake: autocast casts the
        # inputs of PyTorch's own ops, not of a custom operator's)
        low = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None
        hint = (
            f"; torch.autocast is on but does not cast a custom operator's inputs: pass them in {low}"
            if low in (torch.bfloat16, torch.float16)
            else ""
        )
        raise TypeError(
            f"{name}: float32 GEMMs are not served on the GPU (bfloat16 or float16); use torch.matmul{hint}"
        )


def row_alignment_problem(t: torch.Tensor, lead: int, name: str = "a GEMM operand") -> str | None:
    """Why rows of ``t`` (leading stride ``lead`` elements) cannot be TMA rows, or None."""
    es = t.element_size()
    if (lead * es) % 16:
        return (
            f"rows must start on 16-byte boundaries for TMA: a stride of {lead} {t.dtype} elements is "
            f"{lead * es} bytes; the contiguous dimension must be a multiple of {16 // es}"
        )
    if address(name, t) % 16:
        return "its data must start on a 16-byte boundary (a slice at an odd offset); call .clone()"
    return None


def check_matrix(name: str, t, dims: str) -> bool:
    """Validate a 2-D GEMM operand ``[dims]``; return True if it is a transposed view
    (unit stride in its first dimension)."""
    check_tensor(name, t)
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [{dims}], got shape {tuple(t.shape)}")
    if t.numel() == 0:  # (an empty operand is never read: any strides, e.g. autograd's expanded zeros)
        return False
    if t.shape[1] == 1 and t.shape[0] > 1 and t.stride(0) == 1:
        # one column whose unit stride runs down it (a one-token dW's dz.t(): [N, 1], strides
        # (1, N)): PyTorch calls it contiguous too, but as rows it would be rows of 2 bytes;
        # as a transposed view it is one row of its length, what TMA can read
        transposed = True
    elif t.stride(1) == 1 or t.shape[1] == 1:
        transposed = False
    elif t.stride(0) == 1 or t.shape[0] == 1:
        transposed = True
    else:
        raise ValueError(
            f"{name} must have unit stride in one dimension (contiguous or a transposed view), "
            f"got strides {t.stride()}; call .contiguous() first"
        )
    return transposed


def leading_stride(t: torch.Tensor, transposed: bool) -> int:
    """The stride between the rows a TMA descriptor walks. A single row: its length
    rounded up to 16 bytes (a descriptor over one row never steps to a second, so any
    stride that TMA accepts serves; a one-token logits row of an odd vocabulary is one)."""
    rows, length, stride = (t.shape[1], t.shape[0], t.stride(1)) if transposed else (*t.shape, t.stride(0))
    if rows > 1:
        return stride
    unit = max(1, 16 // t.element_size())
    return -(-length // unit) * unit


def check_matrix_alignment(name: str, t: torch.Tensor, transposed: bool, dims: str) -> None:
    why = row_alignment_problem(t, leading_stride(t, transposed), name)
    if why:
        raise ValueError(f"{name} [{dims}] = {tuple(t.shape)}, strides {t.stride()}: {why}")


def check_operand(program: Program, op, value, device: torch.device, M: int, N: int, weight=None,
                  a=None):  # fmt: skip
    """One caller-passed operand of ``program``; returns it. ``weight``, ``a``: the GEMM's B
    and A (a PairedWeight must match B's shape, dtype and layout, parts their layouts)."""
    where = f"program {program.name!r} operand {op.name!r}"
    if op.kind is Kind.PAIRED_WEIGHT:
        return _check_paired_weight(where, value, weight)
    if op.kind in (Kind.K_PART_A, Kind.K_PART_B):
        return _check_k_part(where, op.kind, value, weight, M, N)
    if op.kind is Kind.N_PART:
        return _check_mn_part(where, value, weight, "weight", "N")
    if op.kind is Kind.M_PART:
        return _check_mn_part(where, value, a, "a", "M")
    if op.kind is Kind.SCALAR:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{where} must be a Python float, got {type(value).__name__}")
        return float(value)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} must be a torch.Tensor {caller_shape(op)}, got {type(value).__name__}")
    if value.device != device:
        raise ValueError(f"{where} is on {value.device}, the GEMM inputs on {device}")
    if op.kind in (Kind.TILE, Kind.SEED):
        want = (M, N)
    elif op.kind in (Kind.PER_ROW, Kind.PER_ROW_INDEX):
        want = (M,)
    elif op.kind is Kind.PER_COL:
        want = (N,)
    else:  # ROW_TABLE
        if value.dim() != 2 or value.shape[1] < 1 or N % value.shape[1]:
            raise ValueError(
                f"{where} must be a [P, W] table whose width W divides N={N}, got {tuple(value.shape)}"
            )
        want = tuple(value.shape)
    if tuple(value.shape) != want:
        raise ValueError(f"{where} must have shape {want} ({caller_shape(op)}), got {tuple(value.shape)}")
    if op.kind is Kind.PER_ROW_INDEX:
        check_dtype(where, value, INDEX_DTYPES)
    elif op.kind in (Kind.TILE, Kind.SEED):
        check_dtype(where, value, GEMM_DTYPES)
    else:
        check_dtype(where, value, VECTOR_DTYPES)
    if op.kind in (Kind.TILE, Kind.SEED):
        check_tile_rows(where, value)
    elif not value.is_contiguous():
        raise ValueError(f"{where} must be contiguous, got strides {value.stride()}")
    return value


def _check_paired_weight(where: str, value, weight: torch.Tensor) -> torch.Tensor:
    transposed = check_matrix(where, value, "N, K")
    if value.device != weight.device:
        raise ValueError(f"{where} is on {value.device}, the GEMM inputs on {weight.device}")
    if value.shape != weight.shape or value.dtype != weight.dtype:
        raise ValueError(
            f"{where} must match weight ({weight.dtype} {tuple(weight.shape)}), "
            f"got {value.dtype} {tuple(value.shape)}"
        )
    if transposed != check_matrix("weight", weight, "N, K"):
        raise ValueError(
            f"{where} must be laid out as weight (both contiguous or both transposed views), "
            f"got strides {value.stride()} and {weight.stride()}"
        )
    check_matrix_alignment(where, value, transposed, "N, K")
    return value


def _check_k_part(where: str, kind, value, weight: torch.Tensor, M: int, N: int) -> torch.Tensor:
    """A K part's A ([M, K_i], laid out as a) or weight ([N, K_i], laid out as weight)."""
    is_a = kind is Kind.K_PART_A
    dims = "M, K_i" if is_a else "N, K_i"
    transposed = check_matrix(where, value, dims)
    if value.device != weight.device:
        raise ValueError(f"{where} is on {value.device}, the GEMM inputs on {weight.device}")
    if value.dtype != weight.dtype:
        raise TypeError(f"{where} must be {weight.dtype} (the GEMM's dtype), got {value.dtype}")
    if value.shape[0] != (M if is_a else N) or value.shape[1] == 0:
        raise ValueError(f"{where} must be [{dims}] with {'M' if is_a else 'N'}={M if is_a else N} and "
                         f"K_i >= 1, got {tuple(value.shape)}")  # fmt: skip
    if value.numel():
        check_matrix_alignment(where, value, transposed, dims)
    return value


def _check_mn_part(where: str, value, ref: torch.Tensor, ref_name: str, rows: str) -> torch.Tensor:
    """A further weight along N ([N_i, K], ``ref`` the weight) or A along M ([M_i, K],
    ``ref`` a): the reference's K, dtype, device and layout."""
    dims = f"{rows}_i, K"
    transposed = check_matrix(where, value, dims)
    if value.device != ref.device:
        raise ValueError(f"{where} is on {value.device}, the GEMM inputs on {ref.device}")
    if value.dtype != ref.dtype:
        raise TypeError(f"{where} must be {ref.dtype} (the GEMM's dtype), got {value.dtype}")
    if value.shape[1] != ref.shape[1] or value.shape[0] == 0:
        raise ValueError(
            f"{where} must be [{dims}] with K={ref.shape[1]} and {rows}_i >= 1, got {tuple(value.shape)}"
        )
    if transposed != check_matrix(ref_name, ref, f"{rows}, K"):
        raise ValueError(f"{where} must be laid out as {ref_name} (both contiguous or both transposed "
                         f"views), got strides {value.stride()} and {ref.stride()}")  # fmt: skip
    check_matrix_alignment(where, value, transposed, dims)
    return value


def check_tile_rows(where: str, t: torch.Tensor) -> None:
    """A tile operand or output: unit stride along its rows, rows that TMA can address."""
    if t.stride(1) != 1 and t.shape[1] > 1:
        raise ValueError(f"{where} must be row-contiguous, got strides {t.stride()}")
    why = row_alignment_problem(t, leading_stride(t, False), where)
    if why:
        raise ValueError(f"{where} {list(t.shape)}: {why}")


def output_shape(op, M: int, N: int, dtype: torch.dtype, dims: tuple | None = None) -> tuple:
    """(shape, dtype) of an output of a GEMM [M, N] in ``dtype``; ``dims``: the (rows,
    columns) a tile output (or its part) holds when the GEMM has M or N parts."""
    if op.kind in (Kind.TILE, Kind.TILE_PART):
        return ((M, N) if dims is None else tuple(dims)), op.dtype or dtype
    if op.kind is Kind.HALF_TILE:
        return (M, N // 2), op.dtype or dtype
    if op.kind is Kind.ROW_LSE and op.split:
        return (2, M), torch.float32
    return ((N,) if op.kind is Kind.COL_SUM else (M,)), torch.float32


@dataclass(frozen=True, eq=False)
class GemmCall:
    """A validated call: ``program(a @ w.T)``, its inputs in the program's caller order."""

    program: Program
    a: torch.Tensor
    w: torch.Tensor
    a_t: bool
    b_t: bool
    inputs: tuple

    @property
    def M(self) -> int:  # noqa: N802
        """The output's rows: a's, and every M part's after them."""
        return sum(self.heights)

    @functools.cached_property
    def heights(self) -> tuple:
        """The output rows of a and of each M part (one entry without parts)."""
        return (self.a.shape[0], *(self.inputs[i].shape[0] for i in self.program.m_parts))

    @property
    def N(self) -> int:  # noqa: N802
        """The output's columns: the weight's rows, and every N part's after them."""
        return sum(self.widths)

    @functools.cached_property
    def widths(self) -> tuple:
        """The output columns of the weight and of each N part (one entry without parts)."""
        return (self.w.shape[0], *(self.inputs[i].shape[0] for i in self.program.n_parts))

    def out_dims(self, op) -> tuple | None:
        """(rows, columns) of a tile output (or its part) under M or N parts; None without."""
        i = self.program.part_number.get(op.name, 0)
        if len(self.widths) > 1:
            return self.M, self.widths[i]
        if len(self.heights) > 1:
            return self.heights[i], self.N
        return None

    @property
    def K(self) -> int:  # noqa: N802
        return self.a.shape[1]

    @property
    def k_total(self) -> int:
        """K summed over the products (the first one's and every K part's)."""
        return self.K + sum(self.inputs[a].shape[1] for a, _ in self.program.k_parts)

    @property
    def dtype(self) -> torch.dtype:
        return self.a.dtype

    @property
    def device(self) -> torch.device:
        return self.a.device

    @functools.cached_property
    def in_kinds(self) -> tuple:
        """The program's input codes with each RowTable's width filled in."""
        tables = {op.name: v.shape[1] for op, v in zip(self.program.caller_inputs, self.inputs)
                  if op.kind is Kind.ROW_TABLE}  # fmt: skip
        return tuple(
            (k, s, i, tables[op.name] if op.kind is Kind.ROW_TABLE else 0)
            for op, (k, s, i, _) in zip(self.program.inputs, self.program.in_kinds)
        )


def make_call(program: Program, a, weight, operands: dict, provided: tuple = ()) -> GemmCall:
    """Validate ``gemm(a, weight, program, **operands)``; return the call. ``provided``:
    per output, whether the caller gives its tensor (``gemm(out=...)``: then its row
    stride, checked by ``check_outputs``, is what TMA needs, not N)."""
    if not isinstance(program, Program):
        raise TypeError(f"epilogue must be a codetta Program, got {type(program).__name__}")
    a_t = check_matrix("a", a, "M, K")
    b_t = check_matrix("weight", weight, "N, K")
    device = check_same_device({"a": a, "weight": weight})
    check_gemm_dtype("a", a, on_gpu_too=False)
    check_gemm_dtype("weight", weight, on_gpu_too=False)
    if a.dtype != weight.dtype:
        raise TypeError(f"a and weight must share a dtype, got {a.dtype} and {weight.dtype}")
    check_gemm_dtype("a", a)
    M, K = a.shape
    N, K2 = weight.shape
    parts = [operands.get(op.name) for op in program.caller_inputs if op.kind is Kind.N_PART]
    widths = (N, *(t.shape[0] for t in parts if isinstance(t, torch.Tensor)))
    N = sum(widths)
    parts = [operands.get(op.name) for op in program.caller_inputs if op.kind is Kind.M_PART]
    M += sum(t.shape[0] for t in parts if isinstance(t, torch.Tensor))
    if K != K2:
        raise ValueError(f"a is [M={M}, K={K}] but weight is [N={N}, K={K2}]: K must match")
    if N == 0:
        raise ValueError(f"N must be >= 1, got N={N}")
    if a.numel():  # (K = 0: the program runs on a zero accumulator, launch.gemm; M = 0: nothing runs)
        check_matrix_alignment("a", a, a_t, "M, K")
    if weight.numel():
        check_matrix_alignment("weight", weight, b_t, "N, K")
    if program.check is not None:
        program.check(M, N)
    for n in widths if len(widths) > 1 else (N,):
        if program.sub_tile_width and n % program.sub_tile_width:
            raise ValueError(
                f"program {program.name!r} works on groups of {program.sub_tile_width} columns: "
                f"N={n} must be a multiple of {program.sub_tile_width}"
            )
    for i, op in enumerate(program.outputs):
        if not (op.is_tile or op.kind is Kind.TILE_PART) or (i < len(provided) and provided[i]):
            continue
        half = op.kind is Kind.HALF_TILE
        unit = (2 if half else 1) * 16 // (op.dtype or a.dtype).itemsize
        n = widths[program.part_number[op.name]] if len(widths) > 1 else N
        if n % unit:
            raise ValueError(
                f"program {program.name!r}: output {op.name!r} has rows of {n // 2 if half else n} elements, "
                f"which TMA cannot store (rows move in 16-byte units): N={n} must be a multiple of {unit}"
            )
    names = {op.name for op in program.caller_inputs}
    unknown = set(operands) - names
    if unknown:
        raise TypeError(
            f"program {program.name!r} takes no operand(s) {sorted(unknown)}; it takes {sorted(names)}"
        )
    missing = [op.name for op in program.caller_inputs if op.name not in operands]
    if missing:
        raise TypeError(f"program {program.name!r} needs operand(s) {missing}")
    inputs = tuple(
        check_operand(program, op, operands[op.name], device, M, N, weight, a) for op in program.caller_inputs
    )
    for ia, iw in program.k_parts:  # (the caller inputs come first among the slots)
        pa, pw = inputs[ia], inputs[iw]
        na, nw = program.slots[ia].name, program.slots[iw].name
        if pa.shape[1] != pw.shape[1]:
            raise ValueError(f"program {program.name!r}: {na} is {tuple(pa.shape)} and {nw} is "
                             f"{tuple(pw.shape)}: their K must match")  # fmt: skip
        if check_matrix(na, pa, "M, K_i") != a_t or check_matrix(nw, pw, "N, K_i") != b_t:
            raise ValueError(f"program {program.name!r}: {na} must be laid out as a and {nw} as weight "
                             "(each contiguous or each a transposed view, as those are)")  # fmt: skip
    return GemmCall(program, a, weight, a_t, b_t, inputs)


def check_outputs(program: Program, out, call: GemmCall) -> tuple | None:
    """``gemm(..., out=...)``: a tensor (a one-output program) or one entry per output
    (None: allocate it); each the shape, dtype and device the output has, tile outputs
    row-contiguous with 16-byte-aligned rows (any row stride), vectors contiguous.
    Returns the entries as a tuple, or None."""
    if out is None:
        return None
    n = len(program.outputs)
    if isinstance(out, torch.Tensor):
        out = (out,)
    if not isinstance(out, (tuple, list)) or len(out) != n:
        raise TypeError(
            f"out must be a tensor (a one-output program) or a sequence of {n} (one per output of "
            f"program {program.name!r}, None to allocate), got {type(out).__name__}"
        )
    M, N = call.M, call.N
    for op, t in zip(program.outputs, out):
        if t is None:
            continue
        where = f"out[{op.name!r}]"
        check_tensor(where, t)
        if t.device != call.device:
            raise ValueError(f"{where} is on {t.device}, the GEMM inputs on {call.device}")
        shape, dtype = output_shape(op, M, N, call.dtype, call.out_dims(op))
        if tuple(t.shape) != shape or t.dtype != dtype:
            raise ValueError(f"{where} must be {dtype} of shape {shape}, got {t.dtype} {tuple(t.shape)}")
        if op.is_tile or op.kind is Kind.TILE_PART:
            check_tile_rows(where, t)
        elif not t.is_contiguous():
            raise ValueError(f"{where} must be contiguous")
    return tuple(out)
