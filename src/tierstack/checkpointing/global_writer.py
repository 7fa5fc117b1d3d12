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

The write results travel through megatron's module-level results queue, which megatron creates as
a queue served by a spawned multiprocessing Manager: a process per rank that imports torch when it
first unpickles a result (about 5 s of CPU on this machine, at every start and restart), outlives a
killed rank unless watched, and dies on a job-wide SIGTERM that the rank turns into a planned exit
that still needs it. Since every write here runs on a thread of the rank itself, the queue only
ever crosses threads: :func:`start_results_channel` puts a plain ``queue.Queue`` in its place.
"""

from __future__ import annotations

import logging
import queue
import time
from pathlib import Path

from tierstack.checkpointing import errors, manifest
from tierstack.runtime import collectives as _dist
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

    Transient I/O errors (classified by root cause, :mod:`errors`) of a bucket are retried
    (``attempts`` in all, backoff doubling from ``backoff_s``); the bucket's file is rewritten
    whole. Then each file this rank wrote is checksummed (CRC-32C, from the page cache right after
    the write), also retried on a transient read error. Every failed attempt is logged with the
    rank, path and errno.

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

    def write_bucket(i: int, bucket) -> None:
        local, count = queue.Queue(), queue.Queue()
        count.put(i)
        FileSystemWriterAsync.write_preloaded_data(transform_list, i, bucket, local, count, True)
        _idx, out = local.get()
        if isinstance(out, OSError) and out.filename is None:
            out.filename = str(bucket[0])  # a stream's write error carries no path: name the file
        if isinstance(out, Exception):
            raise out
        results[i] = out

    for i, bucket in enumerate(buckets):
        _with_retries(lambda: write_bucket(i, bucket), f"GLOBAL write of {bucket[1]}", attempts, backoff_s)
    results_queue.put(results)
    names = [bucket[1] for bucket in buckets]
    return _with_retries(lambda: manifest.describe_files(staging, names),
                         f"GLOBAL checksum of {staging.name}/{names}", attempts, backoff_s)


def _with_retries(fn, what: str, attempts: int, backoff_s: float):
    """Run ``fn`` on this (writer) thread, again after a transient error; return its result."""
    for n in range(1, max(1, attempts) + 1):
        try:
            out = fn()
        except Exception as e:  # noqa: BLE001 - classified: only transient ones are retried
            if n >= attempts or errors.classify(e) != errors.TRANSIENT:
                raise
            log.warning("%s on rank %d, attempt %d failed (%s); retrying", what, _dist.rank(), n, errors.describe(e))
            time.sleep(backoff_s * 2 ** (n - 1))
            continue
        if n > 1:
            log.warning("%s on rank %d: attempt %d succeeded", what, _dist.rank(), n)
        return out
    raise AssertionError("unreachable")


def discard_results(request) -> None:
    """Empty megatron's (process-wide) results queue of this rank's write results, when a save is
    dropped before megatron's finalize read them: the next save must not read stale ones (with
    one save in flight, nothing else can be in it)."""
    if request.async_fn is None or request.async_fn_args[2] is None:
        return
    while True:
        try:
            request.async_fn_args[2].get_nowait()
        except queue.Empty:
            return


def start_results_channel() -> "queue.Queue":
    """megatron-core's write-results queue (``filesystem_async._results_queue``), set to an
    in-process ``queue.Queue`` before megatron would start its Manager for it (see the module
    docstring). Idempotent; a Manager-served queue left by other code is replaced (results of a
    save are read by the finalize of the same save, so nothing pending is lost at a tier's start)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()
    return filesystem_async._results_queue


def shutdown_results_channel() -> None:
    """Drop megatron-core's write-results queue (the next GLOBAL tier starts a fresh one)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = None
