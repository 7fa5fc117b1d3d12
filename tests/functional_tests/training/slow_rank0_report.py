"""The main job's recipe under torchrun, with rank 0 late to print a refusal (a busy machine).

Rank 0's ``runner._report`` sleeps 5 s first: a rank that exits before rank 0 has printed makes
torchrun stop rank 0 (SIGTERM) and the refusal is never seen.
"""

import os
import time

from tierstack.recipes import gpt_tiny_config, run, runner

if os.environ.get("RANK") == "0":
    _original = runner._report

    def _late_report(message: str) -> None:
        time.sleep(5)
        _original(message)

    runner._report = _late_report

if __name__ == "__main__":
    raise SystemExit(run(gpt_tiny_config))
