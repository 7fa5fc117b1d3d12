"""Issue 26, item 8: a tier's staging buffers are carved from one host region (pinned once on a GPU)
with exact sizes, instead of one pinned tensor each that torch's pinned allocator rounds up to a power
of two; each buffer still has storage of its own size, so megatron-core's torch_dist writer never
clones it (its ``_clone_or_dequantize_if_needed`` clones a CPU tensor when
``untyped_storage().size() != numel * itemsize``)."""

import gc

import torch

from tierstack.checkpointing.staging import Stager
from tierstack.runtime import host_copy


def _state():
    return [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.randn(1000, dtype=torch.float64).to(torch.bfloat16),
            torch.zeros(0), torch.ones(2, 2, 2, dtype=torch.float16)]


def test_the_region_is_the_exact_sum_with_aligned_offsets():
    likes = _state()
    offsets, total = host_copy.region_layout(likes)
    sizes = [t.numel() * t.element_size() for t in likes]
    assert all(o % host_copy.ALIGN_BYTES == 0 for o in offsets)
    assert all(offsets[i] + sizes[i] <= offsets[i + 1] for i in range(len(likes) - 1))  # no overlap
    assert sum(sizes) <= total < sum(sizes) + host_copy.ALIGN_BYTES * len(likes)


def test_buffers_have_storage_of_their_own_size_and_hold_the_copies():
    likes = _state()
    bufs = host_copy.empty_host_buffers(likes, pin=False)
    for b, t in zip(bufs, likes):
        assert b.shape == t.shape and b.dtype == t.dtype and b.device.type == "cpu" and b.is_contiguous()
        assert b.untyped_storage().size() == b.numel() * b.itemsize  # megatron will not clone it
    host_copy.copy_to_host(bufs, likes)
    assert all(torch.equal(b, t) for b, t in zip(bufs, likes))  # distinct slices: nothing overwrote another
    del likes
    gc.collect()
    assert all(b.numel() == 0 or torch.isfinite(b.float()).all() for b in bufs)  # the region outlives the likes


def test_the_stager_reports_the_bytes_of_its_region():
    likes = _state()
    stager = Stager("GLOBAL")
    try:
        staged = stager.stage(likes)
        assert stager.nbytes == sum(t.numel() * t.element_size() for t in likes)
        assert all(s.untyped_storage().size() == s.numel() * s.itemsize for s in staged)
    finally:
        stager.close()


import pytest  # noqa: E402


@pytest.mark.skipif(not torch.cuda.is_available(), reason="page-locking needs a GPU (scripts/gpu_check.sh runs this)")
def test_on_a_gpu_the_region_is_pinned_once_and_copies_are_exact():
    likes = [t.cuda() for t in _state()]
    bufs = host_copy.empty_host_buffers(likes)
    assert all(b.is_pinned() for b in bufs if b.numel())
    host_copy.copy_to_host(bufs, likes)
    assert all(torch.equal(b, t.cpu()) for b, t in zip(bufs, likes))


def test_copy_to_host_copies_every_tensor_exactly_and_accepts_an_empty_state():
    """The CPU path is one ``torch._foreach_copy_`` over the whole state: mixed dtypes, an empty
    tensor, a transposed (non-contiguous) source and a parameter that requires grad each land bit
    for bit in their buffer, and the buffers stay plain tensors; an empty state copies nothing
    (``_foreach_copy_`` alone refuses an empty list)."""
    from tierstack.runtime.host_copy import copy_to_host, empty_host_buffers

    copy_to_host([], [])
    src = [torch.randn(3, 5).t(), torch.nn.Parameter(torch.randn(7)), torch.empty(0),
           torch.randn(4).bfloat16(), torch.tensor([2**40, -3]), torch.tensor(9.5)]
    dst = empty_host_buffers(src)
    copy_to_host(dst, src)
    for d, s in zip(dst, src):
        assert d.dtype == s.dtype and d.shape == s.shape and not d.requires_grad
        assert torch.equal(d, s.detach())
    src[1].data.add_(1.0)  # the buffers are copies: training may change the sources after the call
    assert not torch.equal(dst[1], src[1].detach())
