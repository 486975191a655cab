"""Moving tensors between the model's device and the host engine without stalling the GPU.

The engine computes on host tensors. When the model lives on CUDA, a plain ``t.to("cpu")`` copies into
pageable memory, which the driver does synchronously, and ``torch.cuda.synchronize()`` would wait for
every stream of the device. Instead:

- device -> host: :class:`HostCopy` queues ``non_blocking`` copies into pinned memory from torch's caching
  host allocator (blocks are reused across steps, and the allocator keeps a block alive until the copy
  that uses it has finished) and records an event on the current stream; ``wait`` waits for that event
  only. Work queued on the device after the copies (the block's shared experts, see
  ``moetune.layer.overlap``) runs while the engine computes;
- host -> device: ``to_device`` stages the engine's result in pinned memory and issues a non-blocking
  copy on the current stream; the caller gets the device tensor at once and stream order makes later
  kernels see its data.

With CPU tensors nothing is copied and nothing waits, so the same code path runs in CI (where
``device="cpu"`` stands in for the GPU) and on CUDA.
"""

from __future__ import annotations

import torch


def _pinned_like(t: torch.Tensor) -> torch.Tensor:
    """An uninitialised pinned host tensor with ``t``'s shape and dtype."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True)


class HostCopy:
    """Host copies of tensors that live on one device, queued now and ready after :meth:`wait`."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        self.event: torch.Event | None = None
        if all(t.device.type == "cpu" for t in tensors):
            self.tensors = tensors  # already on the host: no copy, nothing to wait for
            return
        self.tensors = tuple(_pinned_like(t).copy_(t, non_blocking=True) for t in tensors)
        device = tensors[0].device
        self.event = torch.Event(device=device)
        self.event.record(torch.accelerator.current_stream(device))

    def wait(self) -> tuple[torch.Tensor, ...]:
        """The host tensors, once the copies (and the device work queued before them) have finished."""
        if self.event is not None:
            self.event.synchronize()
        return self.tensors


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host copies of ``tensors`` (all on one device), ready to read; CPU tensors come back as they are."""
    return HostCopy(*tensors).wait()


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (a host tensor) on ``device``; for an accelerator the copy is queued, not waited for."""
    if device.type == "cpu":
        return t
    staged = t if t.is_pinned() else _pinned_like(t).copy_(t)
    return staged.to(device, non_blocking=True)
