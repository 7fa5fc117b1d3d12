"""The chaos soak's fault schedule (``scripts/chaos_faults.schedule``) for the plans the soak makes
(``chaos._plan``: 1.5 and 10 minutes, 0.4-0.9 s per iteration): every seed gets one; a process
fault never lands in the iterations right after a GLOBAL save that has an I/O fault, where it would
cut that save's retry and publication (seen: EIO at step 50, a node replacement at 52,
"published: False"); a slow LOCAL write never takes a GLOBAL save's step (then 3-29 seeds of 200
found no free GLOBAL save for eio or enospc, and the soak stopped with a ValueError)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))

import chaos_faults  # noqa: E402


_PLANS = [(max(60, int((minutes * 60 * 0.85 - 30) / step_s)), max(7, round(minutes)),
           max(2, round(20 / step_s / 5)) * 5) for step_s in (0.4, 0.5, 0.6, 0.7, 0.82, 0.9) for minutes in (1.5, 10)]


def test_no_process_fault_lands_while_a_faulted_global_save_settles():
    moved = 0
    for seed in range(200):
        for iterations, count, global_every in _PLANS:
            faults = chaos_faults.schedule(seed, iterations, count, chaos_faults.KINDS, 5, global_every)
            assert len(faults) == count and [f.kind for f in faults].count("enospc") == 1
            assert not {f.step for f in faults if f.kind == "slow"} & set(range(global_every, iterations, global_every))
            saves = [f.step for f in faults if f.kind in ("eio", "enospc")]
            for f in faults:
                if f.kind in chaos_faults.PROCESS_KINDS:
                    assert not any(g <= f.step < g + chaos_faults.GLOBAL_SETTLE_STEPS for g in saves), (seed, faults)
            process_steps = [f.step for f in faults if f.kind in chaos_faults.PROCESS_KINDS]
            assert len(set(process_steps)) == len(process_steps)  # never two process faults at one step
            moved += any(f.kind in chaos_faults.PROCESS_KINDS and g < f.step <= g + 2 * chaos_faults.GLOBAL_SETTLE_STEPS
                         for f in faults for g in saves)
    assert moved  # the window was exercised: some faults sit right after it
