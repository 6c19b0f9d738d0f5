"""Tensors kept past the call that made them (module-level caches), made where no CUDA
graph's memory pool claims them.

torch.compile's CUDA graph trees (``mode="reduce-overhead"``) route every allocation of
the current thread to their graph pool while they warm a graph up, and then reject any
live allocation in the pool that is not one of the graph's outputs ("Detected 1
tensor(s) in the cudagraph pool not tracked as outputs"). A buffer that a cache keeps
(the tail split's arrival counters, RoPE's frequency tables) made there would be one, so
``made_outside_pools`` makes it in a helper thread (whose allocations go to the ordinary
caching allocator, on its own default stream) and waits for it. Inside a stream capture
nothing is made outside the graph and nothing may wait: there the buffer is made in line
and must not be cached (its contents exist only when the graph replays).
"""

from __future__ import annotations

import threading

import torch


def capturing(device: torch.device) -> bool:
    """Whether the current CUDA stream is capturing a graph, for tensors on ``device``
    (never for a CPU device)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def made_outside_pools(make, device: torch.device):
    """``make()`` (it returns a tensor, or a tuple of tensors, on ``device``) run so that
    what it allocates lives in the ordinary caching allocator, finished before this
    returns. The helper thread's stream first waits for the caller's (``make`` may read
    what the caller's stream has just written), and the results are marked as used by the
    caller's stream (``record_stream``: freed later, their memory is not reused before that
    stream's work on them is done). CPU devices: in line. Not to be called while capturing
    (``capturing(device)``)."""
    if device.type != "cuda":
        return make()
    caller = torch.cuda.current_stream(device)
    ready = torch.cuda.Event()
    ready.record(caller)
    box: list = []

    def run():
        try:
            with torch.cuda.device(device):
                own = torch.cuda.current_stream(device)
                own.wait_event(ready)
                box.append(make())
                own.synchronize()
        except BaseException as exc:  # noqa: BLE001 - raised again in the caller's thread
            box.append(exc)

    thread = threading.Thread(target=run, name="codetta-persistent", daemon=True)
    thread.start()
    thread.join()
    if isinstance(box[0], BaseException):
        raise box[0]
    out = box[0]
    for t in out if isinstance(out, (tuple, list)) else (out,):
        if isinstance(t, torch.Tensor) and t.device.type == "cuda":
            t.record_stream(caller)
    return out


def kept(cache: dict, key, make, device: torch.device):
    """``cache[key]``, made by ``make()`` outside any CUDA graph pool on a miss; inside a
    stream capture a miss is made in line for that graph alone and not kept."""
    value = cache.get(key)
    if value is None:
        if capturing(device):
            return make()
        value = cache[key] = made_outside_pools(make, device)
    return value
