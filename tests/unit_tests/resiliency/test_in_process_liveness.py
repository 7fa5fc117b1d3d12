"""In-process restart's liveness thread against NVRx's real ``ProgressWatchdog`` thread: while the
main thread runs no Python (blocked in C, as in a gloo collective or a spare's store wait), every
progress message the watchdog sends still carries a fresh time. NVRx's own thread alone sends the
time its last pending call ran in the main thread, which goes stale for as long as the block lasts:
spares reached the soft timeout that way (goodput benchmark, 3 spares)."""

import time
from datetime import timedelta


def test_every_progress_message_is_fresh_while_the_main_thread_is_blocked():
    from nvidia_resiliency_ext.inprocess.progress_watchdog import ProgressWatchdog

    from tierstack.resiliency.in_process import PROGRESS_INTERVAL_S
    from tierstack.resiliency.liveness import Liveness

    sent = []

    class MonitorInbox:  # where NVRx's monitor process would receive the messages (send_timestamp)
        def send_timestamp(self, timestamp):
            sent.append((time.monotonic(), timestamp.auto))

    watchdog = ProgressWatchdog(0, MonitorInbox(), timedelta(seconds=0.05))
    watchdog.start()
    liveness = Liveness(watchdog, PROGRESS_INTERVAL_S)
    try:
        time.sleep(0.3)
        start = len(sent)
        time.sleep(3.0)  # in C: the main thread runs none of NVRx's pending calls meanwhile
        blocked = sent[start:]
    finally:
        liveness.close()
        watchdog.shutdown()
    assert len(blocked) > 40  # both threads sent while the main thread was blocked
    age = max(now - auto for now, auto in blocked)
    assert age < 1.0, f"a progress message {age:.2f} s old was sent while the process ran"


def test_after_an_abort_nothing_vouches_for_a_main_thread_still_blocked():
    """Once the abort began (``vouch()`` false), the messages carry the time of the last vouch, so
    a main thread that stays blocked in C meets NVRx's timeouts like a hung rank; at the next
    attempt (``vouch()`` true again) they are fresh again."""
    from nvidia_resiliency_ext.inprocess.progress_watchdog import ProgressWatchdog

    from tierstack.resiliency.in_process import PROGRESS_INTERVAL_S
    from tierstack.resiliency.liveness import Liveness

    sent, aborted = [], [False]

    class MonitorInbox:
        def send_timestamp(self, timestamp):
            sent.append((time.monotonic(), timestamp.auto))

    watchdog = ProgressWatchdog(0, MonitorInbox(), timedelta(seconds=0.05))
    watchdog.start()
    liveness = Liveness(watchdog, PROGRESS_INTERVAL_S, vouch=lambda: not aborted[0])
    try:
        time.sleep(0.5)
        aborted[0] = True
        start = len(sent)
        time.sleep(2.0)  # in C, after the abort
        after_abort = sent[start:]
        aborted[0] = False
        time.sleep(0.5)
        start = len(sent)
        time.sleep(1.0)
        next_attempt = sent[start:]
    finally:
        liveness.close()
        watchdog.shutdown()
    assert max(now - auto for now, auto in after_abort) > 1.5  # stale: the monitor process times it out
    assert max(now - auto for now, auto in next_attempt) < 1.0
