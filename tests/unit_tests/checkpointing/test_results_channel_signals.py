"""The GLOBAL writer's result channel survives a job-wide SIGTERM/SIGINT (found by the break-it pass).

A scheduler's pre-emption notice (SLURM, ``timeout``, Ctrl-C) reaches every process of the job, the
Manager server behind megatron-core's write-results queue included. The rank turns the signal into a
planned exit whose GLOBAL save still needs that server; before the fix the server died on the signal
and the planned-exit save failed with EPIPE.
"""

import os
import signal
import time

from torch.distributed.checkpoint.metadata import MetadataIndex

from tierstack.checkpointing import global_writer


def test_results_channel_ignores_sigterm_and_sigint():
    # A queue another test left (megatron's own Manager, without our initializer) would be reused.
    global_writer.shutdown_results_channel()
    q = global_writer.start_results_channel()
    try:
        server = q._manager._process  # the Manager's server process (multiprocessing.Process)
        for sig in (signal.SIGTERM, signal.SIGINT):
            os.kill(server.pid, sig)
        time.sleep(1.0)
        assert server.is_alive()
        q.put(MetadataIndex("after-signal"))
        assert q.get(timeout=30).fqn == "after-signal"
    finally:
        global_writer.shutdown_results_channel()
    assert not server.is_alive()
