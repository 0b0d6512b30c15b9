"""Fuzzing schedules: a mutated schedule is refused, or trains bitwise equal.

Hypothesis draws one to three mutations of a valid schedule (karma/testing/mutations.py: decision
words, numbers, lines deleted, duplicated and moved, keys reordered, ops deleted, duplicated
and moved, dependencies dropped and added, buffers' alloc and free moved), and each mutant
must be refused as karma-run refuses (a KarmaError: exit 2, no traceback) or train, in two
steps, bitwise equal to the unmutated schedule (to plain PyTorch with the options it states
when it changed them: a seed, a batch size); never another exception (karma-run's "internal
error"), never a hang (each run is bounded by a timeout). The runs are under chaos timing
(KARMA_CHAOS), so that a dependency a mutant dropped shows as a race. The examples are
derandomized: the same cases on every run. A few through the real karma-run prove the exit
status and the message end to end. bench/fuzz.py runs thousands.
"""

from __future__ import annotations

import gc
import random
import subprocess
import sys
import threading
from functools import cache

import pytest
import torch
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from karma.runtime.checkpoints.export import model_state_dict
from karma.schedule_load import load_schedule
from karma.testing import fuzz
from karma.testing.fuzz import Base, Tally, Verdict, judge, mutate, training_options
from karma.testing.mutations import KINDS
from tests.conftest import ROOT
from tests.runtime_helpers import load_small

# (model, strategy, fraction of keep_all's peak, training options): between them every
# decision (keep, swap, recompute; resident, streamed; device, host), tied weights, gradient
# accumulation, and clipping with updates left running into the next step
BASES = [
    ("gpt", "mixed", 1.0, {}),
    ("mlp", "ilp", 0.6, {}),
    ("mlp", "swap_all", 1.0, {"accumulate": 2}),
    ("gpt", "offload_all", 1.0, {"clip_grad_norm": 1.0}),
]
EXAMPLES_PER_BASE = 65

MUTATION = st.tuples(st.sampled_from(KINDS), st.integers(0, 1 << 20), st.integers(0, 1 << 20))
MUTATIONS = st.lists(MUTATION, min_size=1, max_size=3)


@cache
def base(model: str, strategy: str, fraction: float, training: tuple = ()) -> Base:
    return Base.of(load_small(model), model, strategy, fraction, **dict(training))


def base_of(case) -> Base:
    model, strategy, fraction, training = case
    return base(model, strategy, fraction, tuple(sorted(training.items())))


@pytest.fixture
def chaos(monkeypatch):
    """The runs under chaos timing (karma/runtime/replay/chaos.py): a dependency a mutant dropped
    shows as a race more often than on this machine's own timing. About 5 s more."""
    monkeypatch.setenv("KARMA_CHAOS", "1")


@pytest.fixture
def frozen_gc():
    """Each run's gc.collect() (runtime.py, before its baseline) then skips the objects
    made before the test: a third of a small run's time otherwise."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.mark.slow
@pytest.mark.parametrize("case", BASES, ids=lambda c: " ".join(
    [c[0], c[1], *(f"{k} {v}" for k, v in c[3].items())]))
def test_mutants_are_refused_or_train_bitwise_equal(case, frozen_gc, chaos):
    b = base_of(case)
    tally = Tally()

    # no shrinking: a mutant is one to three edits already, and shrinking a hang would
    # cost a timeout per attempt
    @settings(max_examples=EXAMPLES_PER_BASE, derandomize=True, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate],
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(MUTATIONS)
    def check(mutations):
        verdict = judge(b, mutate(b, mutations))
        tally.add(b, mutations, verdict)
        assert not verdict.bug, f"{verdict.outcome} with {mutations}:\n{verdict.detail}"

    check()
    print(f"{b.name}: {tally.text()}")
    # the harness exercised both paths: refusals, and runs compared bit for bit
    assert tally.counts["refused"] >= 10, tally.text()
    assert tally.trained >= 3, tally.text()


def reseeded(b: Base) -> str:
    """`b`'s text with another seed: a schedule that trains something else."""
    seed = b.schedule.config.seed
    text = b.text.replace(f"seed: {seed}\n", f"seed: {seed + 1}\n", 1)
    assert text != b.text
    return text


def test_a_run_that_trains_something_else_differs():
    """The comparison can fail: judged against a planted wrong answer (the original seed's
    result), the schedule with another seed differs; against plain PyTorch with its own
    seed, it ran bitwise equal."""
    b = base_of(BASES[1])
    text = reseeded(b)
    planted = Base(b.name, b.mf, b.schedule, b.text, b.result)
    planted.references[training_options(load_schedule(text))] = b.result
    assert judge(planted, text).outcome == "differs"
    assert judge(b, text).outcome == "ran"


def test_a_run_that_does_not_end_is_a_hang(monkeypatch):
    b = base_of(BASES[1])
    fresh = Base(b.name, b.mf, b.schedule, b.text, b.result)  # nothing judged yet
    release = threading.Event()
    monkeypatch.setattr(fuzz, "run_schedule", lambda s, mf: release.wait())
    try:
        verdict = judge(fresh, reseeded(b), timeout_s=0.2)
    finally:
        release.set()  # the run left behind ends
        # and restores the environment it saved: wait for that, or it could undo the
        # KARMA_* variables a later test sets (a golden schedule then records env: {})
        for thread in threading.enumerate():
            if thread.name == "karma-fuzz-run":
                thread.join(30)
                assert not thread.is_alive(), "the run left behind did not end"
    assert verdict.outcome == "hang" and verdict.bug


# --- end to end, through karma-run --------------------------------------------------------------


def first_mutant(b: Base, wanted, seed: int = 0, tries: int = 400) -> tuple[str, Verdict]:
    """The first mutant (of a seeded generator) whose verdict is `wanted`."""
    rng = random.Random(seed)
    for _ in range(tries):
        mutations = [(rng.choice(KINDS), rng.randrange(1 << 20), rng.randrange(1 << 20))]
        text = mutate(b, mutations)
        verdict = judge(b, text)
        if wanted(verdict):
            return text, verdict
    raise AssertionError(f"no such mutant in {tries} tries")


@pytest.mark.slow
def test_karma_run_refuses_with_exit_2_and_no_traceback_or_trains_the_same(tmp_path, frozen_gc):
    """In-process verdicts hold for the real command: refused by validation, refused once
    the model is built (an edited model.env builds another model), and a mutant that trains
    another schedule than the original, bitwise equal."""
    b = base_of(BASES[1])
    env_edit = b.text.replace('KARMA_MLP_DEPTH: "4"', 'KARMA_MLP_DEPTH: "5"')
    assert env_edit != b.text
    cases = {
        "validation": first_mutant(b, lambda v: v.outcome == "refused" and v.stage == "load"),
        "model": (env_edit, judge(b, env_edit)),
        "runs": first_mutant(b, lambda v: v.outcome == "ran" and v.detail == ""),
    }
    assert cases["model"][1].outcome == "refused" and cases["model"][1].stage == "run"
    started = {}
    for name, (text, _) in cases.items():
        path = tmp_path / f"{name}.yaml"
        path.write_text(text)
        started[name] = subprocess.Popen(
            [sys.executable, "-m", "karma.run", str(path), "--steps", "2",
             "--checkpoint-dir", str(tmp_path / name)],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for name, process in started.items():
        try:
            out, err = process.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            process.kill()
            pytest.fail(f"karma-run on the {name} mutant did not end in 300 s (a hang)")
        verdict = cases[name][1]
        assert "Traceback" not in err and "internal error" not in err, err
        if verdict.outcome == "refused":
            assert process.returncode == 2, err
            line = err.strip()
            assert line.count("\n") == 0 and line.startswith("karma-run: error: "), err
            # the same message as in-process, but for the name of the file
            assert line.split(": ", 3)[-1] == verdict.detail.split(": ", 1)[-1], (line, verdict)
        else:
            assert process.returncode == 0, err
            state = model_state_dict(tmp_path / name / "step_2")
            expected = b.references[training_options(load_schedule(cases[name][0]))]
            assert state.keys() == expected.state.keys()
            assert all(torch.equal(state[k], expected.state[k]) for k in state)
