"""Run a recipe: apply overrides, validate before any rank starts, then pretrain or launch the ranks.

Two ways in, one code path:

- under torchrun (``torchrun --nproc-per-node 2 recipes/gpt_tiny.py k=v``), each rank validates and
  trains; a config error is printed once (rank 0) and every rank exits 2 (the others after rank 0,
  so that torchrun cannot stop rank 0 before it printed). torchrun itself then
  reports the failed ranks (its ``ChildFailedError``): a launcher cannot be told that a child's
  exit was a clean refusal;
- with ``--nproc-per-node N`` and no torchrun around (``tierstack pretrain gpt_tiny --nproc-per-node 2``,
  ``python recipes/gpt_tiny.py --nproc-per-node 2``), this process validates the config for a world
  of N ranks first: a config error ends here with the error alone and exit status 2, before any rank
  exists; a valid config is handed to torchrun's own launcher (standalone rendezvous on a free port).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Callable, Optional, Sequence

from tierstack.config import ConfigContainer, ConfigError
from tierstack.config.describe import describe, load_yaml, to_yaml
from tierstack.errors import BadInputError, report_on_rank_0

log = logging.getLogger("tierstack")

CONFIG_ERROR_STATUS = 2  # the exit status of a refused config (argparse's, for the same kind of mistake)
BAD_INPUT_STATUS = CONFIG_ERROR_STATUS  # any other bad input (tierstack.errors.BadInputError): the same


def under_torchrun() -> bool:
    """True in a rank process started by torchrun (it sets ``TORCHELASTIC_RUN_ID`` and ``LOCAL_RANK``)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or "LOCAL_RANK" in os.environ


def _report(message: str) -> None:
    """Print a refusal once: on rank 0 (or in a process that is not a rank)."""
    report_on_rank_0(message)


def run(
    config_fn: Callable[[], ConfigContainer],
    argv: Optional[Sequence[str]] = None,
    *,
    rank_command: Optional[Sequence[str]] = None,
) -> int:
    """Build the recipe's config, apply ``section.field=value`` overrides, validate, and pretrain.

    Args:
        config_fn: the recipe (a function returning a config).
        argv: ``[--nproc-per-node N [--max-restarts R]] [--config-file FILE] [--print-config |
            --dry-run | --help] section.field=value ...``; default ``sys.argv[1:]`` (:data:`RUN_FLAGS`
            says what each does). ``--max-restarts`` (torchrun's) restarts every rank up to R times
            after a rank fails; the job resumes from its newest checkpoint. The config is the
            recipe's, then FILE's fields, then the overrides.
        rank_command: what each rank runs when this process launches them (torchrun's program and
            its arguments, before the overrides); default ``[sys.argv[0]]``, the recipe file.

    Returns:
        A process exit status: 0 on success (and after ``--help``, ``--print-config``, a valid
        ``--dry-run``); 2 on a config error (printed once, before any work
        starts) or on another :class:`~tierstack.errors.BadInputError` of setup (damaged data files,
        a checkpoint that does not fit the run, checkpoints of no recorded run: rank 0 prints the
        message, every other rank one line); with ``--nproc-per-node``, the launch's status (see
        :func:`launch`). Other errors propagate with their traceback; under torchrun the rank
        then ends right after it is printed (:func:`~tierstack.resiliency.fast_exit.exit_after_traceback`).
    """
    known, overrides = _parse_flags(sys.argv[1:] if argv is None else argv)
    nproc = known.nproc_per_node
    if nproc is not None and (nproc < 1 or under_torchrun()):
        _report(f"--nproc-per-node={nproc}: give a number >= 1, and only outside torchrun (torchrun sets the ranks)")
        return CONFIG_ERROR_STATUS
    if known.max_restarts is not None and (known.max_restarts < 0 or nproc is None):
        _report(f"--max-restarts={known.max_restarts}: give a number >= 0, together with --nproc-per-node "
                "(under torchrun, give torchrun --max-restarts)")
        return CONFIG_ERROR_STATUS
    world_size = nproc if nproc is not None else int(os.environ.get("WORLD_SIZE", "1"))
    try:
        config, taken = resolve_config(config_fn, overrides, known.config_file)
        if nproc is None or known.dry_run or known.help or known.print_config:  # once: here, or in the ranks
            _note(config, taken)
        if known.help or known.print_config:
            return _show(config, config_fn, known)
        # several ranks under torchrun: the directories are checked by every rank in setup, together
        # (a node-local directory can be fine on one node and not on another)
        config.validate(world_size, check_paths=nproc is not None or not under_torchrun() or world_size == 1)
    except ConfigError as exc:
        _report(str(exc))
        if nproc is None and under_torchrun() and world_size > 1 and int(os.environ.get("RANK", "0")) != 0:
            _leave_after_rank_0(CONFIG_ERROR_STATUS)
        return CONFIG_ERROR_STATUS
    if known.dry_run:
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"dry run: the config is valid for {world_size} rank(s); nothing was built or started", flush=True)
        return 0
    if nproc is not None:
        from tierstack.resiliency.signals import planned_exit_grace_s

        file_args = ["--config-file", known.config_file] if known.config_file else []
        return launch([*(rank_command or [sys.argv[0]]), *file_args, *overrides], nproc_per_node=nproc,
                      max_restarts=known.max_restarts or 0, shutdown_grace_s=planned_exit_grace_s(config),
                      exit_signal=config.train.exit_signal)
    from tierstack.training.pretrain import pretrain

    try:
        pretrain(config)
    except BadInputError as exc:  # raised alike on every rank, after pretrain() cleaned up
        if int(os.environ.get("RANK", "0")) == 0:
            if not getattr(exc, "said", False):  # setup says it before the ranks leave (errors.say_once)
                _report(str(exc))
        else:
            if not logging.getLogger().handlers:
                logging.basicConfig(level=logging.INFO, format="%(message)s")
            log.error("rank %s stopped: bad input (rank 0 says which)", os.environ.get("RANK"))
        if under_torchrun():
            _exit_with_the_other_ranks(BAD_INPUT_STATUS)
        return BAD_INPUT_STATUS
    except Exception:
        if under_torchrun():  # torchrun restarts once every rank has ended: end right after the traceback
            from tierstack.resiliency.fast_exit import exit_after_traceback

            exit_after_traceback()
        raise
    return 0


def resolve_config(config_fn: Callable[[], ConfigContainer], overrides: Sequence[str],
                   config_file: Optional[str] = None) -> tuple[ConfigContainer, list[str]]:
    """The run's config: the recipe, then ``config_file``'s fields, then the overrides, then the
    architecture and tokenizer of ``checkpoint.pretrained_checkpoint`` for the fields not given.

    Returns:
        ``(config, taken)``: ``taken`` lists each field taken from the pretrained checkpoint that
        differs from the recipe (``section.field=value``, paste-ready).

    Raises:
        ConfigError: a bad file, override, or a given field that contradicts the pretrained checkpoint.
    """
    from tierstack.training.pretrained_fields import adopt_pretrained, given_keys

    config = config_fn()
    data = load_yaml(config_file) if config_file else None
    if data:
        config.apply_mapping(data, origin=f"--config-file {config_file}")
    config.apply_overrides(overrides)
    return config, adopt_pretrained(config, given_keys(overrides, data))


def _note(config: ConfigContainer, taken: list[str]) -> None:
    """Say once (rank 0, stderr: stdout may be a printed config) which fields came from the pretrained
    checkpoint, and the settings that look unintended (``ConfigContainer.notes``)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return
    lines = [f"note: {n}" for n in config.notes()]
    if taken:
        lines.insert(0, f"checkpoint.pretrained_checkpoint={config.checkpoint.pretrained_checkpoint}: architecture "
                     "and tokenizer taken from it, where they differ from the recipe (to keep them in a recipe "
                     f"or config file): {' '.join(taken)}")
    for line in lines:
        print(line, file=sys.stderr, flush=True)


def _parse_flags(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split the run's own flags from the ``section.field=value`` overrides."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--nproc-per-node", type=int, default=None)
    parser.add_argument("--max-restarts", type=int, default=None)
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--print-config", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--config-file", default=None)
    return parser.parse_known_args(list(argv))


RUN_FLAGS = """flags:
  --nproc-per-node N    validate for N ranks, then launch them on this machine (leave it out under torchrun)
  --max-restarts R      with --nproc-per-node: restart every rank up to R times after a failure
  --config-file FILE    start from FILE (YAML, as --print-config writes it); overrides apply on top
  --print-config        print the resolved config as YAML and exit (save it, edit it, give it to --config-file)
  --dry-run             validate the config for the ranks given, build nothing, exit 0 (2 when invalid)
  -h, --help            this text: every section and field, with its value here and what it means"""


def recipe_summary(config_fn: Callable[[], ConfigContainer]) -> str:
    """The first paragraph of the recipe's module docstring (else its own), on one line."""
    import inspect

    module = inspect.getmodule(config_fn)
    doc = (module.__doc__ if module is not None and module.__doc__ else config_fn.__doc__) or ""
    return " ".join(doc.strip().split("\n\n")[0].split())


def _show(config: ConfigContainer, config_fn: Callable[[], ConfigContainer], known: argparse.Namespace) -> int:
    """``--help`` (fields, values, docs) or ``--print-config`` (YAML) on stdout, once (rank 0)."""
    if int(os.environ.get("RANK", "0")) != 0:
        return 0
    if known.help:
        print(f"{config_fn.__name__}: {recipe_summary(config_fn)}\n\n{RUN_FLAGS}\n\n"
              "fields (section.field=value; the values are this recipe's, after --config-file and overrides):")
        print(describe(config))
    else:
        sys.stdout.write(to_yaml(config))
    sys.stdout.flush()
    return 0


TORCHRUN_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # what torchrun forwards to the ranks by default
REFUSAL_GRACE_S = 30.0  # how long a rank other than 0 waits for rank 0 to print a config error


def _leave_after_rank_0(status: int) -> None:
    """End a rank other than 0 that refused the config (no process group exists yet), after rank 0.

    Every rank finds the same config error, and only rank 0 prints it. torchrun stops the other
    workers (SIGTERM) as soon as one exits non-zero, so a rank 1 that exited first could kill rank
    0 before it printed (seen on a busy machine: the run ended with no message at all). This rank
    waits instead: SIGTERM from torchrun (rank 0 has exited, message printed) ends it with
    ``status``, and so does the end of :data:`REFUSAL_GRACE_S` seconds (rank 0 on another node,
    whose agent does not stop this node's workers).
    """
    import time

    def leave(signum, frame):
        os._exit(status)

    signal.signal(signal.SIGTERM, leave)
    signal.signal(signal.SIGINT, leave)
    time.sleep(REFUSAL_GRACE_S)
    os._exit(status)


def _exit_with_the_other_ranks(status: int) -> None:
    """End this rank now, with ``status``, as every other rank does at the same point.

    torchrun stops the other workers (SIGTERM) as soon as one exits non-zero. The interpreter's own
    teardown after megatron-core is imported takes seconds and varies between ranks (5-10 s on a
    busy 2-core machine), so a rank reporting the same bad input a little later would be killed and
    listed as "Signal 15", hiding its clean exit 2. Everything that needs closing was closed by
    ``pretrain()`` (checkpoint writers, process groups); child processes (multiprocessing managers)
    are stopped here so that none outlives the rank.
    """
    import multiprocessing

    for child in multiprocessing.active_children():
        child.terminate()
        child.join(timeout=5)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def launch(command: Sequence[str], *, nproc_per_node: int, max_restarts: int = 0,
           shutdown_grace_s: Optional[int] = None, exit_signal: Optional[str] = None) -> int:
    """Start ``nproc_per_node`` ranks of ``command`` on this machine with torchrun's own launcher.

    The rendezvous is torchrun's ``--standalone`` one (a c10d store on a port the OS picks at bind
    time). ``OMP_NUM_THREADS`` defaults to 1, the value torchrun itself sets for several ranks per
    node (so the numbers are the same as a plain torchrun launch; set it to change that).

    Args:
        command: the program and its arguments, as after ``torchrun [options]`` (``["-m",
            "tierstack.cli", "pretrain", "gpt_tiny", ...]`` or ``["recipes/gpt_tiny.py", ...]``).
        nproc_per_node: ranks to start.
        max_restarts: torchrun's ``--max-restarts``: after a rank fails, torchrun stops the others
            and starts all of them again, up to this many times (the job-wide count is kept in
            ``<logger.run_dir>/restarts.json``). The ranks' process groups keep to keys of their own
            start in torchrun's shared store (:mod:`tierstack.runtime.attempt_store`), so no
            restarted rank reads a peer's address from before the restart.
        shutdown_grace_s: how long torchrun waits for the ranks after forwarding a stop signal
            before it SIGKILLs them (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, torchrun's default 30 s,
            unless set): what a planned exit's checkpoint needs
            (:func:`~tierstack.resiliency.signals.planned_exit_grace_s`).
        exit_signal: a signal (``"SIGUSR1"``) torchrun forwards to the ranks besides its own
            (SIGTERM, SIGINT, SIGHUP, SIGQUIT): the early warning that asks for a planned exit.

    Returns:
        0 when every rank succeeded; else the first failed rank's exit status (1 for a signal),
        after torchrun's report of the failure; ``128 + N`` when this launcher itself received
        signal N (SIGTERM from a scheduler, Ctrl-C): torchrun has then stopped the ranks, each
        of which turned the signal into a planned exit (the shell's convention for a signal).
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args
    from torch.distributed.run import run as torchrun

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    logging.getLogger("torch.distributed").setLevel(logging.WARNING)  # its rendezvous INFO lines
    if shutdown_grace_s is not None:  # torchrun's 30 s would SIGKILL a planned exit's save
        os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(int(shutdown_grace_s)))
    forwarded = ["--signals-to-handle", f"{TORCHRUN_SIGNALS},{exit_signal}"] if exit_signal else []
    args = parse_args(["--standalone", "--nproc-per-node", str(nproc_per_node),
                       "--max-restarts", str(max_restarts), *forwarded, *command])
    try:
        torchrun(args)
    except ChildFailedError as exc:
        print(str(exc), file=sys.stderr)
        _, failure = exc.get_first_failure()
        return failure.exitcode if failure.exitcode > 0 else 1
    except SignalException as exc:
        signum = int(exc.sigval)
        print(f"tierstack: the launcher received {signal.Signals(signum).name}; torchrun stopped the ranks "
              f"(exit status {128 + signum})", file=sys.stderr)
        return 128 + signum
    return 0
