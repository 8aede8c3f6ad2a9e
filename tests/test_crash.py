"""Crash consistency, short: fuyoud SIGKILLed at a random moment of training, or inside a
checkpoint, and restarted (bench/crash.py runs many; its docstring says what a trial
does). A trial itself raises where the state after the restart is not bitwise the
reference's at the acknowledged step (or the one in flight) or a resumed run diverges;
this test asserts that the trial exercised what it claims (the kill interrupted training
or a checkpoint, the client noticed with DaemonUnavailable, a checkpoint was resumed) and
what the trial only records: a restart leaves no partial checkpoint directory, a
checkpoint directory that exists is complete (it is resumed from), and once everything is
deleted the array holds nothing (the crash leaked no extent)."""
from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
import crash  # noqa: E402

STEPS = 16
GROUPS = 5  # (Blocks: four blocks, and one group for the rest)


@pytest.fixture(scope="module")
def reference():
    data = crash.batches(STEPS)
    return crash.Reference(STEPS, data), data


def slow(*values):
    return pytest.param(*values, marks=pytest.mark.slow)


# Seeds whose kill comes after the first checkpoint (random.Random(seed).randrange(16):
# 12, 4, 7), so that every trial resumes one. The default suite's case kills inside a
# checkpoint: it has the most to clean up.
@pytest.mark.parametrize("seed, at", [(1, "checkpoint"), slow(0, "random"), slow(1, "random"), slow(3, "random"),
                                      slow(0, "checkpoint")])
def test_sigkill_loses_nothing_committed_and_leaves_nothing_behind(short_tmp, reference, seed, at):
    ref, data = reference
    trial = crash.run_trial(short_tmp, random.Random(seed), ref, data, STEPS, at=at)
    # What the trial exercised.
    assert trial.killed_during == ("checkpoint" if at == "checkpoint" else trial.killed_during)
    assert trial.killed_during in ("training", "checkpoint"), trial  # (not after the run: that tests nothing)
    assert trial.detect_s is not None and trial.detect_s < crash.DETECT_LIMIT_S, trial
    assert len(trial.states) == GROUPS and trial.checkpoint is not None
    assert trial.resumed_from in (trial.checkpoint, trial.checkpoint + 4)  # (+4: the interrupted one, complete)
    assert trial.resumed_to == min(trial.resumed_from + 3, STEPS)
    # What only this test checks: the restart cleaned up, and nothing leaked.
    assert trial.debris == []
    assert trial.left_bytes == 0, f"{trial.left_bytes} bytes still used on the array once everything was deleted"
