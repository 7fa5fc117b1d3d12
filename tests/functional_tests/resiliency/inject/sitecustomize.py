"""Put on PYTHONPATH by the fault-injection tests: installs tests/functional_tests/resiliency/faults.py
into every Python process of a rank (torchrun's agent has no RANK and is left alone)."""

import os
import sys

if os.environ.get("TIERSTACK_FAULTS"):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import faults  # noqa: E402

    faults.install()
    sys.path.pop(0)
