"""Host staging memory and device-to-host copies: what a checkpoint writer reads from.

On GPU the staging buffers are pinned (page-locked) host memory, so a device-to-host copy is a DMA
that can run on a side stream while the default stream goes on; on CPU they are ordinary memory and
the copy is a ``memcpy`` (which is still what decouples the writer from training tensors that the
next optimizer step changes in place).
"""

from __future__ import annotations

from typing import Sequence

import torch

from tierstack.runtime.distributed import has_gpu


def empty_host_buffer(like: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor of ``like``'s shape and dtype, with storage of its own.

    Pinned when a GPU is in use (``pin_memory`` needs a CUDA context). Its own storage matters:
    megatron-core's torch_dist writer clones any CPU tensor whose storage is larger than the
    tensor, so views into one arena would be copied again at every save.
    """
    return torch.empty(tuple(like.shape), dtype=like.dtype, device="cpu", pin_memory=has_gpu())


def copy_to_host(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i; returns once every copy has landed in ``dst``.

    On GPU the device-to-host copies are queued on a side stream that first waits for the work
    already queued on the current stream (so it copies the values of the finished step), run
    asynchronously into pinned memory, and are synchronised before returning: after this call
    the caller may hand ``dst`` to a writer thread, and training may change ``src`` freely.
    On CPU it is a plain ``copy_`` per tensor.

    Raises:
        ValueError: ``dst`` and ``src`` differ in length.
    """
    if len(dst) != len(src):
        raise ValueError(f"copy_to_host: {len(dst)} buffers for {len(src)} tensors")
    if not has_gpu():
        with torch.no_grad():
            for d, s in zip(dst, src):
                d.copy_(s.detach())
        return
    stream = _side_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.no_grad(), torch.cuda.stream(stream):
        for d, s in zip(dst, src):
            d.copy_(s.detach(), non_blocking=True)
            if s.is_cuda:
                # the caching allocator must not reuse ``s`` for another tensor before this copy ran
                s.record_stream(stream)
    stream.synchronize()


_STREAM = {}


def _side_stream():
    dev = torch.cuda.current_device()
    if dev not in _STREAM:
        _STREAM[dev] = torch.cuda.Stream(device=dev)
    return _STREAM[dev]
