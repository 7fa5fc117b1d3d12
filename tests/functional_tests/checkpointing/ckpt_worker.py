"""One rank of a checkpointing scenario, launched by the tests with ``torchrun --nproc-per-node 2``
(or as a plain 1-rank ``python`` process where a scenario needs no second rank).

Usage: ckpt_worker.py OUT_DIR [--hold-writers] [--kill-during-local-write STEP] [--hang-global-writer-on RANK]
    [section.field=value ...]

Runs ``tierstack.pretrain`` on a tiny GPT (2 layers, hidden 64, 4 heads, seq 32, micro batch 2, mock
data, dropout 0.1, validation every 3 steps) and writes ``OUT_DIR/rank<r>.json`` (per-step losses and grad norms as float hex, resume info, final
TrainState, validation losses by step, published GLOBAL steps, whether the GLOBAL tracker existed after each step) and
``OUT_DIR/params<r>.pt`` (final parameters of this rank).
"""

import json
import os
import sys
import time
from pathlib import Path


def tiny_config(overrides):
    from tierstack.config import ConfigContainer

    cfg = ConfigContainer()
    cfg.apply_overrides([
        "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=32",
        "model.transformer_impl=local", "train.micro_batch_size=2", "train.global_batch_size=4",
        # dropout and validation on: an exact resume must restore every random draw of a step
        "model.hidden_dropout=0.1", "model.attention_dropout=0.1", "train.eval_interval=3", "train.eval_iters=1",
        "dataset.mock=true", "scheduler.lr_warmup_iters=2",
        "scheduler.lr_decay_iters=8", "logger.log_interval=100", "logger.progress_bar=false", "logger.loss_curve=false",
        "checkpoint.retry_backoff_s=0.1",
    ])
    cfg.apply_overrides(overrides)
    return cfg


def hold_writers_until(release: Path, timeout_s: float = 200.0):
    """Make the background writers of both tiers wait, before each file write, until ``release`` exists.

    The worker creates the file when its last step has run, so every save scheduled before then is
    written only after the later steps changed the parameters in place, and no GLOBAL save can be
    published before then: what the tests check follows from the order of events, not from how
    fast this machine is. (The writers are threads of this process: patching the functions they
    call is enough.) ``timeout_s`` only keeps a broken test from hanging.
    """
    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    from tierstack.checkpointing import local_file

    def wait():
        deadline = time.monotonic() + timeout_s
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.02)

    global_write = FileSystemWriterAsync.write_preloaded_data
    local_write = local_file.write

    def held_global(*args, **kwargs):
        wait()
        return global_write(*args, **kwargs)

    def held_local(*args, **kwargs):
        wait()
        return local_write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(held_global)
    local_file.write = held_local


def hang_first_global_write(rank: int, out: Path):
    """On ``rank``, the first GLOBAL write never returns (a hung file system): its writer thread
    blocks for good; the other ranks write normally. Later writes are not held. The hung write
    creates ``out/hung_global_write_rank<rank>`` first, so the test sees the fault did run."""
    import threading

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    if int(os.environ.get("RANK", "0")) != rank:
        return
    real_write = FileSystemWriterAsync.write_preloaded_data
    first = [True]

    def hung(*args, **kwargs):
        if first[0]:
            first[0] = False
            out.mkdir(parents=True, exist_ok=True)
            (out / f"hung_global_write_rank{rank}").touch()
            threading.Event().wait()  # never set
        return real_write(*args, **kwargs)

    FileSystemWriterAsync.write_preloaded_data = staticmethod(hung)


def kill_during_local_write(step):
    """Rank 1 writes half of its LOCAL file of ``step``, then SIGKILLs itself (a node lost mid-save)."""
    import signal

    from tierstack.checkpointing import local_file

    real_write = local_file.write

    def write(path, header, buffers, *args, **kwargs):
        if os.environ.get("RANK") == "1" and f"iter_{step:07d}_" in path.name:
            dirty = path.with_name(path.name.replace(".pt", ".dirty.pt"))
            dirty.write_bytes(local_file.MAGIC + header[: len(header) // 2])
            os.kill(os.getpid(), signal.SIGKILL)
        return real_write(path, header, buffers, *args, **kwargs)

    local_file.write = write


def _optim_sums(optimizer):
    """Adam state fingerprint (moments and step counters) of this rank."""
    from tierstack.checkpointing import state as ckpt_state

    out = {}
    for i, opt in enumerate(ckpt_state.inner_optimizers(optimizer)):
        torch_opt = opt.optimizer
        for j, group in enumerate(torch_opt.param_groups):
            out[f"{i}.group{j}"] = {k: str(v) for k, v in group.items() if k != "params"}
            for n, p in enumerate(group["params"]):
                for k, v in torch_opt.state.get(p, {}).items():
                    out[f"{i}.{j}.{n}.{k}"] = float(v.double().sum()).hex() if hasattr(v, "double") else str(v)
    return out


def _param_sums(model):
    """Per-parameter sums as float hex: a cheap fingerprint to locate where two runs diverge."""
    from tierstack.checkpointing import state as ckpt_state

    sd = ckpt_state.unwrap(model[0]).state_dict()
    return {k: float(v.double().sum()).hex() for k, v in sd.items() if hasattr(v, "double") and v.is_floating_point()}


def main():
    out = Path(sys.argv[1])
    args = sys.argv[2:]
    release = None
    while args[:1] in (["--hold-writers"], ["--kill-during-local-write"], ["--hang-global-writer-on"]):
        if args[0] == "--hang-global-writer-on":
            hang_first_global_write(int(args[1]), out)
            args = args[2:]
        elif args[0] == "--hold-writers":
            release = out / "release_writers"
            hold_writers_until(release)
            args = args[1:]
        else:
            kill_during_local_write(int(args[1]))
            args = args[2:]
    cfg = tiny_config(args)
    rank = int(os.environ.get("RANK", "0"))  # a plain `python` launch is a 1-rank run
    record = {"losses": {}, "grad_norms": {}, "val_losses": {}, "tracker_after_step": {}, "param_sums": {}}
    tracker = Path(cfg.checkpoint.save) / "latest_checkpointed_iteration.txt" if cfg.checkpoint.save else None

    import torch

    from tierstack.checkpointing import state as ckpt_state
    from tierstack.training import setup as setup_mod
    from tierstack.training.pretrain import pretrain

    captured = {}
    real_setup = setup_mod.setup

    def spy_setup(c, **kwargs):
        from megatron.core.utils import get_model_config

        s = real_setup(c, **kwargs)
        captured["s"] = s
        # production wiring, never patched here: DP reduction and PP tied embeddings depend on it
        record["grad_finalization_wired"] = get_model_config(s.model[0]).finalize_model_grads_func is not None
        record["param_sums"]["resume"] = _param_sums(s.model)
        record["optim_sums"] = {"resume": _optim_sums(s.optimizer)}
        return s

    setup_mod.setup = spy_setup

    from tierstack.training import train as train_mod

    real_evaluate = train_mod.evaluate

    def spy_evaluate(*a, **kw):  # validation losses by step: an exact resume repeats them too
        loss = real_evaluate(*a, **kw)
        record["val_losses"][captured["step"]] = float(loss).hex()
        return loss

    train_mod.evaluate = spy_evaluate

    from tierstack.checkpointing import CheckpointManager, CheckpointTier

    real_close = CheckpointManager.close

    def spy_close(self, error=None):  # what was still being written when training ended
        record.setdefault("in_flight_at_close", {t.value: self.in_flight(t) for t in CheckpointTier})
        return real_close(self, error)

    CheckpointManager.close = spy_close

    def on_step(ts, result):
        record["losses"][str(ts.step)] = float(result.loss).hex()
        record["grad_norms"][str(ts.step)] = float(result.grad_norm).hex()
        captured["step"] = str(ts.step)
        if tracker is not None:
            record["tracker_after_step"][str(ts.step)] = tracker.read_text().strip() if tracker.exists() else None
        s = captured["s"]
        record["param_sums"][str(ts.step)] = _param_sums(s.model)
        record.setdefault("optim_sums", {})[str(ts.step)] = _optim_sums(s.optimizer)
        captured["params"] = {k: v.detach().clone() for k, v in ckpt_state.unwrap(s.model[0]).state_dict().items()
                              if isinstance(v, torch.Tensor)}
        if release is not None and ts.step == cfg.train.train_iters:
            out.mkdir(parents=True, exist_ok=True)
            release.touch()  # the last step's state is recorded: the held writers may go on

    t0 = time.time()
    final = pretrain(cfg, on_step=on_step)
    s = captured["s"]
    info = s.resume_info
    record.update(
        resume=None if info is None else {"tier": info.tier.value, "step": info.step, "seconds": info.seconds},
        train_state=final.state_dict(),
        published=[e.step for e in s.checkpoint_manager.events],
        local_sealed=s.checkpoint_manager.saved_steps(CheckpointTier.LOCAL),
        events=[{"step": e.step, "bytes": e.bytes, "seconds": e.seconds} for e in s.checkpoint_manager.events],
        wall_s=time.time() - t0,
    )
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(record, indent=1))
    torch.save(captured.get("params", {}), out / f"params{rank}.pt")


if __name__ == "__main__":  # the async writer starts a spawn-context manager: keep the guard
    main()
    from tierstack.runtime import process_exiting

    process_exiting()  # skip the final GC pass over torch's objects (0.7 s per rank)
