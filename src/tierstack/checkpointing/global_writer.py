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
- early writeback: the disk starts writing each file while megatron's writer still fills it
  (:mod:`writeback`), so the final fsync waits only for the tail;
- checksums: each file this rank wrote is checksummed (CRC-32C) for the tier's manifest, from the
  page cache while the file's fsync runs (megatron's writer is asked not to fsync; ours does it
  beside the checksum, before the file's write result is reported), and the non-finite check of
  the staged buffers runs beside the write: on a sync save neither adds to the time training waits.

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
import os
import queue
import threading
import time
from pathlib import Path
from typing import Callable, Optional

from tierstack.checkpointing import errors, manifest, writeback
from tierstack.runtime import collectives as _dist
from tierstack.checkpointing.staging import Stager

log = logging.getLogger(__name__)


def stage_sharded_tensors(sharded_state_dict: dict, stager: Stager, *, in_place: bool = False) -> list:
    """Copy every ``ShardedTensor``'s data into ``stager``'s buffers and point the tensors at them.

    Modifies ``sharded_state_dict`` in place (ShardedTensor factories are applied first, as
    ``dist_checkpointing.save`` would). After this, writing the dict reads only the buffers.

    ``in_place``: the caller keeps the state unchanged until the write has ended (a sync save:
    training waits for it). Then, when every tensor is already on the host and owns its storage
    (:func:`writable_in_place`), nothing is copied: the write reads the tensors where they are, as
    ``torch.distributed.checkpoint.save`` and megatron's own sync save do, and the staging buffers
    are never allocated. Otherwise (a tensor on the GPU, or a view that megatron would clone on the
    training thread) everything is staged as without it.

    Returns:
        the tensors the write will read (the buffers, or the state's own tensors), in one list, for
        the non-finite check.
    """
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, apply_factories

    apply_factories(sharded_state_dict)
    shards = [v for v in nested_values(sharded_state_dict) if isinstance(v, ShardedTensor) and v.data is not None]
    if in_place and all(writable_in_place(s.data) for s in shards):
        for shard in shards:
            shard.data = shard.data.detach()
        return [s.data for s in shards]
    buffers = stager.stage([s.data for s in shards])
    for shard, buf in zip(shards, buffers):
        shard.data = buf
    return buffers


def writable_in_place(t) -> bool:
    """``t`` can be written as it is: on the host and the sole user of its storage (megatron's
    writer clones a CPU tensor whose storage is larger than itself, ``_clone_or_dequantize_if_needed``,
    and a GPU tensor needs a device-to-host copy)."""
    return t.device.type == "cpu" and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def plan(sd: dict, staging: Path, stager: Stager, strategy, *, in_place: bool, sharding) -> tuple:
    """Collective: stage ``sd``'s tensors (:func:`stage_sharded_tensors`; ``in_place`` for a sync
    save, whose training waits for the write) and let megatron-core plan the write into ``staging``
    with ``strategy``, its sharding validated when ``sharding``
    (:class:`~tierstack.checkpointing.sharding_check.ShardingValidation`) says so.

    Returns:
        megatron's ``AsyncRequest`` (for :func:`write_request`) and the tensors it writes.
    """
    from megatron.core import dist_checkpointing

    written = stage_sharded_tensors(sd, stager, in_place=in_place)
    start_results_channel(fresh=True)  # per save: a late writer never feeds the next one
    validate, signature = sharding.needed(sd)
    request = dist_checkpointing.save(
        sd, str(staging), sharded_strategy=strategy, async_sharded_save=True, validate_access_integrity=validate,
        async_strategy="mcore",  # threads, no clone of the staged buffers (module docstring)
    )
    sharding.passed(signature)
    return request, written


def write_request(request, staging: Path, *, attempts: int, backoff_s: float,
                  check: Optional[Callable[[], None]] = None) -> dict[str, dict]:
    """Writer thread: write this rank's files of a megatron ``AsyncRequest`` with megatron's threaded
    writer (one thread per bucket), each file fsync'd and checksummed at once (:func:`install_error_capture`).

    A transient I/O error of an attempt (classified by root cause, :mod:`errors`) is retried
    (``attempts`` in all, backoff doubling from ``backoff_s``); every file of this rank is rewritten
    whole. Each file is checksummed (CRC-32C, from the page cache while its fsync runs); a file
    whose checksum is missing is read again, also retried on a transient read error. Every failed
    attempt is logged with the rank, path and errno.

    ``check``: the non-finite check of the staged buffers, run on a thread of its own beside the
    write; its error (``NonFiniteStateError``) is raised in place of any write error, and the
    write results then never reach megatron's finalize.

    Returns:
        ``{file name relative to staging: {"size", "crc32c"}}`` of this rank's files.

    Raises:
        NonFiniteStateError: from ``check``.
        The write error (OSError, ...) when it is permanent or attempts ran out.
    """
    checking = _Beside(check) if check is not None else None
    try:
        if request.async_fn is None:  # nothing to write on this rank
            return {}
        return _write_and_describe(request, staging, attempts, backoff_s, checking)
    finally:
        if checking is not None:  # a non-finite state outranks how the write went
            checking.result()


class _Beside:
    """``fn()`` on a daemon thread of its own; :meth:`result` joins it and raises its error."""

    def __init__(self, fn: Callable[[], object]):
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(fn,), name="tierstack-beside", daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            fn()
        except BaseException as e:  # noqa: BLE001 - handed to result()
            self._error = e

    def result(self) -> None:
        self._thread.join()
        if self._error is not None:
            raise self._error


def _write_and_describe(request, staging: Path, attempts: int, backoff_s: float,
                        checking: Optional[_Beside]) -> dict[str, dict]:
    rank, buckets, results_queue = request.async_fn_args

    def write_all() -> dict:
        mine: queue.Queue = queue.Queue()  # this attempt's outcome only: a failed one never reaches finalize
        for bucket in buckets:
            _bucket_errors.pop(str(bucket[0]), None)
            _described.pop(str(bucket[0]), None)
        request.async_fn(rank, buckets, mine)
        out = _original_error(mine.get_nowait(), buckets)
        if isinstance(out, OSError) and out.filename is None:
            # a stream's write error carries no path: name the file when there is one, else the directory
            out.filename = str(buckets[0][0]) if len(buckets) == 1 else str(staging)
        if isinstance(out, BaseException):
            raise out
        return out

    results = _with_retries(write_all, f"GLOBAL write of {staging.name}", attempts, backoff_s)
    described = {bucket[1]: _described.pop(str(bucket[0]), None) for bucket in buckets}
    missing = [name for name, entry in described.items() if entry is None]
    if missing:
        described.update(_with_retries(lambda: manifest.describe_files(staging, missing),
                                       f"GLOBAL checksum of {staging.name}/{missing}", attempts, backoff_s))
    if checking is not None:
        checking.result()  # before finalize can read the results: a non-finite state is never sealed
    results_queue.put(results)
    return dict(sorted(described.items()))


# file path -> the exception megatron's per-file writer returned for it. megatron-core 0.19's threaded
# driver turns the error of the file it writes on the calling thread into a bare
# ``RuntimeError("An error is caught while starting worker ...")`` without its cause, losing the
# errno that decides whether a retry can help; :func:`install_error_capture` records the original.
_bucket_errors: dict[str, BaseException] = {}
# file path -> {"size", "crc32c"} of a file written, fsync'd and checksummed by the wrapper
_described: dict[str, dict] = {}


def install_error_capture() -> None:
    """Wrap megatron's per-file writer (``FileSystemWriterAsync.write_preloaded_data``, looked up on
    the class at call time). Idempotent. For each file (bucket) it writes:

    - the writer runs without its own fsync, with the file's write-out to the disk started while it
      writes (:class:`~tierstack.checkpointing.writeback.EarlyWriteback`); the wrapper then fsyncs
      the file on one thread while it checksums the file from the page cache on this one
      (:func:`_fsync_and_describe`), and
      keeps the entry by path for :func:`write_request`. Only then is the file's write result
      reported (megatron's worker threads report through its local queues, which the wrapper
      takes over), so no result reaches megatron before its file is durable;
    - the exception returned for a file, the writer's or the fsync's, is kept by path.
    """
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    real = FileSystemWriterAsync.write_preloaded_data
    if getattr(real, "__tierstack_capture__", False):
        return

    def capture(*args, **kwargs):
        bucket = kwargs.get("write_bucket", args[2] if len(args) > 2 else None)
        ours = bucket is not None and kwargs.get("use_fsync") is True and not kwargs.get("use_msc") and len(args) <= 1
        if not ours:  # a call shape this wrapper does not know: megatron's own behaviour
            out = real(*args, **kwargs)
        else:
            with writeback.EarlyWriteback(Path(bucket[0])):  # the disk works while the file is written
                out = real(*args, **{**kwargs, "use_fsync": False, "results_queue": None, "count_queue": None})
            if not _failed(out):
                try:
                    _described[str(bucket[0])] = _fsync_and_describe(Path(bucket[0]))
                except Exception as e:  # noqa: BLE001 - reported as megatron reports a write error
                    out = (kwargs.get("local_proc_idx", 0), e)
        if _failed(out) and bucket is not None:
            _bucket_errors[str(bucket[0])] = out[1]
        if ours and kwargs.get("results_queue") is not None:  # megatron's worker-thread protocol, after the fsync
            kwargs["results_queue"].put(out)
        if ours and kwargs.get("count_queue") is not None:
            kwargs["count_queue"].get()
            kwargs["count_queue"].task_done()
        return out

    capture.__tierstack_capture__ = True
    FileSystemWriterAsync.write_preloaded_data = staticmethod(capture)


def _failed(out) -> bool:
    return isinstance(out, tuple) and len(out) == 2 and isinstance(out[1], BaseException)


def _fsync_and_describe(path: Path) -> dict:
    """fsync ``path`` on a thread while its CRC-32C is computed here (both read the same page cache;
    the fsync waits on the disk): the file's manifest entry (:func:`manifest.describe_files`).
    Raises the fsync's OSError."""
    fd = os.open(path, os.O_RDONLY)
    try:
        syncing = _Beside(lambda: os.fsync(fd))
        try:
            entry = manifest.describe_files(path.parent, [path.name])[path.name]
        finally:
            syncing.result()
    finally:
        os.close(fd)
    return entry


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
