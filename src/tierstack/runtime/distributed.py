"""Device, backend and process-group set-up: the one place that knows CPU from GPU."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from tierstack.runtime import attempt_store, cpu_compat, group_sockets, known_warnings
from tierstack.runtime.devices import default_backend, device, has_gpu  # noqa: F401 - re-exported

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ParallelLayout:
    """Ranks and sizes of this process in each parallel dimension."""

    rank: int
    world_size: int
    local_rank: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    data_parallel_size: int
    tensor_model_parallel_rank: int
    pipeline_model_parallel_rank: int
    data_parallel_rank: int
    # Nodes, from torchrun's environment: ranks on this node (LOCAL_WORLD_SIZE) and this node's
    # index (GROUP_RANK, the agent's rank in the rendezvous). A plain launch is one node.
    local_world_size: int = 0  # 0: unknown, taken as world_size (one node)
    node_rank: int = 0

    @property
    def ranks_per_node(self) -> int:
        """Ranks on each node (torchrun starts the same number on every node)."""
        return self.local_world_size or self.world_size

    @property
    def rank_on_node(self) -> int:
        """This rank's index among the ranks that train on its node: ``rank - node_rank x
        ranks_per_node`` under torchrun (node-major global ranks), ``local_rank`` without it. Not
        ``LOCAL_RANK`` under in-process restart with spares: a spare keeps its torchrun local rank
        (its device) when it takes the rank of a node's first process."""
        if not self.local_world_size:
            return self.local_rank
        return self.rank - self.node_rank * self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        """Nodes in the job: ``world_size // ranks_per_node``."""
        return max(1, self.world_size // self.ranks_per_node)

    def topology(self) -> dict:
        """Sizes only (what a LOCAL checkpoint must match to be loadable)."""
        return {
            "world_size": self.world_size,
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "data_parallel_size": self.data_parallel_size,
        }


def synchronize() -> None:
    """Wait for queued device work (no-op on CPU); call before reading wall-clock timers."""
    if has_gpu():
        torch.cuda.synchronize()


def memory_allocated_bytes() -> int:
    """Bytes of device memory held by tensors on this rank (0 on CPU)."""
    return int(torch.cuda.memory_allocated()) if has_gpu() else 0


def get_rng_state() -> dict:
    """RNG state of this process: python, numpy, torch CPU and (on GPU) CUDA generator + tracker."""
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    state = {
        "random": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        "rng_tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if has_gpu():
        state["torch_cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    """Restore a state produced by :func:`get_rng_state`."""
    import random

    import numpy as np
    from megatron.core import tensor_parallel

    random.setstate(state["random"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if has_gpu() and "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["rng_tracker"])


def check_device_ordinal(local_rank: int, device_count: int) -> None:
    """Fail clearly when this rank has no CUDA device of its own.

    torchrun gives local ranks ``0 .. nproc-per-node - 1`` and each rank computes on
    ``cuda:<LOCAL_RANK>``; more processes per node than visible devices would otherwise end in
    CUDA's "invalid device ordinal" from deep inside ``set_device``.

    Raises:
        ValueError: ``local_rank >= device_count``; names the launcher setting and the variable to fix.
    """
    if local_rank >= device_count:
        raise ValueError(
            f"LOCAL_RANK={local_rank} has no CUDA device: this node shows {device_count} "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); start at most "
            f"{device_count} processes per node (torchrun --nproc-per-node {device_count}) or make more "
            "devices visible"
        )


def process_group_device(backend: str, local_rank: int) -> dict:
    """Extra ``init_process_group`` arguments: the rank's device for NCCL, nothing otherwise.

    With ``device_id`` NCCL binds the communicator to this rank's GPU at init (eagerly) instead of
    guessing it at the first collective, and later barriers do not warn that the device is unknown
    (``torch.distributed.init_process_group``, ``device_id``, torch >= 2.3).
    """
    if "nccl" in backend:
        return {"device_id": torch.device("cuda", local_rank)}
    return {}


def initialize_distributed(
    *,
    tensor_model_parallel_size: int,
    pipeline_model_parallel_size: int,
    seed: int,
    backend: Optional[str] = None,
    timeout_s: float = 600.0,
) -> ParallelLayout:
    """Initialise torch.distributed from the torchrun environment and megatron's parallel groups.

    A plain ``python`` launch (no ``WORLD_SIZE``/``MASTER_PORT``) becomes a 1-rank group on an
    in-process store (no port). On a machine without CUDA the CPU compatibility layer is activated first.

    Args:
        tensor_model_parallel_size / pipeline_model_parallel_size: megatron TP and PP sizes;
            data-parallel size is ``world_size // (TP * PP)``.
        seed: base seed; megatron offsets it per TP rank for the model-parallel RNG stream, and
            pipeline stages get ``seed + 100 * pp_rank`` (the Megatron-LM convention).
        backend: override of :func:`default_backend`.
        timeout_s: collective timeout in seconds, of WORLD and of every megatron-core group (TP,
            PP, DP, ...); it also bounds the ranks' meeting in torchrun's shared store (:func:`~tierstack.runtime.attempt_store.attempt_store`).

    Raises:
        ValueError: world size not divisible by TP * PP (names the distributed.* fields), or on a
            GPU machine ``LOCAL_RANK`` without a CUDA device (see :func:`check_device_ordinal`).
        attempt_store.StartHandshakeError: under torchrun's shared store, the ranks of this start
            did not all meet within ``timeout_s``.
    """
    from megatron.core import parallel_state, tensor_parallel

    if not has_gpu():
        cpu_compat.activate()
    # A plain 1-rank launch needs no TCP store: an in-process one leaves no port to race for (a
    # free port picked here could be taken before the store binds it: EADDRINUSE in CI).
    single = "WORLD_SIZE" not in os.environ and "MASTER_PORT" not in os.environ
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size % (tensor_model_parallel_size * pipeline_model_parallel_size):
        raise ValueError(
            f"world size {world_size} is not divisible by distributed.tensor_model_parallel_size * "
            f"distributed.pipeline_model_parallel_size = "
            f"{tensor_model_parallel_size * pipeline_model_parallel_size}"
        )
    backend = backend or default_backend()
    if has_gpu():
        check_device_ordinal(local_rank, torch.cuda.device_count())
        torch.cuda.set_device(local_rank)
    group_sockets.install()  # an abort can then close this process's groups' connections (release_distributed)
    if not dist.is_initialized():
        # Under torchrun's shared store, the keys of this start only (restarts: see attempt_store).
        store = dist.HashStore() if single else attempt_store.attempt_store(rank, world_size, timeout_s)
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=timeout_s),
            **({"store": store} if store is not None else {}),
            **process_group_device(backend, local_rank),
        )
    from tierstack.runtime import collectives

    collectives.training_timeout_s = timeout_s  # what a bounded block of checkpoint collectives restores
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            # megatron's groups (TP, PP, DP, ...) get the same bound as WORLD (its default is 30 min:
            # a stopped rank hung a tensor-parallel collective in the backward pass for that long)
            distributed_timeout_minutes=timeout_s / 60.0,
        )
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    seed_all(seed + 100 * pp_rank)
    tensor_parallel.model_parallel_cuda_manual_seed(seed + 100 * pp_rank)
    absent = known_warnings.absent_gpu_packages()
    if rank == 0 and absent:  # one line per run, instead of megatron-core's per-rank warnings
        log.info(
            "optional GPU packages not installed: %s (%s)",
            ", ".join(absent),
            "megatron-core's local implementations are used" if has_gpu() else "a CPU run does not use them",
        )
    return current_layout()


def seed_all(seed: int) -> None:
    """Seed python, numpy and torch generators of this process."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def current_layout() -> ParallelLayout:
    """The :class:`ParallelLayout` of this process (megatron parallel state must be initialised)."""
    from megatron.core import parallel_state as ps

    return ParallelLayout(
        rank=dist.get_rank(),
        world_size=dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        tensor_model_parallel_size=ps.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=ps.get_pipeline_model_parallel_world_size(),
        data_parallel_size=ps.get_data_parallel_world_size(),
        tensor_model_parallel_rank=ps.get_tensor_model_parallel_rank(),
        pipeline_model_parallel_rank=ps.get_pipeline_model_parallel_rank(),
        data_parallel_rank=ps.get_data_parallel_rank(),
        local_world_size=int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0),
        node_rank=int(os.environ.get("GROUP_RANK", "0") or 0),
    )


def destroy_distributed() -> None:
    """Tear down megatron's parallel groups and the default process group (safe to call twice)."""
    from megatron.core import parallel_state

    try:
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def release_distributed() -> None:
    """Drop every process group of this process after a failure, from any thread, never raising:
    first shut down the connections of every group built here (:func:`group_sockets.shut_down
    <tierstack.runtime.group_sockets.shut_down>`), then megatron's parallel groups, then WORLD, then
    megatron-core's caches (:func:`clear_library_caches`), then a garbage collection so that the
    groups nobody refers to any more are freed now.

    Why: a gloo collective cannot be aborted; a rank blocked in one waits until its peers'
    connections close. Shutting them down here releases the ranks still waiting on this one at
    once, instead of at ``distributed.timeout_s`` or when NVRx's hard timeout kills them (the
    in-process restart's abort), even while this rank's model or frames still refer to the groups.
    """
    import gc

    from megatron.core import parallel_state

    try:
        group_sockets.shut_down()
    except Exception as e:  # noqa: BLE001 - never raises by design; a release must go on whatever happens
        log.debug("shutting down the groups' connections: %s: %s", type(e).__name__, e)

    for step in (parallel_state.destroy_model_parallel, dist.destroy_process_group):
        try:
            if dist.is_initialized() or step is parallel_state.destroy_model_parallel:
                step()
        except Exception as e:  # noqa: BLE001 - already destroyed, or a peer gone: nothing to release
            log.debug("releasing process groups: %s: %s", type(e).__name__, e)
    if not dist.is_initialized():
        # An init_process_group cut short (an interruption in its rendezvous, which the attempt's
        # store lets through: attempt_store.InterruptibleStore) counted its group but registered no
        # WORLD, so destroy_process_group, which resets the count, never ran: the next WORLD of
        # this process would be named "1" and wait for keys its peers write under "0" (a hang
        # until distributed.timeout_s, seen after a second fault during a restart's set-up).
        dist.distributed_c10d._world.group_count = 0
    try:
        clear_library_caches()
    except Exception as e:  # noqa: BLE001 - a module changing under the walk: the next release clears it
        log.debug("clearing megatron-core's caches: %s: %s", type(e).__name__, e)
    gc.collect()


def clear_library_caches() -> int:
    """Empty every non-empty ``functools.lru_cache`` of the loaded ``megatron.core`` modules (module
    functions and methods of their classes); returns how many were emptied. Their values are
    computed again on first use.

    Why: a cache on a method keys on the instance, so it keeps that instance alive, and with it
    what the instance refers to. megatron-core 0.19's ``RotaryEmbedding.forward`` (``maxsize=32``)
    kept every attempt's rotary embedding of an in-process restart, and its context-parallel group:
    one more gloo group per restart, never closed (a listening socket, an epoll loop and two
    worker threads each, measured on CPU with ``/proc/<pid>/task``; on a GPU an NCCL communicator).
    """
    import functools
    import sys

    cleared = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "megatron.core" or name.startswith("megatron.core.")):
            continue
        for value in list(vars(module).values()):
            owned_class = isinstance(value, type) and value.__module__ == name
            for item in (list(vars(value).values()) if owned_class else [value]):
                fn = getattr(item, "__func__", item)  # a staticmethod's or classmethod's function
                if isinstance(fn, functools._lru_cache_wrapper) and fn.cache_info().currsize:
                    fn.cache_clear()
                    cleared += 1
    return cleared


def process_exiting() -> None:
    """Call as the last thing before a process that ran training exits (the ``tierstack`` command
    does): ``gc.freeze()``, so the interpreter's final garbage collection skips every object that
    exists now, most of them torch's and megatron-core's (measured: 0.7 s of CPU per rank at each
    exit on 2 CPU cores; the test suite makes about 80 such launches). The memory goes back to the
    OS with the process; whatever holds a resource was closed before (the run's closers)."""
    import gc

    gc.freeze()


def return_free_heap() -> bool:
    """Hand the C heap's free pages back to the operating system (glibc ``malloc_trim(0)``); False
    where there is no glibc. After an in-process restart released an attempt's model, optimizer and
    process groups, the freed memory stayed in the process: its resident size grew about 20 MB per
    restart on CPU (664 to 927 MB over 12 restarts of gpt_tiny, 2 ranks); trimmed, 513 to 572 MB.
    """
    import ctypes

    try:  # the process's own symbols (no ``find_library``: it runs ldconfig in a subprocess)
        trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):  # not glibc (musl, macOS)
        return False
    trim(0)
    return True

