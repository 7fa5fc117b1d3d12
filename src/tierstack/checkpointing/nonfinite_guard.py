"""The non-finite guard: nothing is published from an interval in which non-finite values reached
the training state, on any rank (issue 11; DESIGN.md, "Preflight").

Per step (:meth:`NonFiniteGuard.observe`, every rank, no collective): the step is *bad* on this
rank when its own loss is non-finite or, in a step whose update the optimizer applied, its own
gradients are. A step the optimizer skipped (``update_successful`` false, as megatron-core's loss
scalers do after an overflow) never reached the state: it is counted in ``skipped_train_samples``
and does not trip the guard. The gradients are only read on this rank when megatron's global
gradient norm (free: the optimizer computes it) is non-finite or not reported, so a clean step
costs nothing; the read then says which ranks held them.

Per boundary (:meth:`NonFiniteGuard.check`, collective, once per step whatever the number of
tiers, before anything of the checkpoint is staged): all ranks agree on the interval's flags with
one all-reduce of a ``[world_size, 3]`` table (first bad step, last bad step, bad steps), so
every rank knows every rank's findings, including ranks whose own check found nothing. The
interval's flags are then spent: a boundary that passed starts a clean interval; a blocked one
stops the run (``on_nonfinite=stop``) or is skipped.

What a checkpoint writes (fp32 main parameters, optimizer moments, model weights: every
floating-point tensor of its state) is checked where it costs the training loop nothing: on the
tier's writer thread, in the staging buffers the save copied it into (:func:`check_staged`,
:class:`NonFiniteStateError`): LOCAL before any byte of it is written, GLOBAL beside its write into
the staging directory (the check then costs a sync save nothing; a failed one discards the
directory, so nothing is ever published from it). That is exactly the bytes the file
would hold, and the ranks agree on it in the save's own finalize agreement, before anything is
sealed or published; :meth:`NonFiniteGuard.state_blocked` then applies ``on_nonfinite``. A
tensor replicated over data-parallel ranks is checked where it is staged: GLOBAL stages every
replica, LOCAL (megatron's fully-parallel distribution) only the one rank that writes it. A step
blocked in one tier is vetoed in the others (``CheckpointManager``), so every tier of a step is
blocked alike, as at a boundary. (Checked
on the training thread, this pass over the whole state cost 0.125 s of a 0.33 s LOCAL save at
1.13 GiB per rank: ``scripts/bench_checkpoint.py --scale 1gib``.) A state that stays non-finite
keeps blocking every later save with ``skip``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Iterable, Optional, Sequence

import torch

from tierstack.checkpointing.state import torch_optimizers
from tierstack.config.sections import ON_NONFINITE
from tierstack.runtime import collectives as _dist

log = logging.getLogger(__name__)


class NonFiniteError(RuntimeError):
    """``checkpoint.on_nonfinite=stop`` and non-finite values were found on some rank: at a
    boundary (the interval's flags) or when a save ended (its staged state)."""

    raised_on_every_rank = True  # the guard's verdict is agreed by all ranks before it is raised


class NonFiniteStateError(RuntimeError):
    """Raised on a writer thread: the state staged for a save holds NaN or inf on this rank; nothing
    of it was written. Not an I/O error: never retried (:func:`~tierstack.checkpointing.errors.classify`
    finds no errno: permanent)."""


def tensors_finite(tensors: list[torch.Tensor]) -> bool:
    """True when every tensor is finite: one pass per tensor (its fp32 sum), one check at the end.

    Args:
        tensors: any shapes and devices; floating-point dtypes (the sum of an integer tensor is
            always finite).

    A sum propagates NaN and inf and is as fast as ``amax`` on CPU (one vectorised pass, no
    tensor-sized temporary; ``linalg.vector_norm(ord=inf)`` was ~50x slower there). A finite
    tensor whose sum overflows (values near 3e38 / numel) is told apart by ``amax``/``amin`` on
    the rare path, so the answer is exact.
    """
    if not tensors:
        return True
    devices = {t.device for t in tensors}
    if len(devices) > 1:  # one pass per device (a live state may hold GPU and host tensors)
        return all(tensors_finite([t for t in tensors if t.device == d]) for d in devices)
    sums = torch.stack([t.detach().sum(dtype=torch.float32) for t in tensors])
    if bool(torch.isfinite(sums).all()):
        return True
    for t, s in zip(tensors, sums):
        if not bool(torch.isfinite(s)):
            t = t.detach()
            if not bool(torch.isfinite(torch.stack([t.amax().float(), t.amin().float()])).all()):
                return False
    return True


def grads_finite(optimizer: Any) -> bool:
    """This rank's gradients as the optimizer applied them (its main params' ``.grad``) are finite."""
    grads = [p.grad for o in torch_optimizers(optimizer) for g in o.param_groups for p in g["params"]
             if p.grad is not None and p.grad.numel()]
    return tensors_finite(grads)


def check_staged(buffers: Sequence[torch.Tensor], what: str) -> None:
    """Writer thread, before a save is sealed: every floating-point staging buffer is finite (LOCAL
    checks before it writes anything; GLOBAL while it writes into its staging directory, which a
    failed check discards).

    Args:
        buffers: the host staging buffers of one save (any shapes and dtypes; integer and bool
            buffers, such as step counters and RNG states, cannot hold NaN and are skipped).
        what: names the save in the error, e.g. ``"LOCAL checkpoint of step 20"``.

    Raises:
        NonFiniteStateError: some buffer holds NaN or inf (names the rank).
    """
    if not tensors_finite([b for b in buffers if b.is_floating_point() and b.numel()]):
        raise NonFiniteStateError(f"{what}: non-finite parameters or optimizer moments on rank {_dist.rank()} "
                                  "(found in the staged state; nothing of it was published)")


@dataclass
class Verdict:
    """What the ranks agreed at a boundary (identical on every rank).

    Attributes:
        step: the boundary's step.
        ok: nothing non-finite on any rank: the boundary may save.
        message: why not (names the steps and ranks), empty when ``ok``.
    """

    step: int
    ok: bool
    message: str = ""


class NonFiniteGuard:
    """Per-step flags and the per-boundary agreement (see the module docstring).

    Args:
        on_nonfinite: ``stop`` (raise :class:`NonFiniteError` at a blocked boundary) or ``skip``.
    """

    def __init__(self, on_nonfinite: str = "stop"):
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(f"checkpoint.on_nonfinite={on_nonfinite!r}: use one of {ON_NONFINITE}")
        self.on_nonfinite = on_nonfinite
        self.bad_steps: list[int] = []  # this rank's bad steps since the last boundary
        self._verdict: Optional[Verdict] = None

    def observe(self, step: int, result: Any, optimizer: Any) -> None:
        """After each optimizer step, on every rank (not collective).

        Args:
            step: the step just completed.
            result: its :class:`~tierstack.training.loop.StepResult` (``loss``, ``grad_norm``,
                ``update_successful``, ``local_loss_finite``).
            optimizer: the megatron optimizer that took the step (its gradients are read only when
                the global norm is non-finite or not reported).
        """
        if not result.update_successful:
            return  # skipped by the optimizer: nothing reached the state
        bad = not getattr(result, "local_loss_finite", True)
        if not math.isfinite(result.grad_norm):  # non-finite, or not reported (nan): look here
            bad = bad or not grads_finite(optimizer)
        if bad:
            self.bad_steps.append(step)

    def check(self, step: int) -> Verdict:
        """Collective, at a checkpoint boundary, before anything of the checkpoint is staged.

        Once per step: every tier saving at ``step`` gets the same verdict. Spends the interval's
        flags. The state itself is checked later, on the writer threads (:func:`check_staged`).
        Raises :class:`NonFiniteError` when blocked and ``on_nonfinite`` is ``stop``.
        """
        if self._verdict is not None and self._verdict.step == step:
            return self._verdict
        table = _agree(self.bad_steps)
        self.bad_steps = []
        self._verdict = Verdict(step, not table.any().item(), _describe(table))
        if not self._verdict.ok:
            log.error("checkpoint of step %d blocked in every tier on every rank: %s", step, self._verdict.message)
            if self.on_nonfinite == "stop":
                raise NonFiniteError(f"step {step}: {self._verdict.message}; nothing of this interval was "
                                     "saved (checkpoint.on_nonfinite=stop; 'skip' trains on without saving it)")
        return self._verdict

    def state_blocked(self, blocked: Sequence[tuple[str, int, Sequence[int]]]) -> None:
        """On every rank, after saves found non-finite values in their staged state: ``(tier, step,
        ranks)`` each (agreed in the saves' finalize; nothing of them was sealed or published, and
        the manager discards every other tier's save of those steps).

        Raises:
            NonFiniteError: with ``on_nonfinite=stop``, naming the steps, tiers and ranks.
        """
        messages = []
        for tier, step, ranks in blocked:
            message = f"non-finite parameters or optimizer moments on rank(s) {', '.join(map(str, ranks))}"
            log.error("checkpoint of step %d blocked in every tier on every rank (found by %s): %s", step, tier, message)
            messages.append(f"step {step}: {message} (found by the {tier} save)")
        if messages and self.on_nonfinite == "stop":
            raise NonFiniteError("; ".join(messages) + "; no tier keeps a checkpoint of it, the previous ones stay "
                                 "the newest (checkpoint.on_nonfinite=stop; 'skip' trains on without saving it)")


def _agree(bad_steps: Iterable[int]) -> torch.Tensor:
    """One all-reduce (MAX) of a ``[world_size, 3]`` int64 table in which each rank fills its row:
    first bad step, last bad step, number of bad steps. Inside the manager's
    ``collective_timeout_s`` bound; a rank that is gone raises ``CollectiveError`` on every rank."""
    steps = sorted(bad_steps)
    world = _dist.world_size()
    table = torch.zeros(world, 3, dtype=torch.int64)
    if steps:
        table[_dist.rank()] = torch.tensor([steps[0], steps[-1], len(steps)])
    return _dist.all_reduce_max_table(table)


def _describe(table: torch.Tensor) -> str:
    """``non-finite values at step 7 on rank 1; ...`` from the agreed table (empty when clean)."""
    parts = []
    for rank, (first, last, count) in enumerate(table.tolist()):
        if count:
            span = f"step {first}" if count == 1 else f"{count} steps from {first} to {last}"
            parts.append(f"non-finite loss or gradients at {span} on rank {rank}")
    firsts = [int(r[0]) for r in table.tolist() if r[2]]
    if firsts:
        first = min(firsts)
        ranks = [i for i, r in enumerate(table.tolist()) if r[2] and r[0] == first]
        parts.insert(0, f"first non-finite step {first} on rank(s) {', '.join(map(str, ranks))}")
    return "; ".join(parts)
