"""``distributed.timeout_s`` bounds megatron-core's groups too, not only WORLD: 2 real gloo ranks
with TP=2 and a 3 s timeout; rank 1 stops taking part (a stopped rank) and rank 0's all-reduce on the
tensor-parallel group fails within seconds. Found by trying: a SIGSTOPped rank hung a TP collective
in the backward pass with no end in sight (megatron's own default for its groups is 30 minutes)."""

import os
import time


def _rank(rank: int, port: int, out) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), CUDA_VISIBLE_DEVICES="")
    import torch
    from megatron.core import parallel_state

    from tierstack.runtime.distributed import initialize_distributed

    initialize_distributed(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, seed=1, timeout_s=3.0)
    if rank == 1:
        time.sleep(30.0)  # stopped: never joins the collective
        out.put((rank, "slept", 0.0))
        return
    t0 = time.monotonic()
    try:
        torch.distributed.all_reduce(torch.ones(4), group=parallel_state.get_tensor_model_parallel_group())
        out.put((rank, "returned", time.monotonic() - t0))
    except Exception as e:  # noqa: BLE001 - the timeout is what is tested
        out.put((rank, type(e).__name__, time.monotonic() - t0))


def test_a_stopped_rank_fails_a_tensor_parallel_collective_within_distributed_timeout_s(start_ranks, free_port):
    procs, out = start_ranks(_rank, free_port)
    rank, what, seconds = out.get(timeout=120)  # rank 0 reports long before rank 1 wakes
    for p in procs:
        p.kill()
        p.join()
    assert rank == 0 and what != "returned", (rank, what)
    assert seconds < 20.0, seconds  # the 3 s bound, not megatron's 30 min (generous on a busy machine)
