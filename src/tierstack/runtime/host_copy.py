"""Host staging memory and device-to-host copies: what a checkpoint writer reads from.

On GPU the staging buffers are pinned (page-locked) host memory, so a device-to-host copy is a DMA
that can run on a side stream while the default stream goes on; on CPU they are ordinary memory and
the copy is a ``memcpy`` (which is still what decouples the writer from training tensors that the
next optimizer step changes in place).
"""

from __future__ import annotations

import os
import weakref
from typing import Sequence

import numpy
import torch

from tierstack.runtime.distributed import has_gpu


def empty_host_buffer(like: torch.Tensor) -> torch.Tensor:
    """A contiguous host tensor of ``like``'s shape and dtype, with storage of its own.

    Pinned when a GPU is in use (``pin_memory`` needs a CUDA context). Its own storage matters:
    megatron-core's torch_dist writer clones any CPU tensor whose storage is larger than the
    tensor, so views into one arena would be copied again at every save.
    """
    return torch.empty(tuple(like.shape), dtype=like.dtype, device="cpu", pin_memory=has_gpu())


ALIGN_BYTES = 64  # each buffer of a region starts on a cache-line (and DMA-friendly) boundary


def region_layout(likes: Sequence[torch.Tensor], align: int = ALIGN_BYTES) -> tuple[list[int], int]:
    """Byte offsets of ``likes``' buffers in one host region, and the region's size in bytes.

    Each buffer takes ``numel * element_size`` bytes, starting at a multiple of ``align``: the
    region is the exact sum, plus at most ``align - 1`` bytes of padding per buffer.
    """
    offsets, total = [], 0
    for t in likes:
        total = -(-total // align) * align
        offsets.append(total)
        total += t.numel() * t.element_size()
    return offsets, total


def empty_host_buffers(likes: Sequence[torch.Tensor], *, pin: bool | None = None,
                       path: str | None = None) -> list[torch.Tensor]:
    """Contiguous host tensors of ``likes``' shapes and dtypes, carved from one region.

    ``pin`` (default: when a GPU is in use): the region is page-locked once, with
    ``cudaHostRegister``, instead of one ``pin_memory=True`` tensor per buffer, which torch's
    pinned allocator rounds up to a power of two per request and caches when freed (up to 2x the
    state in host memory, per tier). Each buffer is a ``torch.frombuffer`` tensor over its own
    slice: its storage is exactly its size, so megatron-core's torch_dist writer, which clones any
    CPU tensor whose storage is larger than the tensor, never clones one. The region is unpinned
    and freed when the last buffer is gone.

    ``path``: the region is a shared mapping of this new file (:func:`region_layout`'s size, in
    bytes) instead of anonymous memory; in a tmpfs (``/dev/shm``) its bytes outlive the process
    (``checkpoint.memory_dir``). The file is removed when the region is freed (its last buffer
    gone) or at a normal exit, not when the process is killed. Its bytes are reserved when it is
    created (``posix_fallocate``), so a full tmpfs raises ``OSError`` (ENOSPC) here.

    Raises:
        RuntimeError: ``cudaHostRegister`` failed (the CUDA error code is in the message).
        OSError: ``path`` could not be created or sized (e.g. ENOSPC in the tmpfs).
    """
    pin = has_gpu() if pin is None else pin
    offsets, total = region_layout(likes)
    if path is None:
        region = numpy.empty(max(total, 1), dtype=numpy.uint8)
    else:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:  # reserved now: a sparse file in a full tmpfs would SIGBUS at the first copy, not raise
            os.posix_fallocate(fd, 0, max(total, 1))
        except OSError:
            os.close(fd)
            unlink_quietly(path)
            raise
        os.close(fd)
        region = numpy.memmap(path, dtype=numpy.uint8, mode="r+", shape=(max(total, 1),))
        weakref.finalize(region, unlink_quietly, path)
    if pin and total:
        ptr = region.ctypes.data
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(ptr, total, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of {total} bytes of staging memory failed (error {int(err)})")
        weakref.finalize(region, cudart.cudaHostUnregister, ptr)
    return carve(region, likes, offsets)


def unlink_quietly(path: str) -> None:
    """Remove ``path``; a file already gone (or not removable) is not an error."""
    try:
        os.unlink(path)
    except OSError:
        pass


def carve(region: numpy.ndarray, likes: Sequence, offsets: Sequence[int]) -> list[torch.Tensor]:
    """Tensors of ``likes``' shapes and dtypes (tensors, or anything with ``shape``, ``dtype``,
    ``numel()`` and ``element_size()``) viewing ``region`` (uint8) at ``offsets`` (bytes; see
    :func:`region_layout`); each keeps the region alive. Empty ones get storage of their own."""
    out = []
    for t, off in zip(likes, offsets):
        n = t.numel() * t.element_size()
        if n == 0:
            out.append(torch.empty(tuple(t.shape), dtype=t.dtype))
            continue
        out.append(torch.frombuffer(region[off:off + n], dtype=t.dtype).view(tuple(t.shape)))
    return out


def copy_to_host(dst: Sequence[torch.Tensor], src: Sequence[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for every i; returns once every copy has landed in ``dst``.

    On GPU the device-to-host copies are queued on a side stream that first waits for the work
    already queued on the current stream (so it copies the values of the finished step), run
    asynchronously into pinned memory, and are synchronised before returning: after this call
    the caller may hand ``dst`` to a writer thread, and training may change ``src`` freely.
    On CPU it is one ``torch._foreach_copy_``.

    Raises:
        ValueError: ``dst`` and ``src`` differ in length.
    """
    if len(dst) != len(src):
        raise ValueError(f"copy_to_host: {len(dst)} buffers for {len(src)} tensors")
    if not has_gpu():
        if dst:  # (``_foreach_copy_`` refuses an empty list)
            with torch.no_grad():  # one call for all (per tensor, torch's and the CPU layer's dispatch cost 2-3 ms a save)
                torch._foreach_copy_(list(dst), list(src))
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
