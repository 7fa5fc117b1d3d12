"""``release_distributed`` (the in-process restart's abort and finalize) leaves nothing of an attempt
alive: after each of several attempts (real gloo groups, megatron-core's parallel groups, the real
gpt_tiny model with rotary embeddings, a forward and backward), the process has as many gloo
threads as after the first. Each gloo group has a ``gloo_tcp_loop`` thread (and two
``pt_gloo_runloop`` workers) until it is freed; megatron-core 0.19's ``lru_cache`` on
``RotaryEmbedding.forward`` kept one group per attempt alive (Linux: thread names from ``/proc``)."""

import multiprocessing as mp
import os
import sys
import weakref
from collections import Counter

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/task")


def _thread_names() -> Counter:
    names = Counter()
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
        except OSError:  # a thread that ended meanwhile
            pass
    return names


def _attempts(n: int, out) -> None:
    try:
        import torch

        from tierstack import runtime
        from tierstack.models.gpt import gpt_model_provider
        from tierstack.recipes import gpt_tiny_config

        cfg = gpt_tiny_config()
        cfg.distributed.tensor_model_parallel_size = 1
        assert cfg.model.position_embedding_type == "rope"
        counts, kept = [], []
        for _ in range(n):
            runtime.initialize_distributed(tensor_model_parallel_size=1, pipeline_model_parallel_size=1, seed=1)
            model = gpt_model_provider(cfg, 257)()
            tokens = torch.randint(0, 257, (1, 32))
            model(tokens, torch.arange(32).unsqueeze(0), None, labels=tokens).float().mean().backward()
            rope = weakref.ref(model.rotary_pos_emb)
            del model  # what an attempt leaves: NVRx unwinds its frames
            runtime.release_distributed()
            kept.append(rope() is not None)
            names = _thread_names()
            counts.append((names["gloo_tcp_loop"], names["pt_gloo_runloop"]))
        out.put(("ok", (counts, kept)))
    except BaseException as e:  # noqa: BLE001 - reported to the test
        out.put(("error", repr(e)))


def test_each_attempt_releases_its_gloo_groups_and_the_models_caches():
    ctx = mp.get_context("spawn")  # a fresh interpreter: no group of the test process
    out = ctx.Queue()
    p = ctx.Process(target=_attempts, args=(4, out))
    p.start()
    status, result = out.get(timeout=240)
    p.join(timeout=60)
    assert status == "ok", result
    counts, kept = result
    assert not any(kept), f"an attempt's rotary embedding outlived release_distributed: {kept}"
    assert len(set(counts)) == 1, f"gloo (loop, worker) threads left after each attempt: {counts}"
