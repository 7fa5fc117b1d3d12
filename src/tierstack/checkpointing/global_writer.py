"""How the GLOBAL tier feeds megatron-core's torch_dist writer from reused staging buffers, and runs
megatron's threaded writer on our writer thread with retries.

megatron-core 0.19 (``dist_checkpointing.save(..., async_sharded_save=True, async_strategy="mcore")``)
returns an ``AsyncRequest`` whose ``async_fn`` is ``FileSystemWriterAsync.write_preloaded_data_multithread``:
it writes each bucket (file) of this rank on a thread of its own, with fsync, and puts the write
results (or the first error) into a results queue. What tierstack adds around it:

- staging: the write plan resolves each ``ShardedTensor.data``; replacing them by the tier's reused
  staging buffers (each with its own storage, so megatron's ``_clone_or_dequantize_if_needed`` does not
  clone them, and already on the host, so there is nothing to preload) makes the plan read from the
  buffers, which the non-finite guard checks and the next save refills in place;
- retries: a transient error (EIO, ESTALE, ...) of an attempt rewrites this rank's files whole, each
  attempt reporting into a queue of its own; only the successful attempt's results reach the
  request's results queue, which megatron's finalize reads;
- checksums: each file this rank wrote is checksummed (CRC-32C) for the tier's manifest.

Why ``async_strategy="mcore"`` and not the default ``"nvrx"``: nvidia-resiliency-ext 0.7's
``FileSystemWriterAsync.prepare_write_data`` clones every CPU tensor on the training thread
(``_clone_or_dequantize_if_needed``: ``ten.clone()`` for any CPU tensor unless its CPU shared-memory
mode is on), so a save would copy the state twice while training waits. megatron-core marks its own
path deprecated (a warning at the first save, filtered by ``runtime.known_warnings``); it is in every
0.19.x release, which is what ``pyproject.toml`` admits.

The write results travel through megatron's module-level results queue, which megatron creates as
a queue served by a spawned multiprocessing Manager: a process per rank that imports torch when it
first unpickles a result (about 5 s of CPU on this machine, at every start and restart), outlives a
killed rank unless watched, and dies on a job-wide SIGTERM that the rank turns into a planned exit
that still needs it. Since every write here runs on threads of the rank itself, the queue only
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
    """Writer thread: write this rank's files of a megatron ``AsyncRequest`` with megatron's threaded
    writer (one thread per bucket, fsync'd), then checksum them.

    A transient I/O error of an attempt (classified by root cause, :mod:`errors`) is retried
    (``attempts`` in all, backoff doubling from ``backoff_s``); every file of this rank is rewritten
    whole. Then each file this rank wrote is checksummed (CRC-32C, from the page cache right after
    the write), also retried on a transient read error. Every failed attempt is logged with the
    rank, path and errno.

    Returns:
        ``{file name relative to staging: {"size", "crc32c"}}`` of this rank's files.

    Raises:
        The write error (OSError, ...) when it is permanent or attempts ran out.
    """
    if request.async_fn is None:  # nothing to write on this rank
        return {}
    rank, buckets, results_queue = request.async_fn_args

    def write_all() -> dict:
        mine: queue.Queue = queue.Queue()  # this attempt's outcome only: a failed one never reaches finalize
        for bucket in buckets:
            _bucket_errors.pop(str(bucket[0]), None)
        request.async_fn(rank, buckets, mine)
        out = _original_error(mine.get_nowait(), buckets)
        if isinstance(out, OSError) and out.filename is None:
            # a stream's write error carries no path: name the file when there is one, else the directory
            out.filename = str(buckets[0][0]) if len(buckets) == 1 else str(staging)
        if isinstance(out, BaseException):
            raise out
        return out

    results = _with_retries(write_all, f"GLOBAL write of {staging.name}", attempts, backoff_s)
    results_queue.put(results)
    names = [bucket[1] for bucket in buckets]
    return _with_retries(lambda: manifest.describe_files(staging, names),
                         f"GLOBAL checksum of {staging.name}/{names}", attempts, backoff_s)


# file path -> the exception megatron's per-file writer returned for it. megatron-core 0.19's threaded
# driver turns the error of the file it writes on the calling thread into a bare
# ``RuntimeError("An error is caught while starting worker ...")`` without its cause, losing the
# errno that decides whether a retry can help; :func:`install_error_capture` records the original.
_bucket_errors: dict[str, BaseException] = {}


def install_error_capture() -> None:
    """Wrap megatron's per-file writer (``FileSystemWriterAsync.write_preloaded_data``, looked up on
    the class at call time) so the exception it returns for a file is kept by path. Idempotent."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    real = FileSystemWriterAsync.write_preloaded_data
    if getattr(real, "__tierstack_capture__", False):
        return

    def capture(*args, **kwargs):
        out = real(*args, **kwargs)
        bucket = kwargs.get("write_bucket", args[2] if len(args) > 2 else None)
        if isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], BaseException) and bucket is not None:
            _bucket_errors[str(bucket[0])] = out[1]
        return out

    capture.__tierstack_capture__ = True
    FileSystemWriterAsync.write_preloaded_data = staticmethod(capture)


def _original_error(out, buckets):
    """``out`` itself, unless it is megatron's cause-less wrapper of a file's error: then that error."""
    if not isinstance(out, BaseException) or getattr(out, "errno", None) is not None:
        return out
    for bucket in buckets:
        original = _bucket_errors.pop(str(bucket[0]), None)
        if original is not None:
            return original
    return out


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


def start_results_channel(fresh: bool = False) -> "queue.Queue":
    """megatron-core's write-results queue (``filesystem_async._results_queue``), set to an
    in-process ``queue.Queue`` before megatron would start its Manager for it (see the module
    docstring). A Manager-served queue left by other code is replaced.

    ``fresh``: a new queue even when one is there. The GLOBAL tier asks for one per save, before
    megatron plans it, so each save's request holds a queue of its own: a writer abandoned after its
    timeout that unblocks later puts its results into its own save's queue, which nobody reads, and
    never into the next save's (whose finalize would otherwise read the stale results and lag by one).
    """
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    install_error_capture()
    if fresh or not isinstance(filesystem_async._results_queue, queue.Queue):
        filesystem_async._results_queue = queue.Queue()
    return filesystem_async._results_queue


def shutdown_results_channel() -> None:
    """Drop megatron-core's write-results queue (the next GLOBAL tier starts a fresh one)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    filesystem_async._results_queue = None
