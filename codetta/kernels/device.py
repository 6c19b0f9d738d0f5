"""Facts about the device a call runs on, looked up once."""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import triton
from triton.runtime.jit import JITFunction

from .mainloop import gemm_kernel
from .settings import SETTINGS

# decided once, when the kernels were decorated: TRITON_INTERPRET=1 at import makes
# them interpreted functions (no JITFunction; its module needs numpy, so it is not
# imported here: codetta itself runs without numpy)
_INTERPRETING = not isinstance(gemm_kernel, JITFunction)


# the Triton minor version the kernels are written and tested for (pyproject pins it)
TRITON_SERIES = (3, 6)


def triton_mismatch(version: str) -> str | None:
    """Why Triton ``version`` may not run codetta's kernels (None: the tested series)."""
    try:
        if tuple(int(x) for x in version.split(".")[:2]) == TRITON_SERIES:
            return None
    except ValueError:
        pass
    series = ".".join(map(str, TRITON_SERIES))
    where = (
        f"PyTorch 2.10 and 2.11 ship with Triton {series}; PyTorch 2.12 pins Triton 3.7 and 2.14 Triton 3.8 "
        "(docs/install.md)"
    )
    if version.split(".")[:2] in (["3", "7"], ["3", "8"]):
        return (
            f"codetta's kernels are tuned and GPU-tested with Triton {series}.x, and this is Triton "
            f"{version}: under it they compile for sm_90a and pass the CPU suite, but no GPU run has tested "
            f"them, and the shipped tuned tables (Triton {series}'s) are not read, so each GEMM shape takes "
            "the default rule's config unless `python -m codetta tune` tunes it. " + where
        )
    return (
        f"codetta's kernels are written and tested for Triton {series}.x, and this is Triton {version} "
        "(the Gluon ping-pong mainloop uses APIs that change between minor versions): they may fail to "
        "compile or run. " + where
    )


if (_why := triton_mismatch(triton.__version__)) is not None:
    warnings.warn(_why, stacklevel=2)


def interpreting() -> bool:
    """True when the Triton kernels run through the interpreter (TRITON_INTERPRET=1
    set before codetta was imported)."""
    return _INTERPRETING


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_margin() -> int:
    return SETTINGS.sm_margin


def grid_sms(device_index: int) -> int:
    """The SMs a persistent launch spreads its tiles over: all but ``sm_margin()`` (left
    free for kernels on other streams). Under FSDP2 on two H200s leaving 16 or 32 SMs to
    NCCL made the step slower, not faster (run 42, NOTES.md): the default is 0."""
    return max(1, num_sms(device_index) - sm_margin())


@functools.cache
def capability(device_index: int) -> tuple:
    return torch.cuda.get_device_capability(device_index)


@functools.cache
def name(device_index: int) -> str:
    return torch.cuda.get_device_name(device_index)


def on_device(device: torch.device):
    """Triton launches on the current CUDA device: make it the tensors' device."""
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device.index)
    return contextlib.nullcontext()
