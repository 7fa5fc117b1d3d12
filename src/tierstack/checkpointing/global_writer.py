"""How the GLOBAL tier feeds megatron-core's torch_dist writer from reused staging buffers, and runs
its write plan on our writer thread instead of a forked process.

megatron-core 0.16.1 (``dist_checkpointing.save(..., async_sharded_save=True)``) returns an
``AsyncRequest`` whose ``async_fn`` is ``FileSystemWriterAsync.write_preloaded_data_multiproc``:
meant to run in a process of megatron's ``AsyncCallsQueue`` (forked per save on CPU, because the
persistent worker selects a CUDA device at start), it forks one more process per write bucket.
Each fork makes the training process's memory copy-on-write while the writer lives, so the next
step faults on every page of weights and Adam state it updates. What megatron allows instead:

- the write plan resolves each ``ShardedTensor.data``; replacing them by staging buffers (each with
  its own storage, so ``_clone_if_needed`` does not clone them, and already on the host, so
  ``preload_tensors`` has nothing to copy) makes the plan read from the buffers;
- ``FileSystemWriterAsync.write_preloaded_data`` writes one bucket (file) with fsync and reports
  through plain queues; calling it per bucket on our writer thread, then handing the results to
  the request's results queue, is what ``write_preloaded_data_multiproc`` does without the forks.
  megatron's own finalize (gathering the write results, the ``.metadata`` file) then runs unchanged.
"""

from __future__ import annotations

import logging
import queue
import time
from pathlib import Path

from tierstack.checkpointing import manifest, retry
from tierstack.checkpointing.staging import Stager

log = logging.getLogger(__name__)


def stage_sharded_tensors(sharded_state_dict: dict, stager: Stager) -> None:
    """Copy every ``ShardedTensor``'s data into ``stager``'s buffers and point the tensors at them.

    Modifies ``sharded_state_dict`` in place (ShardedTensor factories are applied first, as
    ``dist_checkpointing.save`` would). After this, writing the dict reads only the buffers.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded_state_dict)
    shards = [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedTensor) and v.data is not None]
    buffers = stager.stage([s.data for s in shards])
    for shard, buf in zip(shards, buffers):
        shard.data = buf


def write_request(request, staging: Path, *, attempts: int, backoff_s: float) -> dict[str, dict]:
    """Writer thread: write this rank's buckets of a megatron ``AsyncRequest``, fsync'd.

    Transient I/O errors of a bucket are retried (``attempts`` in all, backoff doubling from
    ``backoff_s``); the bucket's file is rewritten whole. Then each file this rank wrote is
    checksummed (CRC-32C, from the page cache right after the write).

    Returns:
        ``{file name relative to staging: {"size", "crc32c"}}`` of this rank's files.

    Raises:
        The bucket's write error (OSError, ...) when it is permanent or attempts ran out.
    """
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    if request.async_fn is None:  # nothing to write on this rank
        return {}
    transform_list, _use_msc = request.async_fn.args
    _rank, buckets, results_queue = request.async_fn_args
    results: dict = {}
    for i, bucket in enumerate(buckets):
        for n in range(1, max(1, attempts) + 1):
            local, count = queue.Queue(), queue.Queue()
            count.put(i)
            FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True)
            _idx, out = local.get()
            if not isinstance(out, Exception):
                results[i] = out
                break
            if n >= attempts or retry.classify(out) != retry.TRANSIENT:
                raise out
            log.warning("GLOBAL write of %s, attempt %d failed (%s); retrying", bucket[1], n, out)
            time.sleep(backoff_s * 2 ** (n - 1))
    results_queue.put(results)
    return manifest.describe_files(staging, [bucket[1] for bucket in buckets])


def discard_results(request) -> None:
    """Drop this rank's write results from megatron's (process-wide) results queue, when a save
    is abandoned before megatron's finalize read them; the next save must not read stale ones."""
    if request.async_fn is None:
        return
    try:
        request.async_fn_args[2].get_nowait()
    except queue.Empty:
        pass
