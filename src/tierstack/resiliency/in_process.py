"""In-process restart: healthy ranks keep their processes; a dead one is replaced by a warm spare.

Engine: nvidia-resiliency-ext's ``inprocess.Wrapper`` (NVRx 0.7; what Megatron-LM's
``--inprocess-restart`` uses). Chosen over torchft because it restarts the whole training function
on a rebuilt world (any TP/PP/DP layout of megatron-core, whose parallel state is process-global),
brings its own rank reassignment with spare ranks, hang detection (a monitor process per rank)
and store-based interruption; torchft recovers data-parallel replicas only.

What happens on a failure (an exception on some rank, a rank that died, or one without progress
for ``resiliency.heartbeat_timeout_s``):

1. NVRx records the interruption in the job's store; every rank's monitor thread sees it and runs
   the abort (:class:`_ReleaseGroups`): megatron's groups and WORLD are destroyed and collected.
   A gloo collective cannot be aborted, but destroying a group closes this rank's connections,
   so a peer blocked on it fails at once (``runtime.release_distributed``).
2. The main thread gets NVRx's ``RankShouldRestart``; ``pretrain``'s closers run as for any error.
3. The ranks meet in NVRx's iteration barrier; a rank that died is replaced by a spare of its
   own node (:func:`~tierstack.resiliency.spares.rank_assignment`: every healthy rank keeps its rank, so its in-memory LOCAL
   state is its own), and the training function runs again, in the same processes, on new process groups whose
   store keys carry the attempt's number (:func:`tierstack.runtime.attempt_store.use_attempt_store`).
4. Resume selection agrees on one step as on any start; a healthy rank takes it from host memory
   (:mod:`tierstack.checkpointing.local_memory`), a replaced one from its file.

Under torchrun each worker is a rank slot (:mod:`tierstack.resiliency.rank_slot`), so that a rank
process that dies does not make the agent stop the healthy ones.

Why each choice, measured on 2 CPU ranks (README, "In-process restart"): NVRx's defaults
(``last_call_wait`` 1 s, monitor intervals 1 s) cost seconds per restart; they are tuned here.
"""

from __future__ import annotations

import logging
import os
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch.distributed as dist

from tierstack.config import ConfigContainer, ConfigError
from tierstack.resiliency import rank_slot, restarts, signals, spares, warm_spare
from tierstack.resiliency.liveness import Liveness
from tierstack.resiliency.repeated_failure import RepeatedFailure
from tierstack.runtime import attempt_store

log = logging.getLogger(__name__)

STOPPED_KEY = "planned_exit_served"  # in the job store: a run ended with a planned exit (its reason)
AGREED_STOP_KEY = "agreed_stop"  # in the job store: the ranks ended the job with an AgreedStop (its error)
_attempt = 0  # this process's current in-process restart number (restart_number)

_ROOT = "tierstack/inprocess"
MONITOR_PROCESS_INTERVAL_S = 0.1  # how often each rank's monitor process looks at its rank (a death)
MONITOR_THREAD_INTERVAL_S = 0.05  # the monitor thread's loop (bounds its shutdown at each restart)
PROGRESS_INTERVAL_S = 0.1  # the watchdog thread's progress pings
LAST_CALL_WAIT_S = 0.05  # after the first interruption, time for others to report theirs (NVRx: 1 s)
TERMINATION_GRACE_S = 0.2  # SIGTERM to SIGKILL of a rank that hung past the hard timeout


class RestartLimitReached(BaseException):
    """More in-process restarts than ``resiliency.max_in_process_restarts``, or fewer ranks left
    than the run trains on (no spare left to replace a dead one): the job ends, with an error
    status, so the launcher's restart (``torchrun --max-restarts``) takes over if there is one.
    A BaseException, so NVRx does not take it for one more failure to restart from."""

    exit_status = 1


class AgreedStop(RestartLimitReached):
    """An error every rank raised together after agreeing on it (:func:`~tierstack.errors.raised_on_every_rank`:
    bad input, ``checkpoint.on_nonfinite=stop``, ``checkpoint.exit_on_save_failure``): a decision
    of the run, not a fault, and it would come back after every restart. The job ends at once
    (exit status 2 for bad input, as without in-process restart, else 1), instead of burning
    ``resiliency.max_in_process_restarts`` attempts on it."""

    def __init__(self, error: BaseException):
        from tierstack.errors import BadInputError

        super().__init__(f"{summary(error)} (raised on every rank: not restarted in-process)")
        self.exit_status = 2 if isinstance(error, BadInputError) else 1


def summary(error: BaseException) -> str:
    """``"<type>: <message>"`` of an error that ends the job, or only ``"<type> (bad input, said above
    by rank 0)"`` when rank 0 already printed its message (:func:`~tierstack.errors.say_once`): the
    lines each rank, NVRx and a woken spare print about the stop then do not repeat a refusal of
    many lines (a changed model's list of fields) five times after it."""
    if getattr(error, "said", False):
        return f"{type(error).__name__} (bad input, said above by rank 0)"
    return f"{type(error).__name__}: {error}"


def check(config: ConfigContainer, processes: int, environ: Optional[dict] = None) -> None:
    """Refuse, before any work, an in-process restart that cannot work (names the field).

    Args:
        processes: processes the launcher started (torchrun's ``WORLD_SIZE``; spares included).

    Raises:
        ConfigError: every problem of the config for ``processes - resiliency.spare_ranks`` active
            ranks, and of the launch (:meth:`ResiliencyConfig.launcher_problems`).
    """
    r = config.resiliency
    problems = r.launcher_problems(processes, environ)
    if r.spare_split_problems(processes, environ):  # the ranks that train are unknown: nothing else to check
        raise ConfigError(problems)
    try:
        config.validate(max(1, processes - max(0, r.spare_ranks)), ranks_per_node=r.active_ranks_per_node(
            processes, environ), check_paths=False)
    except ConfigError as e:
        problems = list(e.problems) + problems
    if not r.in_process:
        problems.append(f"resiliency.restart={r.restart!r}: this entry point runs in-process restart only; "
                        "set resiliency.restart=in-process")
    if problems:
        raise ConfigError(problems)


def run(config: ConfigContainer, train: Callable[[ConfigContainer], Any],
        rehearse: Optional[Callable[[ConfigContainer], Any]] = None) -> int:
    """Run ``train(config)`` under in-process restart in this torchrun worker; returns its exit status.

    Every worker of the job calls this (the spares too: torchrun starts ``active + spare_ranks``).
    The worker becomes a rank slot and forks the rank; the rank runs ``train`` inside NVRx's
    wrapper, again after every failure, up to ``resiliency.max_in_process_restarts`` times.
    ``rehearse`` (e.g. ``pretrain``, without the caller's callbacks): what a spare runs once at
    start on a private 1-rank world (:func:`~tierstack.resiliency.warm_spare.warm_up`); None: spares
    start with imports only.

    Raises:
        ConfigError: see :func:`check` (before any process group, store or fork exists).
    """
    processes = int(os.environ.get("WORLD_SIZE", "1"))
    check(config, processes)
    from tierstack.checkpointing import local_memory

    warm_spare.warm_imports()
    local_memory.enable()
    timeout_s = config.distributed.timeout_s
    raw, prefix = _job_store(processes, timeout_s)
    job = dist.PrefixStore(prefix, raw)
    return rank_slot.run_in_slot(lambda: _rank_main(config, train, prefix, timeout_s, rehearse), job)


def _job_store(processes: int, timeout_s: float) -> tuple[dist.Store, str]:
    """The job's store and a prefix of this start: torchrun's agent store, or one the slot of
    rank 0 hosts (it outlives any rank's process). The prefix is agreed as for any start
    (:func:`attempt_store.agree_on_start`), so an outer torchrun restart never reads these keys."""
    addr, port = os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500"))
    rank = int(os.environ.get("RANK", "0"))
    host = rank == 0 and not attempt_store.uses_agent_store()
    raw = dist.TCPStore(addr, port, processes, is_master=host, timeout=timedelta(seconds=timeout_s),
                        wait_for_workers=False)
    token = attempt_store.agree_on_start(raw, rank, processes, timeout_s)
    return raw, f"{_ROOT}/{token}/"


def wrapper_arguments(config: ConfigContainer, job_prefix: str) -> dict:
    """Keyword arguments of ``inprocess.Wrapper`` for ``config`` (timeouts from
    ``resiliency.heartbeat_timeout_s``; intervals tuned for a restart in about a second)."""
    from tierstack.resiliency.nvrx_store import JobStore  # NVRx imported only by runs that use it

    r = config.resiliency
    soft = float(r.heartbeat_timeout_s)
    hard = soft + max(0.5, soft / 2)
    barrier = hard + max(30.0, config.distributed.timeout_s)
    return dict(
        store_factory=JobStore,  # a class: NVRx builds one in the rank and one in its monitor process
        store_kwargs={"prefix": job_prefix, "timeout_s": barrier},
        abort=_ReleaseGroups(),
        finalize=_Collect(),
        health_check=None,
        rank_assignment=spares.rank_assignment(config),
        monitor_thread_interval=timedelta(seconds=MONITOR_THREAD_INTERVAL_S),
        monitor_process_interval=timedelta(seconds=MONITOR_PROCESS_INTERVAL_S),
        heartbeat_interval=timedelta(seconds=min(0.5, soft / 4)),
        progress_watchdog_interval=timedelta(seconds=PROGRESS_INTERVAL_S),
        soft_timeout=timedelta(seconds=soft),
        hard_timeout=timedelta(seconds=hard),
        heartbeat_timeout=timedelta(seconds=hard),
        barrier_timeout=timedelta(seconds=barrier),
        completion_timeout=timedelta(seconds=barrier),
        last_call_wait=timedelta(seconds=LAST_CALL_WAIT_S),
        termination_grace_time=timedelta(seconds=TERMINATION_GRACE_S),
    )


def _rank_main(config: ConfigContainer, train: Callable, job_prefix: str, timeout_s: float,
               rehearse: Optional[Callable]) -> int:
    """The forked rank: NVRx's wrapper around one attempt of ``train`` per restart iteration."""
    from nvidia_resiliency_ext import inprocess
    from nvidia_resiliency_ext.inprocess.rank_assignment import RankDiscarded

    from tierstack.checkpointing import local_memory
    from tierstack.runtime import has_gpu

    active_per_node = config.resiliency.active_ranks_per_node(int(os.environ.get("WORLD_SIZE", "1")))
    job = dist.PrefixStore(job_prefix, dist.TCPStore(  # the slot's connection stays the slot's
        os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ["MASTER_PORT"]), is_master=False,
        timeout=timedelta(seconds=timeout_s)))
    # NVRx adds NVML GPU/NVLink/NIC checks before each restart when LOCAL_RANK is set (and logs an
    # NVML error per rank building them on a machine without a GPU): none on a CPU
    warm_spare.import_first_use_modules()  # never cut in half by an interruption (see there)
    local_rank = None if has_gpu() else os.environ.pop("LOCAL_RANK", None)
    try:
        wrapper = inprocess.Wrapper(**wrapper_arguments(config, job_prefix), initialize=_Rehearse(config, rehearse))
    finally:
        if local_rank is not None:
            os.environ["LOCAL_RANK"] = local_rank
    limit = config.resiliency.max_in_process_restarts
    ranks = int(os.environ.get("WORLD_SIZE", "1")) - config.resiliency.spare_ranks  # what the run trains on

    def attempt(call_wrapper=None):
        global _attempt
        n = _attempt = call_wrapper.iteration
        if n and job.check([STOPPED_KEY]):  # a planned exit ended the run: a restart after it must not train on
            log.warning("in-process restart %d: not training again: the job already stopped (%s) and kept its "
                        "last checkpoint", n, job.get(STOPPED_KEY).decode())
            return None
        if n and job.check([AGREED_STOP_KEY]):  # a spare woken by the ranks' exit after an AgreedStop
            log.warning("rank %s: not training: the job stopped on every rank (%s)", os.environ.get("RANK"),
                        job.get(AGREED_STOP_KEY).decode())
            return None
        if n > limit:
            raise RestartLimitReached(f"{n} in-process restarts: more than resiliency.max_in_process_restarts={limit}")
        if int(os.environ["WORLD_SIZE"]) < ranks:  # never a silently smaller data-parallel world
            raise RestartLimitReached(f"in-process restart {n}: {os.environ['WORLD_SIZE']} rank(s) left of {ranks} "
                                      f"(resiliency.spare_ranks={config.resiliency.spare_ranks} used up); the "
                                      "launcher's restart takes over")
        if n:
            aborted = _timeline.get("abort_start")
            log.warning("in-process restart %d: rank %s of %s continues in process %d%s", n, os.environ.get("RANK"),
                        os.environ.get("WORLD_SIZE"), os.getpid(), "" if aborted is None else
                        f" ({time.time() - aborted:.2f} s after its abort began, of which "
                        f"{_timeline['abort_end'] - aborted:.2f} s releasing the process groups)")
        if n and signals.unserved_stop() is not None:  # asked to stop, but that run's last checkpoint failed
            signals.hold_stop(signals.unserved_stop())
        os.environ["LOCAL_WORLD_SIZE"] = str(active_per_node)  # the ranks that train on a node (the layout's)
        _timeline["attempt_start"] = time.time()
        attempt_store.use_attempt_store(attempt_store.InterruptibleStore(  # keys of this attempt only; waits
            dist.PrefixStore(f"pg/{n}/", job), config.distributed.timeout_s))  # that an interruption ends
        _watch.begin(call_wrapper)
        try:
            return train(config)
        except Exception as e:
            from tierstack.errors import raised_on_every_rank

            if raised_on_every_rank(e):
                job.set(AGREED_STOP_KEY, summary(e)[:300])
                raise AgreedStop(e) from e
            if _failures.is_repeated(e, _watch._wrapper is not None, interrupted()):  # damaged: a fresh process
                log.error("rank %s: attempt %d failed before its first step as the one before it did (%s: %s): "
                          "this process leaves the job so that a fresh one takes its rank", os.environ.get("RANK"),
                          n, type(e).__name__, str(e)[:300])
                for handler in logging.getLogger().handlers:
                    handler.flush()
                os._exit(rank_slot.DISCARDED)  # its monitor process reports it gone; its slot waits quietly
            raise
        finally:
            _watch.end()
            attempt_store.use_attempt_store(None)
            if signals.served_stop() is not None:  # seen by every rank of any later attempt, spares included
                job.set(STOPPED_KEY, signals.served_stop())

    attempt.__annotations__["call_wrapper"] = inprocess.CallWrapper  # NVRx passes itself by annotation
    slot_rank = os.environ.get("RANK", "0")  # torchrun's (NVRx reassigns RANK per attempt)
    with inprocess.CallWrapper(wrapper) as call_wrapper:  # what ``wrapper(attempt)()`` does, with its watchdog at hand
        job.set(rank_slot.started_key(slot_rank), "1")  # past NVRx's initial barrier: a death is NVRx's to handle
        liveness = Liveness(call_wrapper.progress_watchdog, PROGRESS_INTERVAL_S, vouch=lambda: not interrupted())
        try:
            call_wrapper(attempt, (), {})
        except RankDiscarded:  # taken out of the job (it hung: NVRx resumed it to end it); the job goes on
            log.warning("rank %s: discarded by the in-process restart (its place was given to a spare)",
                        os.environ.get("RANK"))
            return rank_slot.DISCARDED
        except RestartLimitReached as e:  # the job ends: one line, not a traceback; the launcher's restart follows
            log.error("rank %s stops: %s", os.environ.get("RANK"), e)
            if e.exit_status != 2 and (isinstance(e, AgreedStop) or not restarts.launcher_restarts_left()):
                local_memory.release()  # nothing resumes it: node memory given back (bad input kept: a fixed relaunch adopts it)
            return e.exit_status
        finally:
            liveness.close()
    local_memory.release()  # the run is done: its memory step leaves the node's memory
    rank_slot.mark_done(job)
    return 0


def interrupted() -> bool:
    """True once an in-process restart's abort began in this process's current attempt (the error
    the rank's main thread meets then comes from the released process groups, not from its work)."""
    return _timeline.get("abort_start", 0.0) > _timeline.get("attempt_start", float("inf"))


def restart_number() -> int:
    """The in-process restart this process's current attempt is (0: the first attempt, or no
    in-process restart)."""
    return _attempt


class _HangWatch:
    """Times each attempt from its start to its first step (the restart's log line)."""

    def __init__(self) -> None:
        self._wrapper = None
        self._began = 0.0

    def begin(self, call_wrapper) -> None:
        self._wrapper, self._began = call_wrapper, time.time()

    def step_done(self) -> None:
        if self._wrapper is not None:
            _failures.succeeded()
            if self._wrapper.iteration:
                log.info("in-process restart %d: first step done %.2f s after the attempt began (set-up, resume, "
                         "step)", self._wrapper.iteration, time.time() - self._began)
            self._wrapper = None

    def end(self) -> None:
        self._wrapper = None


_watch = _HangWatch()
_failures = RepeatedFailure()  # this process's failed attempts (a damaged process leaves the job)
_timeline: dict[str, float] = {}  # unix times of this process's last abort (the restart's log line)


def watch_steps(on_step: Optional[Callable]) -> Optional[Callable]:
    """``on_step`` that also logs the first step of an in-process restart's attempt; ``on_step``
    itself outside one (``pretrain`` wraps its callback with this)."""
    if _watch._wrapper is None:
        return on_step

    def step_done(train_state, result) -> None:
        _watch.step_done()
        if on_step is not None:
            on_step(train_state, result)

    return step_done


class _ReleaseGroups:
    """NVRx abort (monitor thread): release every process group (see :mod:`tierstack.runtime`)."""

    def __new__(cls):
        from nvidia_resiliency_ext.inprocess.abort import Abort

        class ReleaseGroups(Abort):
            def __call__(self, state):
                from tierstack.runtime import release_distributed

                _timeline["abort_start"] = time.time()
                release_distributed()
                _timeline["abort_end"] = time.time()
                return state

        return ReleaseGroups()


class _Rehearse:
    """NVRx initialize (main thread, at the start of each attempt, after the ranks are assigned): a
    spare that is inactive rehearses set-up and one step once (:func:`warm_spare.warm_up`), while
    the active ranks already train. (Before the wrapper, the active ranks waited for every spare's
    rehearsal in NVRx's first barrier: 23 s with 3 spares per node on 2 cores.) A failure during
    the rehearsal interrupts it like any attempt: the spare then starts its rank cold."""

    def __new__(cls, config: ConfigContainer, rehearse: Optional[Callable]):
        from nvidia_resiliency_ext.inprocess.initialize import Initialize
        from nvidia_resiliency_ext.inprocess.state import Mode

        class Rehearse(Initialize):
            pending = rehearse is not None

            def __call__(self, state):
                if self.pending and state.mode == Mode.INACTIVE:
                    self.pending = False
                    warm_spare.warm_up(config, rehearse)
                return state

        return Rehearse()


class _Collect:
    """NVRx finalize (main thread, before the restart): release what the abort left, collect, and
    return the freed heap to the operating system."""

    def __new__(cls):
        from nvidia_resiliency_ext.inprocess.finalize import Finalize

        class Collect(Finalize):
            def __call__(self, state):
                from tierstack.runtime.distributed import release_distributed, return_free_heap

                release_distributed()
                return_free_heap()
                return state

        return Collect()
