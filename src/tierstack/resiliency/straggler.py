"""Straggler detection over nvidia-resiliency-ext ``straggler.Detector``.

Every rank times its training step (and, optionally, its forward compute) as Detector sections. At
each ``report_interval``-th iteration all ranks generate a report together (a collective); rank 0
names the slowest ranks with their scores and node names, and, when ``stop_if_detected`` is set, all
ranks agree to stop.

Scores (from the Detector) are ratios in (0, 1]:

- *relative*: this rank's median section time against the fastest rank's (0.5 = twice as slow);
- *individual*: this rank's median section time against its own best median so far.

CPU and GPU
    On a GPU the Detector profiles CUDA kernels with CUPTI, which sees a slow GPU even when
    collectives make every rank's wall time equal (where NVRx's CUPTI extension does not load, a GPU
    run falls back to section timing with one warning). On a CPU there is no CUPTI (``nvrx_cupti_module``
    cannot load ``libcupti``), so this module hands the Detector a profiler that records no kernels
    (:class:`tierstack.runtime.nvrx_cpu.NoKernelProfiler`) and only wall-clock section timing is scored. A section that spans a
    synchronous collective (the data-parallel gradient all-reduce) takes the same wall time on every
    rank, since the fast ranks wait there for the slow one; so on a CPU a straggler shows up in a
    section without collectives, such as the forward compute (:meth:`StragglerMonitor.wrap_forward_step`
    with TP=1), not in the whole step.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import statistics
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

from tierstack.config.sections import StragglerConfig
from tierstack.runtime import ParallelLayout, collectives, has_gpu
from tierstack.runtime.nvrx_cpu import detector_cpu_shims, kernel_profiling_available

log = logging.getLogger(__name__)

STEP_SECTION = "train_step"
FORWARD_SECTION = "forward_step"


@dataclass
class StragglerReport:
    """Outcome of one report, returned on every rank.

    Attributes:
        iteration: the iteration at which the report was generated.
        stragglers: ``(rank, node)`` of each rank below a threshold in any score, sorted by rank;
            the same list on every rank.
        should_stop: True on every rank when ``stop_if_detected`` is set and ``stragglers`` is not
            empty (agreed: decided on rank 0 and broadcast).
        metrics: min/median/max of each score over ranks (``straggler/<score>_{min,median,max}``);
            filled on rank 0 only, empty elsewhere.
    """

    iteration: int
    stragglers: list[tuple[int, str]] = field(default_factory=list)
    should_stop: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


def _spread(prefix: str, scores: dict[int, float]) -> dict[str, float]:
    values = [v for v in scores.values() if v == v]  # drop NaN (no data for that rank)
    if not values:
        return {}
    return {
        f"{prefix}_min": min(values),
        f"{prefix}_median": statistics.median(values),
        f"{prefix}_max": max(values),
    }


class StragglerMonitor:
    """Times training steps on every rank and reports stragglers (nvidia-resiliency-ext Detector).

    The Detector is a process-wide singleton (class state), so one monitor may be open per process.

    Args:
        cfg: the ``straggler`` config section.
        layout: this process's parallel layout (rank 0 logs and decides).
        node_name: name of this node in reports; default ``socket.gethostname()``.

    Raises:
        ConfigError (a ValueError): the section's own rules (``StragglerConfig.problems``): an
            interval below 1, or a threshold outside (0, 1].
        RuntimeError: a Detector is already initialized in this process.
    """

    def __init__(self, cfg: StragglerConfig, layout: ParallelLayout, node_name: Optional[str] = None) -> None:
        from nvidia_resiliency_ext.attribution.straggler import Detector

        cfg.validate()
        if Detector.initialized:
            raise RuntimeError("a straggler Detector is already initialized in this process; close() it first")

        self.cfg = cfg
        self.layout = layout
        self._detector = Detector
        self._profile_kernels = kernel_profiling_available()
        with detector_cpu_shims(self._profile_kernels):
            # Reports are driven by iteration count (maybe_report), not by the Detector's own
            # time-based tracker: the interval is then the same on every rank by construction.
            Detector.initialize(
                scores_to_compute="all",
                gather_on_rank0=True,
                profiling_interval=cfg.profiling_interval,
                node_name=node_name or socket.gethostname(),
            )
        self._closed = False
        log.info(
            "straggler detection on: report every %d iterations, thresholds relative %.2f individual %.2f, %s",
            cfg.report_interval,
            cfg.relative_threshold,
            cfg.individual_threshold,
            "CUDA kernel profiling" if self._profile_kernels else "section timing only",
        )

    @contextlib.contextmanager
    def step_section(self) -> Iterator[None]:
        """Time one training step (the ``train_step`` section); enter it on every rank, every step."""
        with self._detector.detection_section(STEP_SECTION, profile_cuda=self._profile_kernels):
            yield

    def wrap_forward_step(self, forward_step_func: Callable) -> Callable:
        """Return ``forward_step_func`` timed as the ``forward_step`` section, on a CPU only.

        On a CPU with TP=1 and PP=1 the forward compute holds no collective, so it is where a slow
        rank stands out (see the module docstring). On a GPU the function is returned unchanged:
        kernels run asynchronously, so a wall-clock section around ``forward_step`` (which only
        queues them) measures launch time, and its scores could stop a healthy run; there the
        kernel profiler and the ``train_step`` section (which ends at the optimizer step) score.
        """
        if has_gpu():
            return forward_step_func
        detector, profile = self._detector, self._profile_kernels

        def timed_forward_step(*args: Any, **kwargs: Any) -> Any:
            with detector.detection_section(FORWARD_SECTION, profile_cuda=profile):
                return forward_step_func(*args, **kwargs)

        return timed_forward_step

    def maybe_report(self, iteration: int) -> Optional[StragglerReport]:
        """Call on every rank after each iteration; at report intervals, report (a collective).

        Args:
            iteration: the iteration just finished (1-based, as in TrainState.step).

        Returns:
            None between reports; a :class:`StragglerReport` on every rank at ``iteration %
            report_interval == 0``.
        """
        if iteration % self.cfg.report_interval:
            return None
        with detector_cpu_shims(self._profile_kernels):
            report = self._detector.generate_report()  # a collective: every rank takes part
        result = StragglerReport(iteration=iteration)
        if self.layout.rank == 0 and report is not None:
            result.metrics = self._metrics(report)
            result.stragglers = self._find_stragglers(report)
            self._log_report(iteration, report, result.stragglers)
        # one broadcast carries both, so every rank can name the stragglers when it exits
        stragglers, should_stop = collectives.broadcast_object(
            (result.stragglers, bool(result.stragglers) and self.cfg.stop_if_detected), src=0
        )
        result.stragglers = [tuple(s) for s in stragglers]
        result.should_stop = should_stop
        return result

    def close(self) -> None:
        """Shut the Detector down (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._detector.initialized:
            self._detector.shutdown()

    # -- rank 0 helpers -------------------------------------------------------------------------

    def _scores(self, report: Any) -> dict[str, dict[int, float]]:
        """All per-rank score maps of a report, by metric prefix."""
        out = {}
        for section, scores in report.section_relative_perf_scores.items():
            out[f"straggler/{section}_relative"] = dict(scores)
        for section, scores in report.section_individual_perf_scores.items():
            out[f"straggler/{section}_individual"] = dict(scores)
        if self._profile_kernels:
            out["straggler/gpu_relative"] = dict(report.gpu_relative_perf_scores)
            out["straggler/gpu_individual"] = dict(report.gpu_individual_perf_scores)
        return out

    def _metrics(self, report: Any) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for prefix, scores in self._scores(report).items():
            metrics.update(_spread(prefix, scores))
        return metrics

    def _find_stragglers(self, report: Any) -> list[tuple[int, str]]:
        found = report.identify_stragglers(
            gpu_rel_threshold=self.cfg.relative_threshold,
            section_rel_threshold=self.cfg.relative_threshold,
            gpu_indiv_threshold=self.cfg.individual_threshold,
            section_indiv_threshold=self.cfg.individual_threshold,
        )
        ids = set(found["straggler_gpus_relative"]) | set(found["straggler_gpus_individual"])
        for key in ("straggler_sections_relative", "straggler_sections_individual"):
            for section_ids in found[key].values():
                ids |= set(section_ids)
        return sorted((s.rank, s.node) for s in ids)

    def _log_report(self, iteration: int, report: Any, stragglers: list[tuple[int, str]]) -> None:
        """One line: per score kind, the slowest ranks by their worst section, then the verdict."""
        n = self.cfg.num_scores_to_print
        parts = []
        for kind in ("relative", "individual"):
            worst: dict[int, tuple[float, str]] = {}  # rank -> (lowest score, where)
            for prefix, scores in self._scores(report).items():
                if not prefix.endswith(f"_{kind}"):
                    continue
                where = prefix.split("/", 1)[1][: -len(kind) - 1]
                for r, v in scores.items():
                    if v == v and (r not in worst or v < worst[r][0]):
                        worst[r] = (v, where)
            slowest = sorted(worst.items(), key=lambda item: item[1][0])[:n]
            if slowest:
                listed = ", ".join(
                    f"rank {r} ({report.rank_to_node.get(r, '?')}) {v:.2f} [{where}]" for r, (v, where) in slowest
                )
                parts.append(f"{kind}: {listed}")
        log.info("straggler report iter %d | slowest %s", iteration, " | ".join(parts) or "(no scores yet)")
        if stragglers:
            log.warning(
                "straggler report iter %d | STRAGGLERS: %s%s",
                iteration,
                ", ".join(f"rank {r} on {node}" for r, node in stragglers),
                " -> stopping (straggler.stop_if_detected)" if self.cfg.stop_if_detected else "",
            )
