"""Small collective helpers that return values, for every package above ``runtime``.

Every function is a no-op reduction when torch.distributed is off, so the pure parts of the
checkpointing, resiliency and training code run in single-process tests. Each is a sync point.
A helper whose collective fails (a peer is gone, or hung past the group's timeout: see
:func:`bounded`) raises :class:`CollectiveError`, whatever the backend called it.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable, Iterator, Optional, TypeVar

import torch
import torch.distributed as dist


F = TypeVar("F", bound=Callable[..., Any])


class CollectiveError(RuntimeError):
    """A collective failed or timed out: a rank is gone or hung.

    The process group can no longer be trusted, so callers never retry on it; every other rank
    sees the same within the group's timeout (``checkpoint.collective_timeout_s`` inside
    :func:`bounded`, else ``distributed.timeout_s``).
    """


def _guarded(fn: F) -> F:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CollectiveError:
            raise
        except RuntimeError as e:  # gloo/NCCL timeouts and closed connections; torch's DistError
            raise CollectiveError(f"{fn.__name__} failed ({e}); a rank is gone or hung") from e

    return wrapper  # type: ignore[return-value]


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_distributed() else 0


def rank_label() -> int:
    """This process's rank for a log message: the group's, else ``$RANK`` (e.g. after an in-process
    restart's abort released the groups while the rank was still closing; :func:`rank` says 0 then)."""
    if is_distributed():
        return dist.get_rank()
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def world_size() -> int:
    return dist.get_world_size() if is_distributed() else 1


def _device() -> torch.device:
    from tierstack.runtime.devices import device

    return device()


@_guarded
def all_reduce_max(value: int) -> int:
    """Largest ``value`` over all ranks (a sync point)."""
    if not is_distributed():
        return int(value)
    t = torch.tensor([int(value)], dtype=torch.int64, device=_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


@_guarded
def all_reduce_max_table(table: torch.Tensor) -> torch.Tensor:
    """Element-wise maximum over all ranks of an integer ``table`` (any shape), on the CPU (a sync
    point). Ranks fill their own rows and zeros elsewhere, so one call tells every rank every rank's
    findings."""
    if not is_distributed():
        return table.clone()
    t = table.to(_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.cpu()


def ranks_where(flag: bool) -> list[int]:
    """The ranks on which ``flag`` holds, the same list on every rank (one all-reduce of
    world-size integers; a sync point)."""
    flags = torch.zeros(world_size(), 1, dtype=torch.int64)
    flags[rank()] = int(bool(flag))
    return [r for r, (f,) in enumerate(all_reduce_max_table(flags).tolist()) if f]


def any_true(flag: bool) -> bool:
    """True on every rank when ``flag`` holds on any rank (a sync point)."""
    return all_reduce_max(1 if flag else 0) == 1


def all_true(flag: bool) -> bool:
    """True only when ``flag`` holds on every rank (a sync point)."""
    return all_reduce_max(0 if flag else 1) == 0


@_guarded
def all_gather_object(obj: Any) -> list[Any]:
    """Every rank's ``obj`` (picklable), indexed by rank, on every rank."""
    if not is_distributed():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@_guarded
def broadcast_object(obj: Any, src: int = 0) -> Any:
    """Rank ``src``'s ``obj`` (picklable), on every rank."""
    if not is_distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


@_guarded
def barrier() -> None:
    if is_distributed():
        dist.barrier()


_checkpoint_groups: list = []  # groups a checkpoint created for itself (register_checkpoint_group)


def register_checkpoint_group(group) -> None:
    """Bound ``group``'s collectives like every other checkpoint collective (:func:`bounded`).

    For the process groups a checkpoint feature creates for its own exchanges (LOCAL replication's
    cliques, created by nvidia-resiliency-ext with torch's default timeout): inside a
    :func:`bounded` block the group gets that block's timeout at once; afterwards it follows every
    block, and gets ``distributed.timeout_s`` back between them.
    """
    if group is None or any(g is group for g in _checkpoint_groups):
        return
    _checkpoint_groups.append(group)
    seconds = _bounded_timeout_s if _bounded_depth else training_timeout_s
    if seconds is not None and is_distributed():
        _set_timeout(seconds, [group])


def set_group_timeout(group, seconds: float) -> None:
    """Give ``group``'s collectives a fixed timeout of ``seconds`` (a group that :func:`bounded`
    does not touch: one used off the training thread, such as the LOCAL writers' replication)."""
    if group is not None and is_distributed():
        _set_timeout(seconds, [group])


def _groups() -> list:
    """The process groups a checkpoint uses: WORLD, megatron's data-parallel group (the fully
    parallel save and load exchange over it) when model parallelism is initialised, and the groups
    registered with :func:`register_checkpoint_group`."""
    groups = [None] + list(_checkpoint_groups)
    try:
        from megatron.core import parallel_state

        if parallel_state.model_parallel_is_initialized():
            groups.append(parallel_state.get_data_parallel_group(with_context_parallel=True))
    except Exception:  # noqa: BLE001 - no megatron state: WORLD only
        pass
    return groups


def _set_timeout(seconds: float, groups: Optional[list] = None) -> None:
    from datetime import timedelta

    from torch.distributed.distributed_c10d import _set_pg_timeout

    for g in _groups() if groups is None else groups:
        try:
            _set_pg_timeout(timedelta(seconds=seconds), g)
        except (RuntimeError, ValueError, AssertionError) as e:  # a backend without per-group timeouts
            import logging

            logging.getLogger(__name__).debug("cannot set the timeout of %s: %s", g, e)


training_timeout_s: Optional[float] = None  # distributed.timeout_s, set by runtime.initialize_distributed
_bounded_depth = 0
_bounded_timeout_s: Optional[float] = None  # the bound of the outermost active block


@contextlib.contextmanager
def bounded(timeout_s: Optional[float], restore_s: Optional[float] = None) -> Iterator[None]:
    """Every collective inside (ours and megatron-core's) times out after ``timeout_s`` seconds.

    A checkpoint's collectives are short (agreements, metadata exchange, the polls of a writer
    wait), so a peer that does not arrive within ``checkpoint.collective_timeout_s`` is gone or
    hung; waiting for the training timeout (``distributed.timeout_s``, sized for slow steps) would
    only delay the error. Nested blocks keep the outer bound; on exit the groups get ``restore_s``
    back (default: the ``distributed.timeout_s`` the process groups were created with). No-op
    without torch.distributed, with ``timeout_s`` None, or when nothing is known to restore.
    """
    global _bounded_depth, _bounded_timeout_s
    restore_s = restore_s if restore_s is not None else training_timeout_s
    if timeout_s is None or restore_s is None or not is_distributed():
        yield
        return
    _bounded_depth += 1
    if _bounded_depth == 1:
        _bounded_timeout_s = timeout_s
        _set_timeout(timeout_s)
    try:
        yield
    finally:
        _bounded_depth -= 1
        if _bounded_depth == 0 and is_distributed():
            _set_timeout(restore_s)


@contextlib.contextmanager
def io_phase(io_wait_s: Optional[float]) -> Iterator[None]:
    """Inside a :func:`bounded` block: the collectives that wait for a peer's whole-file I/O (a LOCAL
    file read and checksummed at resume, replicas written before the agreement) wait ``io_wait_s``
    more than the block's bound, then get the block's bound back.

    Collective timeouts bound a peer that is gone or hung; a peer still reading a large file is
    neither. On gloo a timeout raises on every rank (:class:`CollectiveError`); on NCCL the watchdog
    aborts the process instead, so such a wait must never be cut by ``checkpoint.collective_timeout_s``.
    No-op outside a bounded block or with ``io_wait_s`` None (each rank sets its own groups: call it on
    every rank before the I/O starts, so the peers already waiting have the longer bound).
    """
    if io_wait_s is None or not _bounded_depth or _bounded_timeout_s is None or not is_distributed():
        yield
        return
    _set_timeout(_bounded_timeout_s + io_wait_s)
    try:
        yield
    finally:
        if is_distributed():
            _set_timeout(_bounded_timeout_s)
