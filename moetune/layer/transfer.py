"""Moving tensors between the model's device and the host engine without stalling the GPU.

The engine computes on host tensors. When the model lives on CUDA, a plain ``t.to("cpu")`` copies into
pageable memory, which the driver does synchronously, and ``torch.cuda.synchronize()`` would wait for
every stream of the device. Instead:

- device -> host: ``to_host`` copies with ``non_blocking=True`` into pinned memory from torch's caching
  host allocator (blocks are reused across steps, and the allocator keeps a block alive until the copy
  that uses it has finished), records an event on the current stream and waits for that event only, so
  kernels queued later on other streams keep running;
- host -> device: ``to_device`` stages the engine's result in pinned memory and issues a non-blocking
  copy on the current stream; the caller gets the device tensor at once and stream order makes later
  kernels see its data.

With CPU tensors both functions return their argument unchanged, so the same code path runs in CI
(where ``device="cpu"`` stands in for the GPU) and on CUDA.
"""

from __future__ import annotations

import torch


def _pinned_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised pinned host tensor with ``t``'s shape and dtype."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host copies of ``tensors`` (all on one device), ready to read when this returns.

    CPU tensors come back as they are. Accelerator tensors are copied asynchronously into pinned memory;
    the wait covers only the work queued on the current stream up to these copies (not the whole device).
    """
    if all(t.device.type == "cpu" for t in tensors):
        return tensors
    out = tuple(_pinned_like(t).copy_(t, non_blocking=True) for t in tensors)
    device = tensors[0].device
    event = torch.Event(device=device)
    event.record(torch.accelerator.current_stream(device))
    event.synchronize()
    return out


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device``; for an accelerator the copy is queued, not waited for."""
    if device.type == "cpu":
        return t
    staged = t if t.is_pinned() else _pinned_like(t).copy_(t)
    return staged.to(device, non_blocking=True)
