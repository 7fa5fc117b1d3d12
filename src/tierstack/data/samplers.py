"""Batch samplers and data iterators that resume exactly from a consumed-sample count.

Order of samples: the dataset's own order (megatron-core's GPTDataset is already shuffled by its
``random_seed``). Index ``i`` goes to step ``i // (micro_batch_size * dp_size)`` and to data-parallel
rank ``(i % (micro_batch_size * dp_size)) // micro_batch_size``. So ``consumed_samples`` (a global
count, the same on every rank) fully determines where the data order continues after a resume.
"""

from __future__ import annotations

from typing import Iterator, Optional

import torch
from torch.utils.data import DataLoader, Dataset

from tierstack.runtime.forked import close_inherited_network_sockets


def _check_int(name: str, value, minimum: int) -> None:
    """Raise ValueError naming ``name`` unless ``value`` is an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")


class PretrainingSampler:
    """Batch sampler: yields this data-parallel rank's micro-batches of sample indices.

    Args:
        total_samples: samples available (``len(dataset)``), >= 1.
        consumed_samples: samples already consumed by all ranks together (global count), 0 ..
            total_samples. Iteration starts at this index.
        micro_batch_size: samples per micro-batch per rank, >= 1.
        data_parallel_rank: this rank, 0 .. data_parallel_size - 1.
        data_parallel_size: number of data-parallel ranks, >= 1.
        drop_last: drop a final step that cannot give every rank a full micro-batch. With False,
            that last step is split in rank order and some ranks get a short or no batch.

    Yields:
        ``list[int]`` of ``micro_batch_size`` indices. The ranks' lists of one step are disjoint
        and together cover ``micro_batch_size * data_parallel_size`` consecutive indices.

    Raises:
        ValueError: an argument out of range (the message names it).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        _check_int("total_samples", total_samples, 1)
        _check_int("consumed_samples", consumed_samples, 0)
        _check_int("micro_batch_size", micro_batch_size, 1)
        _check_int("data_parallel_size", data_parallel_size, 1)
        _check_int("data_parallel_rank", data_parallel_rank, 0)
        if data_parallel_rank >= data_parallel_size:
            raise ValueError(
                f"data_parallel_rank must be < data_parallel_size={data_parallel_size}, "
                f"got {data_parallel_rank}"
            )
        if consumed_samples > total_samples:
            raise ValueError(
                f"consumed_samples={consumed_samples} is beyond total_samples={total_samples}; "
                "the dataset was built for fewer samples than this run has consumed"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last

    @property
    def _step_size(self) -> int:
        return self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        """Number of micro-batches this rank will yield."""
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self._step_size)
        if self.drop_last or rest <= self.data_parallel_rank * self.micro_batch_size:
            return full
        return full + 1

    def __iter__(self) -> Iterator[list[int]]:
        step = self._step_size
        start = self.data_parallel_rank * self.micro_batch_size
        for base in range(self.consumed_samples, self.total_samples, step):
            end = min(base + step, self.total_samples)
            if end - base < step and self.drop_last:
                return
            mine = list(range(base + start, min(base + start + self.micro_batch_size, end)))
            if mine:
                yield mine


def build_data_iterator(
    dataset: Optional[Dataset],
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> Optional[Iterator[dict]]:
    """Iterator over this rank's micro-batches, starting after ``consumed_samples``.

    Args:
        dataset: map-style dataset (e.g. GPTDataset); None (not built on this rank) gives None.
        consumed_samples, micro_batch_size, dp_rank, dp_size: see :class:`PretrainingSampler`.
        num_workers: DataLoader worker processes (0 = load in the training process).
        pin_memory: pin host memory (pass True only on GPU; ``tierstack.runtime`` knows).

    Returns:
        an iterator of collated batches, for GPTDataset a dict of ``[micro_batch_size, seq_length]``
        tensors: ``tokens``/``labels``/``position_ids`` int64, ``loss_mask`` float32. It ends when
        the dataset is exhausted. None if ``dataset`` is None.
    """
    if dataset is None:
        return None
    sampler = PretrainingSampler(len(dataset), consumed_samples, micro_batch_size, dp_rank, dp_size)
    return iter(_loader(dataset, sampler, num_workers, pin_memory))


def build_cyclic_iterator(
    dataset: Optional[Dataset],
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> Optional[Iterator[dict]]:
    """Endless iterator for validation: restarts from index 0 whenever the dataset runs out.

    One pass covers ``len(dataset)`` rounded down to a multiple of ``micro_batch_size * dp_size``.
    ``consumed_samples`` (global count, may exceed ``len(dataset)``) places the start modulo one
    pass, so a resumed run evaluates on the same samples as an uninterrupted one.

    Returns:
        an infinite iterator of batches as in :func:`build_data_iterator`, or None for None.

    Raises:
        ValueError: the dataset holds fewer than ``micro_batch_size * dp_size`` samples.
    """
    if dataset is None:
        return None
    _check_int("consumed_samples", consumed_samples, 0)
    _check_int("micro_batch_size", micro_batch_size, 1)
    _check_int("dp_size", dp_size, 1)
    step = micro_batch_size * dp_size
    per_pass = (len(dataset) // step) * step
    if per_pass == 0:
        raise ValueError(
            f"the validation dataset has {len(dataset)} samples, fewer than one step "
            f"(micro_batch_size * data-parallel size = {step}); lower train.micro_batch_size "
            "or raise the validation share in dataset.split"
        )

    def cycle() -> Iterator[dict]:
        start = consumed_samples % per_pass
        while True:
            sampler = PretrainingSampler(per_pass, start, micro_batch_size, dp_rank, dp_size)
            yield from _loader(dataset, sampler, num_workers, pin_memory)
            start = 0

    return cycle()


def _loader(dataset: Dataset, sampler: PretrainingSampler, num_workers: int, pin_memory: bool):
    """A DataLoader over ``sampler``'s batches (no shuffling: the order is the sampler's).

    Every ``iter()`` of a DataLoader draws a seed; with its own generator that draw never touches
    torch's default generator, so dropout after a resume sees the RNG state that was saved, even
    when an iterator is first used (or restarted) later in one run than in the other.

    Worker processes are forked from the rank: each first closes its copies of the rank's network
    sockets (:func:`~tierstack.runtime.forked.close_inherited_network_sockets`), so that a rank
    that fails or dies closes its process groups' connections for its peers at once.
    """

    _check_int("num_workers", num_workers, 0)
    return DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        pin_memory=pin_memory,
        persistent_workers=False,
        generator=torch.Generator().manual_seed(_LOADER_SEED),
        worker_init_fn=close_inherited_network_sockets if num_workers else None,
    )


_LOADER_SEED = 0  # seeds only worker processes' RNG (no shuffling here): any fixed value is exact


__all__ = ["PretrainingSampler", "build_data_iterator", "build_cyclic_iterator"]
