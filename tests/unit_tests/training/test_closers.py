"""Closers: every resource closes, a failing closer never hides the error that ended the run."""

import contextlib
import logging

import pytest

from tierstack.training.closers import register


def test_error_in_flight_is_kept_and_every_closer_runs(caplog):
    closed = []

    def failing_close():
        closed.append("manager")
        raise RuntimeError("final publish failed")

    with pytest.raises(ValueError, match="setup broke"):
        with contextlib.ExitStack() as stack:
            register(stack, "process groups", lambda: closed.append("groups"))
            register(stack, "mlflow run", lambda status: closed.append(f"mlflow {status}"), with_status=True)
            register(stack, "checkpoint manager", failing_close)
            register(stack, "straggler monitor", lambda: closed.append("straggler"))
            raise ValueError("setup broke")
    assert closed == ["straggler", "manager", "mlflow FAILED", "groups"]
    assert "closing checkpoint manager failed" in caplog.text and "final publish failed" in caplog.text


def test_closer_failure_is_raised_when_nothing_else_is_in_flight():
    statuses = []
    with pytest.raises(RuntimeError, match="final publish failed"):
        with contextlib.ExitStack() as stack:
            register(stack, "mlflow run", statuses.append, with_status=True)
            register(stack, "checkpoint manager", lambda: (_ for _ in ()).throw(RuntimeError("final publish failed")))
    assert statuses == ["FAILED"]  # the run did not end well: mlflow says so


def test_clean_exit_finishes_and_ctrl_c_is_killed():
    statuses = []
    with contextlib.ExitStack() as stack:
        register(stack, "mlflow run", statuses.append, with_status=True)
    with pytest.raises(KeyboardInterrupt):
        with contextlib.ExitStack() as stack:
            register(stack, "mlflow run", statuses.append, with_status=True)
            raise KeyboardInterrupt
    assert statuses == ["FINISHED", "KILLED"]


def test_with_error_hands_the_error_in_flight_to_the_closer():
    got: list = []
    with contextlib.ExitStack() as stack:
        register(stack, "checkpoint manager", got.append, with_error=True)
    with pytest.raises(KeyError):
        with contextlib.ExitStack() as stack:
            register(stack, "checkpoint manager", got.append, with_error=True)
            raise KeyError("rank 1 only")
    assert got[0] is None and isinstance(got[1], KeyError)


class _Interruption(BaseException):
    """Like NVRx in-process restart's RankShouldRestart: raised into the main thread from outside."""


def test_an_interruption_raised_in_a_closer_is_never_swallowed_by_the_error_in_flight():
    import contextlib

    from tierstack.training.closers import register

    closed = []

    def interrupted():
        raise _Interruption("restart")

    with pytest.raises(_Interruption) as err:
        with contextlib.ExitStack() as stack:
            register(stack, "first", lambda: closed.append("first"))
            register(stack, "interrupted", interrupted)
            raise RuntimeError("a peer is gone")
    assert isinstance(err.value.__context__, RuntimeError) and closed == ["first"]  # the rest still closed


def test_interrupts_is_true_for_interruptions_and_not_for_failures():
    from tierstack.runtime.failures import interrupts

    class CheckpointException(BaseException):  # torch's has this name and base: a failed save
        pass

    assert interrupts(_Interruption()) and interrupts(KeyboardInterrupt()) and interrupts(SystemExit(1))
    assert not interrupts(RuntimeError()) and not interrupts(CheckpointException())
