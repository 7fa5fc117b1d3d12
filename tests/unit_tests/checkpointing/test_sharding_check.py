"""Issue 25: megatron-core's sharding validation runs at a GLOBAL tier's first save and again only
when some rank's sharded structure changed; the ranks always agree on it (real megatron plans,
real gloo ranks)."""

import pytest
import torch

from tierstack.checkpointing import global_writer, sharding_check
from tierstack.checkpointing.staging import Stager


def _sd(n: int = 64, value: float = 1.0, chunk: int = 0, chunks: int = 1):
    """``w``: chunk ``chunk`` of ``chunks`` equal chunks of a tensor, the only one this rank saves."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    w = ShardedTensor.from_rank_offsets("w", torch.full((n,), value), (0, chunk, chunks))
    return {"w": w, "o": ShardedObject("o", {"x": value}, (1,), (0,), replica_id=0)}


def test_the_signature_is_the_structure_not_the_values():
    sig = sharding_check.structure_signature
    assert sig(_sd(value=1.0)) == sig(_sd(value=2.0))
    assert sig(_sd(n=64)) != sig(_sd(n=65))
    assert sig(_sd(n=32, chunk=0, chunks=2)) != sig(_sd(n=32, chunk=1, chunks=2))


def _count_validations(monkeypatch) -> list:
    from megatron.core.dist_checkpointing import state_dict_utils

    calls: list = []
    real = state_dict_utils.validate_sharding_integrity

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(state_dict_utils, "validate_sharding_integrity", counted)
    return calls


def _plan(tmp_path, name, sd, sharding):
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy

    d = tmp_path / name
    d.mkdir()
    return global_writer.plan(sd, d, Stager("test"), get_default_save_sharded_strategy("torch_dist"),
                              in_place=True, sharding=sharding)


def test_validated_once_per_structure_and_a_changed_one_is_still_refused(gloo_group, tmp_path, monkeypatch):
    from megatron.core.dist_checkpointing.core import CheckpointingException

    calls = _count_validations(monkeypatch)
    sharding = sharding_check.ShardingValidation()
    _plan(tmp_path, "a", _sd(value=1.0), sharding)
    _plan(tmp_path, "b", _sd(value=2.0), sharding)  # same structure, new values: not validated again
    assert len(calls) == 1
    with pytest.raises(CheckpointingException):  # half of a 128-element tensor: not fully covered
        _plan(tmp_path, "c", _sd(n=64, chunks=2), sharding)
    assert len(calls) == 2
    with pytest.raises(CheckpointingException):  # a failed validation is not remembered as passed
        _plan(tmp_path, "d", _sd(n=64, chunks=2), sharding)
    global_writer.shutdown_results_channel()


def _rank(rank, store, out):
    torch.distributed.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    sharding = sharding_check.ShardingValidation()
    verdicts = []
    for save in range(3):
        n = 64 if (rank == 0 or save < 2) else 65  # rank 1's structure changes at the third save
        verdict, signature = sharding.needed(_sd(n=n, value=float(save)))
        sharding.passed(signature)
        verdicts.append(verdict)
    out.put((rank, verdicts))
    torch.distributed.destroy_process_group()


def test_every_rank_validates_when_any_rank_structure_changed(start_ranks, tmp_path):
    procs, out = start_ranks(_rank, str(tmp_path / "store"))
    got = dict(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got == {0: [True, False, True], 1: [True, False, True]}
