"""Root-cause classification through the layers megatron-core and torch wrap a write error in."""

import errno
import pickle

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from tierstack.checkpointing import errors, rank0_phases, retry


def _worker_failure(code: int, path: str = "/ckpt/iter_0000004.staging-r-1/__1_0.distcp") -> RuntimeError:
    """What megatron-core 0.16.1's ``retrieve_write_results`` builds, after a trip through pickle
    (``gather_object`` to the coordinator), which drops ``__cause__``."""
    try:
        raise RuntimeError(f"Worker failure: {OSError(code, 'x', path)}") from OSError(code, "x", path)
    except RuntimeError as e:
        return pickle.loads(pickle.dumps(e))


@pytest.mark.parametrize("code,outcome", [(errno.EIO, errors.TRANSIENT), (errno.EAGAIN, errors.TRANSIENT),
                                          (errno.ESTALE, errors.TRANSIENT), (errno.ENOSPC, errors.PERMANENT),
                                          (errno.EACCES, errors.PERMANENT), (errno.EROFS, errors.PERMANENT)])
def test_worker_failure_inside_checkpoint_exception(code, outcome):
    wrapped = _worker_failure(code)
    assert wrapped.__cause__ is None  # only the text survived
    assert errors.classify(wrapped) == outcome
    coordinator = CheckpointException("write", {1: (wrapped, None)})
    assert errors.classify(coordinator) == outcome
    text = errors.describe(coordinator)
    assert errno.errorcode[code] in text and "__1_0.distcp" in text and "rank 1" in text


def test_failure_of_another_rank_defers_to_its_cause():
    elsewhere = CheckpointException("write", {})  # what non-coordinator ranks raise
    assert errors.classify(elsewhere) == errors.REMOTE
    seen = []
    worst = max(errors.classify(elsewhere), errors.classify(CheckpointException("write", {1: (_worker_failure(5), None)})))
    with pytest.raises(retry.SaveAttemptFailed) as info:
        retry.agree(elsewhere, reduce_max=lambda v: seen.append(v) or worst)
    assert info.value.transient and seen == [errors.REMOTE]
    # nobody knows a cause: permanent
    with pytest.raises(retry.SaveAttemptFailed) as info:
        retry.agree(elsewhere)
    assert info.value.outcome == errors.PERMANENT


def test_not_retryable_wins_over_a_transient_errno():
    try:
        raise errors.NotRetryable("writer retries spent") from OSError(errno.EIO, "x")
    except errors.NotRetryable as e:
        assert errors.classify(e) == errors.PERMANENT and "EIO" in errors.describe(e)


def test_rank0_write_errors_are_deferred_and_rerun():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) == 1:
            raise OSError(errno.EIO, "x", "/ckpt/.metadata")

    wrapped = rank0_phases._deferrable(flaky, "metadata")
    pending = rank0_phases.Deferred()
    calls.clear()
    with pytest.raises(OSError):
        with rank0_phases.deferring(pending):
            wrapped()
            calls.append("went on")  # the collectives after the write still run
    assert calls == [1, "went on"] and len(pending.calls) == 1
    pending.rerun()
    assert calls == [1, "went on", 1] and not pending.calls


def _raised(outer: BaseException, *, cause: BaseException = None, context: BaseException = None) -> BaseException:
    """``outer`` as Python leaves it when raised ``from cause`` or while handling ``context``."""
    try:
        if context is not None:
            try:
                raise context
            except BaseException:
                raise outer
        raise outer from cause
    except BaseException as e:
        return e


EIO, ENOSPC = (errno.EIO, "x", "/ckpt/a"), (errno.ENOSPC, "x", "/ckpt/b")


@pytest.mark.parametrize("chain", [
    lambda: _raised(OSError(*EIO), cause=OSError(*ENOSPC)),
    lambda: _raised(OSError(*ENOSPC), cause=OSError(*EIO)),
    lambda: _raised(OSError(*EIO), context=OSError(*ENOSPC)),  # a cleanup error raised inside another
    lambda: _raised(OSError(*ENOSPC), context=OSError(*EIO)),
    lambda: CheckpointException("write", {0: (_worker_failure(errno.EIO), None), 1: (_worker_failure(errno.ENOSPC), None)}),
    lambda: CheckpointException("write", {0: (_worker_failure(errno.ENOSPC), None), 1: (_worker_failure(errno.EIO), None)}),
    # the coordinator gathered a transient error of rank 0 and a bug (no errno) of rank 1
    lambda: CheckpointException("write", {0: (_worker_failure(errno.EIO), None), 1: (TypeError("bug"), None)}),
    # an inner step already said "never retry", under a wrapper that keeps only a transient errno
    lambda: _raised(RuntimeError("Worker failure"), cause=_raised(errors.NotRetryable("spent"), cause=OSError(*EIO))),
])
def test_any_permanent_cause_in_a_mixed_chain_makes_the_failure_permanent(chain):
    exc = chain()
    assert errors.classify(exc) == errors.PERMANENT
    with pytest.raises(retry.SaveAttemptFailed) as info:
        retry.agree(exc)
    assert not info.value.transient


@pytest.mark.parametrize("chain", [
    lambda: _raised(OSError(errno.EIO, "x"), cause=OSError(errno.ESTALE, "y")),
    lambda: _raised(OSError(errno.EAGAIN, "x"), context=OSError(errno.EINTR, "y")),
    lambda: CheckpointException("write", {0: (_worker_failure(errno.EIO), None), 1: (_worker_failure(errno.ESTALE), None)}),
])
def test_a_chain_of_transient_causes_only_stays_transient(chain):
    assert errors.classify(chain()) == errors.TRANSIENT
