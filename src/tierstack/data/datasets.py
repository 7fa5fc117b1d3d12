"""Train and validation GPT datasets over megatron-core's ``BlendedMegatronDatasetBuilder``.

What megatron-core 0.16.1 does that callers should know:

- ``build()`` is collective when ``torch.distributed`` is initialized: global rank 0 builds each
  dataset first (writing the shuffle/sample index ``.npy`` files to ``path_to_cache``), then all
  ranks meet at ``torch.distributed.barrier()`` on the default group, then the other ranks build
  (they load the cached indices). Every rank must call it, also ranks for which
  ``is_built_on_rank()`` is False: they still join the barriers and get ``None`` datasets.
- ``is_built_on_rank`` must be True on global rank 0.
- Index files go to ``<dataset.cache_dir>/indices`` named by an md5 of the dataset description
  (path, split, seed, sequence length, sample count, tokenizer.unique_identifiers).
- A blend of several prefixes (``BlendedDataset``) needs torch.distributed initialized: its index
  builder calls ``torch.distributed.get_rank()`` without checking.
- With no blend, ``GPTDatasetConfig`` switches itself to mock data and forces ``split="1,1,1"``.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Callable, Optional

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset

from tierstack.config.sections import DatasetConfig, parse_data_path
from tierstack.data.preprocess import ensure_stdlib_corpus

logger = logging.getLogger(__name__)


def resolve_stdlib_corpus(cache_dir: str, tokenizer) -> str:
    """:func:`ensure_stdlib_corpus`, built by global rank 0 first when torch.distributed is up.

    Collective when torch.distributed is initialized (one barrier): every rank must call it.
    """
    if not torch.distributed.is_initialized():
        return ensure_stdlib_corpus(cache_dir, tokenizer)
    prefix = ensure_stdlib_corpus(cache_dir, tokenizer) if torch.distributed.get_rank() == 0 else None
    torch.distributed.barrier()  # sync point: the others then find rank 0's cache
    return prefix if prefix is not None else ensure_stdlib_corpus(cache_dir, tokenizer)


def resolve_blend(dataset_cfg: DatasetConfig, tokenizer) -> Optional[tuple[list[str], Optional[list[float]]]]:
    """``(prefixes, weights)`` the run trains on, or None for mock data (no files).

    ``data_path`` None builds the stdlib corpus once (collective, see :func:`resolve_stdlib_corpus`).

    Raises:
        ValueError / FileNotFoundError: see :func:`parse_data_path`.
    """
    if dataset_cfg.mock:
        return None
    if dataset_cfg.data_path is None:
        return [resolve_stdlib_corpus(dataset_cfg.cache_dir, tokenizer)], None
    return parse_data_path(dataset_cfg.data_path)


def check_training_data(dataset_cfg: DatasetConfig, tokenizer) -> None:
    """Collective: :func:`tierstack.data.checks.check_datasets` on the files the run trains on.

    Raises:
        DataFileError: on every rank, naming each bad file and what to do.
    """
    from tierstack.data.checks import check_datasets

    blend = resolve_blend(dataset_cfg, tokenizer)
    if blend is not None:
        check_datasets(blend[0], tokenizer, dataset_cfg.cache_dir)


def build_train_valid_datasets(
    dataset_cfg: DatasetConfig,
    tokenizer,
    seq_length: int,
    train_samples: int,
    valid_samples: int,
    seed: int,
    is_built_on_rank: Optional[Callable[[], bool]] = None,
) -> tuple[Optional[GPTDataset], Optional[GPTDataset]]:
    """Build the train and validation GPT datasets.

    Args:
        dataset_cfg: ``data_path`` None means the built-in stdlib corpus, resolved here through
            :func:`resolve_stdlib_corpus` (built once under ``cache_dir``); ``mock`` uses
            megatron-core's MockGPTDataset and reads no files (its split is then "1,1,1").
        tokenizer: see :mod:`tierstack.data.tokenizers` (needs ``eod``, ``vocab_size``,
            ``unique_identifiers``).
        seq_length: tokens per sample.
        train_samples: samples the training run draws (usually train_iters * global_batch_size);
            the dataset repeats epochs to reach it.
        valid_samples: samples the validation runs draw in total; one epoch of the valid split at
            least.
        seed: shuffling seed (documents and samples); same seed, same order.
        is_built_on_rank: which ranks hold datasets (default: all). Must be True on global rank 0.

    Returns:
        ``(train_ds, valid_ds)``. ``len(train_ds) >= train_samples``. Each item is a dict of
        ``[seq_length]`` tensors: ``tokens``, ``labels`` (tokens shifted by one) and
        ``position_ids`` int64, ``loss_mask`` float32 (1.0 everywhere for real data). No
        ``attention_mask`` (the model builds the causal mask). A blend of several prefixes adds
        ``dataset_id`` (int64 scalar: which prefix). ``valid_ds`` is None when the
        split gives validation no documents, and both are None on ranks not building.

    Raises:
        ValueError / FileNotFoundError: bad ``dataset.data_path`` or sizes (see parse_data_path).
        RuntimeError: a blend of several prefixes without torch.distributed initialized.
        Collective when torch.distributed is initialized: every rank must call it.
    """
    if seq_length < 1 or train_samples < 1 or valid_samples < 0:
        raise ValueError(
            f"need seq_length >= 1, train_samples >= 1, valid_samples >= 0; got {seq_length}, "
            f"{train_samples}, {valid_samples}"
        )
    blend = resolve_blend(dataset_cfg, tokenizer)
    if blend is not None and len(blend[0]) > 1 and not torch.distributed.is_initialized():
        # megatron-core 0.16.1's BlendedDataset calls torch.distributed.get_rank() unguarded
        # when it builds its index; fail here with a message instead of deep inside it.
        raise RuntimeError(
            "dataset.data_path blends several prefixes, which megatron-core can only build "
            "with torch.distributed initialized (a 1-rank gloo group is enough)"
        )
    config = GPTDatasetConfig(
        random_seed=seed,
        sequence_length=seq_length,
        blend=blend,
        split=dataset_cfg.split,
        path_to_cache=str(Path(dataset_cfg.cache_dir).expanduser() / "indices"),
        tokenizer=tokenizer,
        # Documents are packed across EOD boundaries with positions running on, like GPT-2/3
        # pretraining; the model makes its own causal mask, so the dataset need not build one.
        reset_position_ids=False,
        reset_attention_mask=False,
        eod_mask_loss=False,
        create_attention_mask=False,
    )
    dataset_cls = MockGPTDataset if dataset_cfg.mock else GPTDataset
    builder = BlendedMegatronDatasetBuilder(
        dataset_cls,
        [train_samples, valid_samples, 0],
        is_built_on_rank or (lambda: True),
        config,
    )
    train_ds, valid_ds, _test_ds = builder.build()
    if train_ds is not None:
        logger.info(
            "datasets: train %d samples, valid %s samples (seq %d, data %s)",
            len(train_ds), len(valid_ds) if valid_ds is not None else None, seq_length,
            "mock" if dataset_cfg.mock else blend[0],
        )
    return train_ds, valid_ds


__all__ = [
    "build_train_valid_datasets", "check_training_data", "parse_data_path", "resolve_blend", "resolve_stdlib_corpus",
]
