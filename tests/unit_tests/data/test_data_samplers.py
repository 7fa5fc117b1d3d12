"""Samplers: data-parallel partition, exact resume, argument errors, iterators."""

import pytest
import torch

from tierstack.data.samplers import PretrainingSampler, build_cyclic_iterator, build_data_iterator


class IndexDataset(torch.utils.data.Dataset):
    """Sample i is {"tokens": [i, i]}: a batch shows which indices it holds."""

    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"tokens": torch.tensor([i, i])}


def _all(total, consumed, mbs, rank, size, drop_last=True):
    return list(PretrainingSampler(total, consumed, mbs, rank, size, drop_last))


def test_two_ranks_partition_each_step_disjointly():
    mbs, dp, total = 3, 2, 50
    r0, r1 = _all(total, 0, mbs, 0, dp), _all(total, 0, mbs, 1, dp)
    assert len(r0) == len(r1) == total // (mbs * dp)
    for step, (a, b) in enumerate(zip(r0, r1)):
        assert len(a) == len(b) == mbs and not set(a) & set(b)
        assert sorted(a + b) == list(range(step * mbs * dp, (step + 1) * mbs * dp))


@pytest.mark.parametrize("rank", [0, 1])
@pytest.mark.parametrize("k_steps", [1, 4, 8])
def test_resume_continues_the_same_order(rank, k_steps):
    mbs, dp, total = 2, 2, 37
    straight = _all(total, 0, mbs, rank, dp)
    resumed = _all(total, k_steps * mbs * dp, mbs, rank, dp)
    assert resumed == straight[k_steps:]
    assert len(PretrainingSampler(total, k_steps * mbs * dp, mbs, rank, dp)) == len(resumed)


def test_drop_last_false_gives_the_tail_in_rank_order():
    # 10 samples, step 4: the last step has 2 samples, all for rank 0.
    assert _all(10, 0, 2, 0, 2, drop_last=False)[-1] == [8, 9]
    assert _all(10, 0, 2, 1, 2, drop_last=False)[-1] == [6, 7]
    for rank in (0, 1):
        s = PretrainingSampler(10, 0, 2, rank, 2, drop_last=False)
        assert len(s) == len(list(s))
    assert _all(8, 8, 2, 0, 2) == []  # everything consumed: nothing left, no error


@pytest.mark.parametrize(
    "args, name",
    [((0, 0, 1, 0, 1), "total_samples"),
     ((10, -1, 1, 0, 1), "consumed_samples"),
     ((10, 11, 1, 0, 1), "consumed_samples"),
     ((10, 0, 0, 0, 1), "micro_batch_size"),
     ((10, 0, 1, 2, 2), "data_parallel_rank"),
     ((10, 0, 1, -1, 2), "data_parallel_rank"),
     ((10, 0, 1, 0, 0), "data_parallel_size"),
     ((10, 0, 1.5, 0, 1), "micro_batch_size"),
     ((10, True, 1, 0, 1), "consumed_samples")],
)
def test_bad_arguments_name_the_argument(args, name):
    with pytest.raises(ValueError, match=name):
        PretrainingSampler(*args)


def test_data_iterator_resumes_exactly():
    ds = IndexDataset(40)
    straight = [b["tokens"][:, 0].tolist() for b in build_data_iterator(ds, 0, 4, 1, 2)]
    resumed = [b["tokens"][:, 0].tolist() for b in build_data_iterator(ds, 16, 4, 1, 2)]
    assert straight == [[4, 5, 6, 7], [12, 13, 14, 15], [20, 21, 22, 23], [28, 29, 30, 31], [36, 37, 38, 39]]
    assert resumed == straight[2:]
    assert build_data_iterator(None, 0, 4, 0, 1) is None


def test_cyclic_iterator_wraps_and_resumes():
    ds = IndexDataset(10)  # one pass = 8 samples with step 4 (2 samples dropped)
    it = build_cyclic_iterator(ds, 0, 2, 0, 2)
    got = [next(it)["tokens"][:, 0].tolist() for _ in range(5)]
    assert got == [[0, 1], [4, 5], [0, 1], [4, 5], [0, 1]]
    it = build_cyclic_iterator(ds, 12, 2, 1, 2)  # 12 consumed = 1.5 passes
    assert [next(it)["tokens"][:, 0].tolist() for _ in range(2)] == [[6, 7], [2, 3]]
    with pytest.raises(ValueError, match="fewer than one step"):
        build_cyclic_iterator(IndexDataset(3), 0, 2, 0, 2)
