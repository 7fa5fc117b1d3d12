"""The one package that knows CPU from GPU: device, backend, process groups, RNG state.

Nothing else in tierstack calls ``torch.cuda``; it asks this package. Importing it installs the
filters of :mod:`tierstack.runtime.known_warnings` (torch's before torch is imported; megatron-core's
CPU-only ones when there is no GPU), so ``import tierstack`` does it before anything else loads.
"""

from tierstack.runtime import known_warnings

known_warnings.install_import_filters()

from tierstack.runtime.host_copy import copy_to_host, empty_host_buffer, empty_host_buffers  # noqa: E402
from tierstack.runtime.fusions import fusion_flags  # noqa: E402
from tierstack.runtime import jit_fuser  # noqa: E402
from tierstack.runtime.profiling import memory_report, nvtx_range, profiler_activities  # noqa: E402
from tierstack.runtime.distributed import (  # noqa: E402
    ParallelLayout,
    current_layout,
    default_backend,
    destroy_distributed,
    release_distributed,
    device,
    get_rng_state,
    has_gpu,
    initialize_distributed,
    memory_allocated_bytes,
    process_exiting,
    seed_all,
    set_rng_state,
    synchronize,
)

if not has_gpu():
    known_warnings.install_cpu_filters()
    jit_fuser.install_cpu_hook()  # megatron-core's JIT functions run eagerly on a CPU: no torch.compile import

__all__ = [
    "copy_to_host",
    "empty_host_buffer",
    "empty_host_buffers",
    "ParallelLayout",
    "current_layout",
    "default_backend",
    "destroy_distributed",
    "release_distributed",
    "process_exiting",
    "device",
    "fusion_flags",
    "get_rng_state",
    "has_gpu",
    "initialize_distributed",
    "memory_allocated_bytes",
    "memory_report",
    "nvtx_range",
    "profiler_activities",
    "seed_all",
    "set_rng_state",
    "synchronize",
]
