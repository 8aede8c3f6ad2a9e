"""Crash consistency, short: a few SIGKILLs of fuyoud at random moments of training
(bench/crash.py runs many; see its docstring for what each trial checks)."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import crash  # noqa: E402

STEPS = 16


@pytest.fixture(scope="module")
def reference():
    data = crash.batches(STEPS)
    return crash.Reference(STEPS, data), data


@pytest.mark.parametrize("seed", [0, *(pytest.param(s, marks=pytest.mark.slow) for s in range(1, 4))])
def test_sigkill_at_a_random_moment_loses_nothing_committed(short_tmp, reference, seed):
    ref, data = reference
    trial = crash.run_trial(short_tmp, random.Random(seed), ref, data, STEPS)
    if trial.detect_s is not None:  # the client was still training when the daemon died
        assert trial.detect_s < crash.DETECT_LIMIT_S
    assert set(trial.states.values()) <= {trial.acked_step, trial.acked_step + 1}
    if trial.checkpoint is not None:
        assert trial.resumed_to is not None
