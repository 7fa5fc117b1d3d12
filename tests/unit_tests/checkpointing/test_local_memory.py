"""The LOCAL step held in host memory for in-process restart: two staging sets, the held one never
refilled, and a decode from memory equal to the file's (single process, real megatron-core state
dicts, real files)."""

import pytest
import torch

from tierstack.checkpointing import local_file, local_memory
from tierstack.checkpointing.staging import Stager


@pytest.fixture
def memory(monkeypatch):
    monkeypatch.setattr(local_memory, "_enabled", True)
    monkeypatch.setattr(local_memory, "_held", None)
    yield
    local_memory.forget()


@pytest.fixture
def gloo_group(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    torch.distributed.destroy_process_group()


def _tasd(value: float):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.full((64, 8), value)),
          "b": ShardedTensor.from_rank_offsets("b", torch.full((8,), value).to(torch.bfloat16)),
          "common": {"iteration": int(value)}}
    return MCoreTensorAwareStateDict.from_state_dict(sd, algo="atomic")[0]


def _template():
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    return {"w": ShardedTensor.from_rank_offsets("w", torch.zeros(64, 8)),
            "b": ShardedTensor.from_rank_offsets("b", torch.zeros(8, dtype=torch.bfloat16)), "common": {}}


def _save(stager, step: float, tmp_path, seal: bool = True):
    tasd = _tasd(step)
    bufs = stager.stage(tasd.pop_tensors())
    header = local_file.encode_header(tasd, bufs)
    local_memory.note_staged(stager, int(step), header)
    path = tmp_path / f"iter_{int(step):07d}_0_local.pt"
    entry = stager.submit(local_file.write, path, header, bufs).result()
    if seal:
        local_memory.note_sealed(stager, step=int(step), run_id="r", rank=0, root=tmp_path, topology={"world_size": 1})
    return path, entry


def test_the_sealed_steps_buffers_are_never_refilled(tmp_path, memory, gloo_group):
    stager = local_memory.stager_for(Stager("LOCAL"))
    assert isinstance(stager, local_memory.MemoryStager)
    _save(stager, 5, tmp_path)
    held = local_memory.held()
    assert held.step == 5 and float(held.buffers[0][0, 0]) == 5.0
    _save(stager, 10, tmp_path, seal=False)  # in flight, or failed: the other set
    assert local_memory.held() is held and float(held.buffers[0][0, 0]) == 5.0
    _save(stager, 15, tmp_path, seal=False)  # step 10 never sealed: that set again, still not step 5's
    assert float(held.buffers[0][0, 0]) == 5.0
    _save(stager, 20, tmp_path)
    assert local_memory.held().step == 20 and float(held.buffers[0][0, 0]) == 5.0  # (now free to reuse)
    _save(stager, 25, tmp_path, seal=False)
    assert float(local_memory.held().buffers[0][0, 0]) == 20.0
    stager.close()
    assert local_memory.held().step == 20 and float(local_memory.held().buffers[0][0, 0]) == 20.0  # outlives it


def test_memory_decode_equals_the_file_and_needs_no_file(tmp_path, memory, gloo_group):
    stager = local_memory.stager_for(Stager("LOCAL"))
    path, entry = _save(stager, 7, tmp_path)
    from_file = local_file.decode(local_file.read_verified(path, entry), path).to_state_dict(_template(), algo="atomic")
    path.unlink()  # the memory copy does not read it
    h = local_memory.match(7, "r", 0, tmp_path, {"world_size": 1})
    from_memory = local_memory.decode(h, path).to_state_dict(_template(), algo="atomic")
    for k in ("w", "b"):
        assert torch.equal(from_memory[k], from_file[k]) and from_memory[k].dtype == from_file[k].dtype
    assert from_memory["common"] == {"iteration": 7}
    stager.close()


def test_only_the_same_step_run_rank_root_and_topology_match(tmp_path, memory, gloo_group):
    stager = local_memory.stager_for(Stager("LOCAL"))
    _save(stager, 7, tmp_path)
    topo = {"world_size": 1}
    assert local_memory.match(7, "r", 0, tmp_path, topo) is not None
    assert local_memory.match(7, None, 0, tmp_path, topo) is not None
    for args in ((8, "r", 0, tmp_path, topo), (7, "other", 0, tmp_path, topo), (7, "r", 1, tmp_path, topo),
                 (7, "r", 0, tmp_path / "x", topo), (7, "r", 0, tmp_path, {"world_size": 2})):
        assert local_memory.match(*args) is None, args
    stager.close()


def test_off_unless_enabled(monkeypatch, tmp_path):
    monkeypatch.setattr(local_memory, "_enabled", False)
    monkeypatch.setattr(local_memory, "_held", None)
    stager = local_memory.stager_for(Stager("LOCAL"))
    assert type(stager) is Stager  # one set, as before
    local_memory.note_sealed(stager, step=1, run_id="r", rank=0, root=tmp_path, topology={})
    assert local_memory.held() is None
