"""When a process counts as damaged under in-process restart (``RepeatedFailure``): its own error,
before the first step, the same as its previous attempt's. Anything else keeps it in the job."""

from tierstack.resiliency.repeated_failure import RepeatedFailure


def _error(message="partially initialized module 'torch._dynamo' has no attribute 'utils'"):
    return AttributeError(message)


def test_the_same_own_error_before_the_first_step_twice_in_a_row_is_repeated():
    failures = RepeatedFailure()
    assert not failures.is_repeated(_error(), before_first_step=True, interrupted=False)
    assert failures.is_repeated(_error(), before_first_step=True, interrupted=False)


def test_a_different_error_a_step_done_or_an_interruption_is_not():
    failures = RepeatedFailure()
    failures.is_repeated(_error(), True, False)
    assert not failures.is_repeated(_error("module 'sympy' has no attribute 'core'"), True, False)
    assert not failures.is_repeated(RuntimeError("module 'sympy' has no attribute 'core'"), True, False)

    failures = RepeatedFailure()
    failures.is_repeated(_error(), True, False)
    failures.succeeded()  # the attempt between reached its first step
    assert not failures.is_repeated(_error(), True, False)

    failures = RepeatedFailure()
    failures.is_repeated(_error(), True, False)
    assert not failures.is_repeated(_error(), before_first_step=False, interrupted=False)  # a fault in training
    assert not failures.is_repeated(_error(), True, False)  # the one before it did not count

    failures = RepeatedFailure()
    failures.is_repeated(RuntimeError("Connection closed by peer"), True, interrupted=True)
    assert not failures.is_repeated(RuntimeError("Connection closed by peer"), True, interrupted=True)
