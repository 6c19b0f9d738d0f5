"""Facts about the device a call runs on, looked up once."""

from __future__ import annotations

import contextlib
import functools

import torch
from triton.runtime.interpreter import InterpretedFunction

from .mainloop import gemm_kernel


def interpreting() -> bool:
    """True when the Triton kernels run through the interpreter (TRITON_INTERPRET=1
    set before codetta was imported)."""
    return isinstance(gemm_kernel, InterpretedFunction)


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


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
