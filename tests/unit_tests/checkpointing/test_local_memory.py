"""The LOCAL step held in host memory for in-process restart: two staging sets, the held one never
refilled, and a decode from memory equal to the file's (single process, real megatron-core state
dicts, real files)."""

import pytest
import torch

from tierstack.checkpointing import local_file, local_memory
from tierstack.checkpointing.staging import Stager


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


def _memory_step(tier, model, opt, step: int):
    """What ``LocalTier.save(in_memory=True)`` does after building the state (an empty header:
    never decoded here): the real Adam state staged, then checked, agreed and held."""
    from tests.unit_tests.checkpointing.test_nonfinite_guard import adam_state_tensors

    live = adam_state_tensors(model, opt)
    tier._stager.stage(live)
    local_memory.note_staged(tier._stager, step, b"")
    tier._seal_in_memory(step, "runA", live, {"step": step, "run_id": "runA"})


@pytest.mark.parametrize("finite", [True, False])
def test_a_memory_step_is_held_with_its_manifest_and_no_file_and_never_when_non_finite(tmp_path, memory, finite):
    """A real LOCAL tier: a memory step becomes the held step and this rank's resume candidate (no
    file anywhere); a non-finite one is the guard's verdict and is not held; a veto of its step
    (another tier found NaN/inf in it) drops it."""
    import math

    from tests.unit_tests.checkpointing.test_nonfinite_guard import LAYOUT, adam_after_one_step
    from tierstack.checkpointing.local_tier import LocalTier
    from tierstack.config import CheckpointConfig

    model, opt = adam_after_one_step()
    if not finite:
        opt.state[model.weight]["exp_avg"][0, 0] = math.nan
    tier = LocalTier(CheckpointConfig(local_dir=str(tmp_path / "local")), LAYOUT)
    try:
        _memory_step(tier, model, opt, 11)
        assert tier.sealed == [] and tier.failures == [] and tier.in_flight == 0  # never a file step
        assert not (tmp_path / "local" / "0").exists()
        if not finite:
            assert tier.nonfinite == [(11, [0])] and local_memory.held() is None
            assert tier.candidates("runA") == []
            return
        held = local_memory.held()
        assert held.step == 11 and held.manifest == {"step": 11, "run_id": "runA"}
        (cand,) = tier.candidates("runA")
        assert (cand.step, cand.problem, cand.extra) == (11, None, {"in_memory": True})
        assert tier.candidates("another-run") == [] and tier.verify(cand) is None  # no file read
        tier.veto(11)
        assert local_memory.held() is None and tier.candidates("runA") == []
    finally:
        tier.close()


def test_a_memory_step_while_a_file_is_written_takes_a_third_set_and_never_waits(tmp_path, memory, gloo_group):
    """The held step's set and the set the writer reads are never refilled; a memory step staged
    while the writer runs does not wait for it; the file's step, sealed after a newer memory step,
    does not replace it."""
    import threading

    stager = local_memory.stager_for(Stager("LOCAL"))
    _save(stager, 5, tmp_path)  # held: step 5, set A
    tasd = _tasd(10)
    bufs = stager.stage(tasd.pop_tensors())  # the file of step 10: set B
    local_memory.note_staged(stager, 10, b"h10")
    release = threading.Event()
    job = stager.submit(release.wait, 10)  # the writer reads set B until released
    tasd11 = _tasd(11)
    memory_bufs = stager.stage(tasd11.pop_tensors())  # returns at once: a third set
    assert not job.done() and all(a is not b for a in memory_bufs for b in (*bufs, *local_memory.held().buffers))
    local_memory.note_staged(stager, 11, b"h11")
    local_memory.note_sealed(stager, step=11, run_id="r", rank=0, root=tmp_path, topology={}, manifest={"m": 1})
    assert float(bufs[0][0, 0]) == 10.0 and float(memory_bufs[0][0, 0]) == 11.0
    release.set()
    job.result()
    local_memory.note_sealed(stager, step=10, run_id="r", rank=0, root=tmp_path, topology={})
    assert local_memory.held().step == 11  # the older file step does not replace it
    stager.close()


def test_a_memory_step_another_rank_does_not_hold_is_skipped_not_missing(tmp_path, memory, monkeypatch):
    """Selection on a real LOCAL tier, rank 1 simulated in the gather (a new process: no candidate):
    the memory step is skipped as such, never listed as a checkpoint missing on a rank (which would
    refuse a fresh start), and a fresh start of the run is allowed."""
    from tests.unit_tests.checkpointing.test_nonfinite_guard import LAYOUT, adam_after_one_step
    from tierstack.checkpointing import family, selection
    from tierstack.checkpointing.local_tier import LocalTier
    from tierstack.config import CheckpointConfig
    from tierstack.runtime import collectives

    real = collectives.all_gather_object
    rank1 = ({}, {}, set())  # (problems, .dirty steps, memory steps) of a rank that holds nothing
    monkeypatch.setattr(collectives, "all_gather_object",
                        lambda obj: real(obj) + [rank1 if isinstance(obj, tuple) else [] if isinstance(obj, list) else None])
    cfg = CheckpointConfig(local_dir=str(tmp_path / "local"))
    tier = LocalTier(cfg, LAYOUT)
    try:
        model, opt = adam_after_one_step()
        _memory_step(tier, model, opt, 3)
        chosen = selection.select([tier], family="runA")
        assert chosen.handler is None and chosen.missing == [] and chosen.quarantined == []
        assert chosen.skipped == [f"local step 3: {selection.MEMORY_STEP} rank(s) [1]"]
        family.check_fresh_start(cfg, chosen, [tier], "runA")  # not refused
    finally:
        tier.close()
