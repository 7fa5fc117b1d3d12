"""Run a recipe: apply overrides, validate before any rank starts, then pretrain or launch the ranks.

Two ways in, one code path:

- under torchrun (``torchrun --nproc-per-node 2 recipes/gpt_tiny.py k=v``), each rank validates and
  trains; a config error is printed once (rank 0) and every rank exits 2 (the others after rank 0,
  so that torchrun cannot stop rank 0 before it printed). torchrun itself then reports the failed
  ranks (its ``ChildFailedError``: a launcher cannot be told that a child's exit was a clean
  refusal); rank 0 writes the refusal into torchrun's error file, so that report ends with it
  (:mod:`~tierstack.recipes.rank_exit`). A rank whose peer died says so in one line and keeps its
  traceback in its log file (``logger.rank_log_dir``);
- with ``--nproc-per-node N`` and no torchrun around (``tierstack pretrain gpt_tiny --nproc-per-node 2``,
  ``python recipes/gpt_tiny.py --nproc-per-node 2``), this process validates the config for a world
  of N ranks first, and the data files the run trains on: an error ends here with the error alone
  and exit status 2, before any rank exists; a valid config is handed to torchrun's own launcher
  (standalone rendezvous on a free port, :mod:`~tierstack.recipes.launch`), which says what
  happens to the ranks in one line per event.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Callable, Optional, Sequence

from tierstack.config import ConfigContainer, ConfigError
from tierstack.config.describe import describe, load_yaml, to_yaml
from tierstack.config.resiliency_section import RESTART_MODES
from tierstack.errors import BadInputError, report_on_rank_0
from tierstack.recipes import rank_exit
from tierstack.recipes.launch import launch

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
    if known.restart is not None:  # the flag is the field: the ranks get it as an override
        overrides = [*overrides, f"resiliency.restart={known.restart}"]
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
        # first: the spares decide which ranks train, and so the layout every other rule checks
        restart = _check_restart(config, world_size, (known.max_restarts or 0) if nproc is not None else None)
        try:
            config.validate(_active_ranks(config, world_size), ranks_per_node=config.resiliency.active_ranks_per_node(
                world_size), check_paths=nproc is not None or not under_torchrun() or world_size == 1)
        except ConfigError as exc:  # every problem at once: the launch's rules with the config's
            raise ConfigError(restart + exc.problems) from None
        if restart:
            raise ConfigError(restart)
    except ConfigError as exc:
        _report(str(exc))
        if nproc is None and under_torchrun():
            if int(os.environ.get("RANK", "0")) == 0:
                rank_exit.write_torchrun_error_file(str(exc))  # torchrun's report ends with it
            elif world_size > 1:
                rank_exit.leave_after_rank_0(CONFIG_ERROR_STATUS)
        return CONFIG_ERROR_STATUS
    if known.dry_run:
        if (nproc is not None or not under_torchrun()) and not _data_files_fit(config):
            return BAD_INPUT_STATUS
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"dry run: the config is valid for {world_size} rank(s); nothing was built or started", flush=True)
        return 0
    if nproc is not None:
        from tierstack.resiliency.signals import planned_exit_grace_s

        if not _data_files_fit(config):  # before any rank exists: the error alone, exit status 2
            return BAD_INPUT_STATUS

        if config.resiliency.in_process:  # gloo's and the store's per-poll warnings during a restart
            os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        file_args = ["--config-file", known.config_file] if known.config_file else []
        return launch([*(rank_command or [sys.argv[0]]), *file_args, *overrides], nproc_per_node=nproc,
                      max_restarts=known.max_restarts or 0, shutdown_grace_s=planned_exit_grace_s(config),
                      exit_signal=config.train.exit_signal)
    return _pretrain_here(config)


def _pretrain_here(config: ConfigContainer) -> int:
    """Train in this process (a rank); a refusal or the loss of a peer ends it as
    :mod:`~tierstack.recipes.rank_exit` says, every other error propagates with its traceback
    (which the rank's log file keeps too)."""
    from tierstack.runtime.failures import FILE_ONLY, peer_lost
    from tierstack.training.pretrain import pretrain

    rank = int(os.environ.get("RANK", "0"))
    if config.resiliency.in_process and under_torchrun():  # NVRx's wrapper restarts pretrain in this process
        from tierstack.resiliency import in_process

        if rank == 0 and "TORCH_CPP_LOG_LEVEL" not in os.environ:  # (tierstack's own launcher sets it)
            log.warning("in-process restart under your own launcher: set TORCH_CPP_LOG_LEVEL=ERROR in its environment, "
                        "or c10d's store polls print 'waitForInput: socket ... timed out after 50ms' warnings all run long")
        return in_process.run(config, pretrain, rehearse=pretrain)
    try:
        pretrain(config)
    except BadInputError as exc:  # raised alike on every rank, after pretrain() cleaned up
        if not getattr(exc, "said", False):  # setup says it before the ranks leave (errors.say_once)
            if rank == 0:
                _report(str(exc))
            else:
                if not logging.getLogger().handlers:
                    logging.basicConfig(level=logging.INFO, format="%(message)s")
                log.error("rank %s stopped: bad input (rank 0 says which)", rank)
        if under_torchrun():
            # rank 0 ends first, so torchrun's first observed failure is the one that says why; only
            # where rank 0 runs under this rank's own agent (node 0: GROUP_RANK 0), whose SIGTERM then
            # ends this rank too (another node's agent would not, and a node whose store host left errs)
            if rank != 0 and os.environ.get("GROUP_RANK", "0") == "0":
                rank_exit.leave_after_rank_0(BAD_INPUT_STATUS)
            rank_exit.write_torchrun_error_file(str(exc))  # torchrun's report ends with it
            rank_exit.exit_now(BAD_INPUT_STATUS)
        return BAD_INPUT_STATUS
    except Exception as exc:
        log.error("rank %d stopped on this error:", rank, exc_info=exc, extra=FILE_ONLY)
        lost = peer_lost(exc)
        if lost is not None and under_torchrun():
            # another rank died: its own log (or torchrun's line) says why; this rank's traceback says nothing
            log_file = config.logger.rank_log_path(rank)
            rank_exit.report_peer_loss(rank, lost, str(log_file) if log_file else None)
            rank_exit.leave_after_peer_loss()
        if under_torchrun():  # torchrun restarts once every rank has ended: end right after the traceback
            from tierstack.resiliency.fast_exit import exit_after_traceback

            exit_after_traceback()
        raise
    return 0


def _active_ranks(config: ConfigContainer, processes: int) -> int:
    """Ranks that train among ``processes`` started: all but ``resiliency.spare_ranks`` under in-process restart."""
    return max(1, processes - (config.resiliency.spare_ranks if config.resiliency.in_process else 0))


def _check_restart(config: ConfigContainer, processes: int, max_restarts: Optional[int]) -> list[str]:
    """In-process restart's rules of the launch (spares, the launcher's restarts; see
    :meth:`~tierstack.config.resiliency_section.ResiliencyConfig.launcher_problems`).

    Args:
        max_restarts: ``--max-restarts`` when this process launches the ranks; None in a rank
            (torchrun's environment says it).

    Returns:
        The problems to report with the config's own (the launcher cannot replace a process).

    Raises:
        ConfigError: the spares leave the ranks that train unknown (reported alone: every other
            rule of the layout depends on them), naming the field.
    """
    env = None if max_restarts is None else {"TORCHELASTIC_MAX_RESTARTS": str(max_restarts)}
    layout = config.resiliency.spare_split_problems(processes, env)
    if layout:
        raise ConfigError(layout)
    return config.resiliency.launcher_problems(processes, env)


def _data_files_fit(config: ConfigContainer) -> bool:
    """The launcher's check of the data files before it starts any rank (what setup checks on every
    rank: :func:`~tierstack.data.datasets.check_training_data`); False after printing the refusal.
    The built-in corpus and mock data are left to the ranks (nothing of the user's to check)."""
    if config.dataset.mock or config.dataset.data_path is None:
        return True
    from tierstack.data.datasets import check_training_data
    from tierstack.data.tokenizers import build_tokenizer

    try:
        check_training_data(config.dataset, build_tokenizer(config.tokenizer))
    except BadInputError as exc:
        _report(str(exc))
        return False
    return True


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
    parser.add_argument("--restart", choices=RESTART_MODES, default=None)
    parser.add_argument("-h", "--help", action="store_true")
    parser.add_argument("--print-config", action="store_true")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--config-file", default=None)
    return parser.parse_known_args(list(argv))


RUN_FLAGS = """flags:
  --nproc-per-node N    validate for N ranks, then launch them on this machine (leave it out under torchrun)
  --max-restarts R      with --nproc-per-node: restart every rank up to R times after a failure
  --restart MODE        launcher (default: new processes) or in-process (healthy ranks stay; resiliency.restart)
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
