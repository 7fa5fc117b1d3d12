"""StragglerMonitor in one process (no process group): the real Detector with the no-kernel profiler."""

import time

import pytest
import torch
from nvidia_resiliency_ext.attribution.straggler import Detector
from nvidia_resiliency_ext.attribution.straggler import straggler as nvrx_straggler

from tierstack.config.sections import StragglerConfig
from tierstack.runtime import ParallelLayout, has_gpu
from tierstack.resiliency.straggler import StragglerMonitor

LAYOUT = ParallelLayout(
    rank=0,
    world_size=1,
    local_rank=0,
    tensor_model_parallel_size=1,
    pipeline_model_parallel_size=1,
    data_parallel_size=1,
    tensor_model_parallel_rank=0,
    pipeline_model_parallel_rank=0,
    data_parallel_rank=0,
)


@pytest.fixture
def monitor():
    m = StragglerMonitor(StragglerConfig(report_interval=3), LAYOUT, node_name="node-a")
    yield m
    m.close()


def test_reports_at_intervals_with_scores(monitor):
    forward = monitor.wrap_forward_step(lambda x: x * 2)
    got = []
    for it in range(1, 7):
        with monitor.step_section():
            assert forward(3) == 6
            time.sleep(0.001)
        got.append(monitor.maybe_report(it))
    assert [r is not None for r in got] == [False, False, True, False, False, True]
    report = got[2]
    assert report.iteration == 3 and report.stragglers == [] and report.should_stop is False
    assert report.metrics["straggler/train_step_relative_min"] == pytest.approx(1.0)
    assert "straggler/forward_step_individual_median" in report.metrics


def test_one_detector_per_process(monitor):
    with pytest.raises(RuntimeError, match="already initialized"):
        StragglerMonitor(StragglerConfig(), LAYOUT)


def test_close_is_idempotent_and_allows_a_new_monitor():
    m = StragglerMonitor(StragglerConfig(), LAYOUT)
    m.close()
    m.close()
    assert not Detector.initialized
    StragglerMonitor(StragglerConfig(), LAYOUT).close()


@pytest.mark.skipif(has_gpu(), reason="CPU shim only")
def test_cpu_shims_do_not_outlive_the_calls(monitor):
    assert nvrx_straggler.CuptiManager.__name__ == "CuptiManager"
    sync_before = torch.cuda.synchronize
    with monitor.step_section():
        pass
    monitor.maybe_report(3)
    assert nvrx_straggler.CuptiManager.__name__ == "CuptiManager"
    assert torch.cuda.synchronize is sync_before


def test_bad_config_names_the_fields():
    with pytest.raises(ValueError, match=r"(?s)straggler.report_interval.*straggler.relative_threshold"):
        StragglerMonitor(StragglerConfig(report_interval=0, relative_threshold=1.5), LAYOUT)


@pytest.fixture
def gpu_without_cupti(monkeypatch):
    """A GPU machine as the straggler code sees it, whose NVRx CUPTI extension does not import
    (``sys.modules[name] = None`` makes ``import name`` raise ImportError)."""
    import sys

    from tierstack.runtime import nvrx_cpu
    from tierstack.resiliency import straggler

    monkeypatch.setattr(nvrx_cpu, "has_gpu", lambda: True)
    monkeypatch.setattr(straggler, "has_gpu", lambda: True)
    monkeypatch.setitem(sys.modules, "nvrx_cupti_module", None)
    monkeypatch.setattr(nvrx_cpu, "_cupti_warned", False)


def test_kernel_profiling_falls_back_to_section_timing_with_one_warning(gpu_without_cupti, caplog):
    caplog.set_level("WARNING", logger="tierstack.runtime.nvrx_cpu")
    for _ in range(2):  # a second monitor in the same process does not warn again
        m = StragglerMonitor(StragglerConfig(report_interval=3), LAYOUT, node_name="node-a")
        try:
            assert m._profile_kernels is False
            with m.step_section():  # sections still time (no CUPTI profiling asked for)
                time.sleep(0.001)
        finally:
            m.close()
    warnings = [r for r in caplog.records if "kernel profiling is off" in r.getMessage()]
    assert len(warnings) == 1
    assert "CUPTI extension does not import (ModuleNotFoundError: import of nvrx_cupti_module" in warnings[0].getMessage()
    assert nvrx_straggler.CuptiManager.__name__ == "CuptiManager"  # the shim did not outlive setup


def test_forward_step_is_timed_on_cpu_only(gpu_without_cupti):
    """On a GPU the forward section would time kernel launches (no synchronize): not timed there."""
    m = StragglerMonitor(StragglerConfig(report_interval=3), LAYOUT, node_name="node-a")
    try:

        def forward(x):
            return x * 2

        assert m.wrap_forward_step(forward) is forward
    finally:
        m.close()


def test_forward_step_is_timed_without_gpu(monitor):
    if has_gpu():
        pytest.skip("CPU behaviour")

    def forward(x):
        return x * 2

    timed = monitor.wrap_forward_step(forward)
    assert timed is not forward and timed(3) == 6
