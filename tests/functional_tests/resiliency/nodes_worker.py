"""One rank of a multi-node scenario, launched by ``scripts/launch_nodes.sh`` (see launcher.run_nodes).

Usage: nodes_worker.py OUT_DIR [section.field=value ...]

Runs ``tierstack.pretrain`` on a tiny GPT (2 layers, hidden 64, 4 heads, seq 32, mock data) and
appends one line per step to ``OUT_DIR/losses_rank<r>.jsonl``: the launch label
(``$TIERSTACK_TEST_LAUNCH``), torchrun's restart count, the step and its loss as float hex
(bit-identical comparisons), written as each step ends, so a killed run leaves its record. The
restart count is the job-wide one of ``<logger.run_dir>/restarts.json`` (the same on every rank).

Fault: with ``TIERSTACK_TEST_KILL_AT=<step>`` and ``TIERSTACK_TEST_KILL_NODE=<group rank>``, the
ranks of that node SIGKILL themselves after that step, in the first start of the launch only
(job-wide restart count 0), and print the node's ``checkpoint.local_dir`` first;
``TIERSTACK_TEST_KILL_RANK=<rank>`` instead of the node: only that rank (one torchrun, one node).
Each line also says whether torchrun's agent hosted the ranks' store (``agent_store``:
``TORCHELASTIC_USE_AGENT_STORE``), the case where a restart used to read the dead start's keys.
With ``TIERSTACK_TEST_HANG_AT=<step>`` and ``TIERSTACK_TEST_HANG_RANK=<rank>`` that rank stops
there instead (sleeps; a hung rank), in the first start only.
Before that, every rank waits for the checkpoint saves in flight (``CheckpointManager.wait``, a
collective): the node dies after the LOCAL save before it is sealed on every rank, whatever the speed
of this machine (on a fast one, a save's agreement can come a few steps after it started). With
``TIERSTACK_TEST_KILL_UNSEALED=1`` each rank waits only for its own LOCAL writer of the save in
flight instead (``on_step`` runs before the step's own saves: the LOCAL save of the step before):
the node dies with that step written (and replicated) but never sealed.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path


def tiny_config(overrides):
    from tierstack.config import ConfigContainer

    cfg = ConfigContainer()
    cfg.apply_overrides([
        "model.num_layers=2", "model.hidden_size=64", "model.num_attention_heads=4", "model.seq_length=32",
        "model.transformer_impl=local", "train.micro_batch_size=2", "train.global_batch_size=4",
        "train.eval_interval=null", "dataset.mock=true", "scheduler.lr_warmup_iters=2",
        "scheduler.lr_decay_iters=30", "logger.log_interval=100", "logger.progress_bar=false", "logger.loss_curve=false",
        "checkpoint.retry_backoff_s=0.1", "straggler=null", "mlflow=null",
    ])
    cfg.apply_overrides(overrides)
    return cfg


def main() -> None:
    from tierstack import pretrain

    out = Path(sys.argv[1])
    cfg = tiny_config(sys.argv[2:])
    rank, node = int(os.environ["RANK"]), int(os.environ.get("GROUP_RANK", "0"))
    restarts_file = Path(cfg.logger.run_dir) / "restarts.json"
    launch = os.environ.get("TIERSTACK_TEST_LAUNCH", "")
    kill_at = int(os.environ.get("TIERSTACK_TEST_KILL_AT", "0"))
    kill_node = int(os.environ.get("TIERSTACK_TEST_KILL_NODE", "-1"))
    kill_rank = int(os.environ.get("TIERSTACK_TEST_KILL_RANK", "-1"))
    hang_at = int(os.environ.get("TIERSTACK_TEST_HANG_AT", "0"))
    hang_rank = int(os.environ.get("TIERSTACK_TEST_HANG_RANK", "-1"))
    unsealed = os.environ.get("TIERSTACK_TEST_KILL_UNSEALED") == "1"
    record = open(out / f"losses_rank{rank}.jsonl", "a")
    managers = []
    from tierstack.checkpointing import manager as manager_module

    init = manager_module.CheckpointManager.__init__

    def capture(self, *args, **kwargs):
        init(self, *args, **kwargs)
        managers.append(self)

    manager_module.CheckpointManager.__init__ = capture
    slow = [tuple(int(x) for x in item.split(":")) for item in os.environ.get("TIERSTACK_TEST_SLOW_LOCAL_WRITE", "").split(",") if item]
    if slow:  # rank:step:seconds: that rank's LOCAL writer sleeps before writing that step
        from tierstack.checkpointing.local_tier import LocalTier

        write = LocalTier._write_and_seal

        def slow_write(self, step, *args, **kwargs):
            for r, s_, seconds in slow:
                if r == rank and s_ == step:
                    print(f"rank {rank}: LOCAL writer of step {step} sleeps {seconds} s", flush=True)
                    time.sleep(seconds)
            return write(self, step, *args, **kwargs)

        LocalTier._write_and_seal = slow_write
    if os.environ.get("TIERSTACK_TEST_REPLICATE_IN_FINALIZE") == "1":  # the GPU path, on this CPU
        from tierstack.checkpointing import local_replicas

        replication_init = local_replicas.LocalReplication.__init__

        def in_finalize(self, *args, **kwargs):
            replication_init(self, *args, **{**kwargs, "on_writer": False})

        local_replicas.LocalReplication.__init__ = in_finalize

    def on_step(ts, result):
        restart = json.loads(restarts_file.read_text())["restarts"] if restarts_file.exists() else 0
        record.write(json.dumps({"launch": launch, "restart": restart, "step": ts.step,
                                 "loss": float(result.loss).hex(),
                                 "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE")}) + "\n")
        record.flush()
        if ts.step in (kill_at, hang_at) and restart == 0 and unsealed:
            # Each rank waits for its own LOCAL writer (write, then the replication exchange) and no
            # more: the step is written everywhere and was never agreed on (sealed) by any rank.
            from tierstack.checkpointing.types import CheckpointTier

            in_flight = managers[-1]._tiers[CheckpointTier.LOCAL]._in_flight  # (saved after the last on_step)
            in_flight.job.exception()
            print(f"rank {rank}: LOCAL writer of step {in_flight.step} ended, step not sealed", flush=True)
        elif ts.step in (kill_at, hang_at) and restart == 0:
            managers[-1].wait()  # collective: every rank
        if ts.step == hang_at and rank == hang_rank and restart == 0:
            print(f"HANGING rank {rank} after step {ts.step}", flush=True)
            time.sleep(3600)
        if ts.step == kill_at and (node == kill_node or rank == kill_rank) and restart == 0:
            print(f"KILLING node {node} rank {rank} after step {ts.step}; local_dir={cfg.checkpoint.local_dir}",
                  flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    state = pretrain(cfg, on_step=on_step)
    if rank == 0:
        print(f"FINAL step={state.step} resumed_from={state.resumed_from}", flush=True)


if __name__ == "__main__":
    main()
    from tierstack.runtime import process_exiting

    process_exiting()  # skip the final GC pass over torch's objects (0.7 s per rank)
