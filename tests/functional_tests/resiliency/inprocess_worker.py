"""One torchrun worker of an in-process restart scenario (``resiliency.restart=in-process``).

Usage: inprocess_worker.py OUT_DIR [section.field=value ...]

Runs ``tierstack.pretrain`` on the tiny GPT of ``nodes_worker.tiny_config`` through
``tierstack.resiliency.in_process.run`` and appends one line per step to
``OUT_DIR/losses_rank<r>.jsonl`` (``r``: the rank the process has in that attempt): step, loss as
float hex (bit-identical comparisons), the process id, the unix time at the end of the step and
the node (torchrun's ``GROUP_RANK``).

Fault, once per step listed (an ``O_EXCL`` marker in OUT_DIR decides): ``TIERSTACK_TEST_FAULT`` =
``raise`` | ``raise_peer_blocked`` (the rank raises while every other active rank blocks in C, in a
600 s ``time.sleep``, as in a process-group creation waiting for a peer that is gone) | ``damaged``
(the rank raises, and every later attempt of its process fails before any step, as after an
import cut in half) | ``kill`` | ``stop`` | ``nonfinite`` (an inf written into an Adam moment of the
rank's optimizer: the next checkpoint's check finds it) | ``term`` (SIGTERM to every active rank:
a planned exit; once it has ended, rank 0 sends SIGTERM to the spares too and every rank waits
3 s: the spares' deaths come after the run returned), on rank ``TIERSTACK_TEST_FAULT_RANK``
after each step of ``TIERSTACK_TEST_FAULT_AT`` (both comma-separated: the i-th step's rank is the
i-th rank listed, or the last one). Before it every rank waits for the LOCAL save in flight
(``CheckpointManager.wait``, collective), so the step resumed from does not depend on the speed
of the machine. The fault's unix time goes to ``OUT_DIR/fault.json``.
"""

import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from nodes_worker import tiny_config  # noqa: E402


def main() -> int:
    from tierstack.checkpointing import manager as manager_module
    from tierstack.resiliency import in_process, spares
    from tierstack.training.pretrain import pretrain

    out = Path(sys.argv[1])
    cfg = tiny_config(sys.argv[2:])
    fault = os.environ.get("TIERSTACK_TEST_FAULT", "")
    fault_at = [int(x) for x in os.environ.get("TIERSTACK_TEST_FAULT_AT", "0").split(",")]
    fault_ranks = [int(x) for x in os.environ.get("TIERSTACK_TEST_FAULT_RANK", "-1").split(",")]
    managers = []
    init = manager_module.CheckpointManager.__init__

    def capture(self, *args, **kwargs):
        init(self, *args, **kwargs)
        managers.append(self)

    manager_module.CheckpointManager.__init__ = capture
    objs_seen = []
    damaged = []  # fault "damaged": this process raised, and every later attempt of it fails at once
    observe = manager_module.CheckpointManager.observe_step

    def capture_objs(self, objs, result):
        objs_seen[:] = [objs]
        return observe(self, objs, result)

    manager_module.CheckpointManager.observe_step = capture_objs

    def on_step(ts, result):
        rank = int(os.environ["RANK"])
        with open(out / f"losses_rank{rank}.jsonl", "a") as f:
            f.write(json.dumps({"step": ts.step, "loss": float(result.loss).hex(), "pid": os.getpid(),
                                "t": time.time(), "node": int(os.environ.get("GROUP_RANK", "0"))}) + "\n")
        marker = out / ("fault.fired" if ts.step == fault_at[0] else f"fault.fired.{ts.step}")
        fault_rank = fault_ranks[min(fault_at.index(ts.step), len(fault_ranks) - 1)] if ts.step in fault_at else -1
        # each rank decides on its own marker: the faulting rank may have run ahead and written its
        # own already (CheckpointManager.wait is collective only while a save is in flight), and a
        # peer that then skipped its part (CI under load: no block, no kill) changed the scenario
        mine = marker if rank == fault_rank else marker.with_name(f"{marker.name}.peer{rank}")
        if fault and ts.step in fault_at and not mine.exists():
            managers[-1].wait()  # collective: the LOCAL save in flight is sealed on every rank
            if rank != fault_rank:
                os.close(os.open(mine, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                if fault == "raise_peer_blocked":  # blocked in C: NVRx's interruption cannot end it
                    print(f"BLOCKED rank {rank} (pid {os.getpid()}) after step {ts.step}", flush=True)
                    time.sleep(600)
                return
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            if not (out / "fault.json").exists():
                (out / "fault.json").write_text(json.dumps({"fault": fault, "t": time.time(), "pid": os.getpid()}))
            print(f"FAULT {fault} on rank {rank} (pid {os.getpid()}) after step {ts.step}", flush=True)
            if fault == "damaged":  # what an import cut in half leaves: this process fails every set-up
                damaged.append(os.getpid())
            if fault in ("raise", "raise_peer_blocked", "damaged"):
                raise RuntimeError(f"injected failure on rank {rank} after step {ts.step}")
            if fault == "nonfinite":
                from tierstack.checkpointing.state import torch_optimizers

                opt = torch_optimizers(objs_seen[0].optimizer)[0]
                opt.state[opt.param_groups[0]["params"][0]]["exp_avg"].view(-1)[0] = float("inf")
                return
            if fault == "term":  # every active rank's process (rank 0's from its last record)
                peer = json.loads((out / "losses_rank0.jsonl").read_text().splitlines()[-1])["pid"]
                for pid in (peer, os.getpid()):
                    os.kill(pid, signal.SIGTERM)
                return
            os.kill(os.getpid(), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)

    def train(config):
        if damaged:
            raise AttributeError("partially initialized module 'fake' has no attribute 'core' (injected damage)")
        state = pretrain(config, on_step=on_step)
        if int(os.environ["RANK"]) == 0:
            print(f"FINAL step={state.step} resumed_from={state.resumed_from} pid={os.getpid()}", flush=True)
        if fault == "term" and state.step < config.train.train_iters:  # every rank still in this attempt
            if int(os.environ["RANK"]) == 0:
                for p in out.glob("spare_*.pid"):
                    os.kill(int(p.read_text()), signal.SIGTERM)
            time.sleep(3.0)
        return state

    if spares.is_spare(cfg):
        (out / f"spare_{os.environ['RANK']}.pid").write_text(str(os.getpid()))

    return in_process.run(cfg, train, rehearse=pretrain)  # the spare rehearses without on_step


if __name__ == "__main__":
    code = main()
    from tierstack.runtime import process_exiting

    process_exiting()
    sys.exit(code)
