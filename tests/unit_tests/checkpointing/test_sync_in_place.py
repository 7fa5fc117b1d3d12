"""Issue 25: a GLOBAL sync save writes host tensors where they are (training waits for it, as for
``torch.distributed.checkpoint.save``), so it copies nothing into staging buffers; an async save, a
GPU tensor or a view still goes through the buffers. What is written is the state, and the
non-finite check reads the tensors that are written (real megatron-core plans and files)."""

from pathlib import Path

import pytest
import torch

from tierstack.checkpointing import global_writer
from tierstack.checkpointing.nonfinite_guard import NonFiniteStateError, check_staged
from tierstack.checkpointing.staging import Stager


def _sharded(tensors: dict):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {k: ShardedTensor.from_rank_offsets(k, t) for k, t in tensors.items()}


def _state():
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(256, 64, generator=g), "b": torch.randn(64, generator=g).to(torch.bfloat16)}


def test_in_place_writes_the_host_tensors_without_staging_buffers():
    state, stager = _state(), Stager("test")
    sd = _sharded(state)
    written = global_writer.stage_sharded_tensors(sd, stager, in_place=True)
    assert [t.data_ptr() for t in written] == [t.data_ptr() for t in state.values()]
    assert [sd[k].data.data_ptr() for k in state] == [t.data_ptr() for t in state.values()]
    assert stager.allocations == 0 and stager.nbytes == 0  # no host memory held for a sync save
    stager.close()


@pytest.mark.parametrize("why", ["async save", "a view"])
def test_otherwise_everything_is_copied_into_the_buffers(why):
    state, stager = _state(), Stager("test")
    if why == "a view":  # a slice of a larger storage: megatron's writer would clone it on this thread
        state["b"] = torch.randn(2, 64)[0]
    sd = _sharded(state)
    written = global_writer.stage_sharded_tensors(sd, stager, in_place=why != "async save")
    assert stager.allocations == 1
    assert all(b.data_ptr() != t.data_ptr() for b, t in zip(written, state.values()))
    assert all(torch.equal(b, t) for b, t in zip(written, state.values()))
    assert [sd[k].data.data_ptr() for k in state] == [b.data_ptr() for b in written]
    stager.close()


def test_writable_in_place():
    assert global_writer.writable_in_place(torch.zeros(4))
    assert not global_writer.writable_in_place(torch.zeros(8)[:4])  # a view of a larger storage
    assert global_writer.writable_in_place(torch.zeros(8).view(2, 4))  # the whole storage, reshaped


def _save_in_place(path: Path, state: dict, check: bool):
    from megatron.core import dist_checkpointing

    path.mkdir(parents=True)
    global_writer.start_results_channel(fresh=True)
    sd = _sharded(state)
    written = global_writer.stage_sharded_tensors(sd, Stager("test"), in_place=True)
    request = dist_checkpointing.save(sd, str(path), async_sharded_save=True, async_strategy="mcore")
    checker = (lambda: check_staged(written, "GLOBAL checkpoint of step 1")) if check else None
    return request, global_writer.write_request(request, path, attempts=1, backoff_s=0.0, check=checker)


def test_an_in_place_save_loads_back_bit_for_bit(gloo_group, tmp_path):
    from megatron.core import dist_checkpointing

    state = _state()
    request, entries = _save_in_place(tmp_path / "ckpt", state, check=True)
    assert entries
    for fn in request.finalize_fns:
        fn()
    loaded = dist_checkpointing.load(_sharded({k: torch.empty_like(t) for k, t in state.items()}),
                                     str(tmp_path / "ckpt"))
    assert all(torch.equal(loaded[k], t) for k, t in state.items())
    global_writer.shutdown_results_channel()


def test_a_nonfinite_tensor_written_in_place_blocks_the_save(gloo_group, tmp_path):
    state = _state()
    state["w"][3, 5] = float("inf")  # in the live tensor itself: there is no staged copy to check
    with pytest.raises(NonFiniteStateError, match="rank 0"):
        _save_in_place(tmp_path / "ckpt", state, check=True)
    assert global_writer.start_results_channel().empty()  # no write result reached megatron's finalize
    global_writer.shutdown_results_channel()
