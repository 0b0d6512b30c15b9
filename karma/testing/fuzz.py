"""Fuzzing schedules: mutate a valid schedule and judge what karma-run makes of it.

    base = Base.of(mf, "mlp", "ilp", 0.6)         # a planned schedule, its text and its result
    text = mutate(base, [("word", 7, 1), ("drop_dep", 3, 0)])   # mutations.py
    verdict = judge(base, text)                    # refused, ran (bitwise), or a bug

The verdict follows karma-run: a schedule that `load_schedule` refuses, or whose run ends in
the error karma-run reports with exit 2 (`karma.cli.run.user_error`), is refused; one that
runs must train bitwise equal to plain PyTorch with the training options it states (for a
mutant whose options are the original's: equal to the original schedule's own run). Anything
else is a bug: another exception (karma-run's "internal error"), a different result, or a
run that does not end within the timeout (a hang).
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

from karma.cli.run import user_error
from karma.errors import KarmaError
from karma.fingerprint import model_ref
from karma.ir.optimizer import optimizer_profile
from karma.modelfile import ModelFile
from karma.planner.hardware import load_hardware
from karma.planner.lowering import Choice
from karma.planner.options import PlanOptions
from karma.planner.pipeline import schedule_from
from karma.planner.plan import Plan, evaluate
from karma.planner.problem import build_problem
from karma.runtime.checkpoints.export import model_state_dict
from karma.runtime.loop import RunOptions, open_model_file, train
from karma.schedule import Schedule, dump_schedule
from karma.schedule_load import load_schedule
from karma.testing.exactness import (
    HARDWARE,
    block_graph,
    host_stepped,
    keep_all_peak_bytes,
    model_env,
    plan,
    reference_train,
)
from karma.testing.mutations import Mutation, mutated

STEPS = 2  # two steps: what a step leaves to the next one is exercised too
TIMEOUT_S = 120.0  # a run of a small model takes about a second
# block 0 swaps and steps on the host (an upload), block 1 recomputes and streams, block 2
# keeps everything on the device, the last block keeps and streams: every decision, on the
# tiny GPT (examples/gpt.py, KARMA_GPT=tiny)
MIXED = tuple(Choice(*c) for c in [("swap", "resident", "host"), ("recompute", "streamed", "host"),
                                   ("keep", "resident", "device"), ("keep", "streamed", "host")])


# --- the schedule fuzzed and what it trains ---------------------------------------------------


@dataclass(frozen=True)
class Result:
    """What a run trained: the final weights and buffers, and each step's loss."""

    state: dict[str, torch.Tensor]
    losses: tuple[float, ...]

    def same_as(self, other: Result) -> str | None:
        """None when bitwise equal, else what differs."""
        if self.state.keys() != other.state.keys():
            return f"the state's keys differ: {sorted(self.state.keys() ^ other.state.keys())}"
        differ = [k for k in self.state if not _equal(self.state[k], other.state[k])]
        if differ:
            return f"{len(differ)} of {len(self.state)} tensors differ: {', '.join(differ[:5])}"
        if self.losses != other.losses:
            return f"losses {list(self.losses)} against {list(other.losses)}"
        return None


def _equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@dataclass
class Base:
    """A valid schedule to mutate: a small model planned with one strategy, and what it
    trains (its own run, checked bitwise equal to plain PyTorch once)."""

    name: str  # e.g. "mlp ilp 0.6"
    mf: ModelFile
    schedule: Schedule
    text: str
    result: Result
    # (training options) -> plain PyTorch's result with them; see Base.expected
    references: dict[tuple, Result] = field(default_factory=dict)
    # canonical text of a schedule that loaded -> its verdict: a mutant equal to one judged
    # already (a no-op edit, keys in another order) trains the same
    seen: dict[str, Verdict] = field(default_factory=dict)

    @classmethod
    def of(cls, mf: ModelFile, model: str, strategy: str, fraction: float = 1.0,
           **training) -> Base:
        """The model file `mf` (named `model`) planned with `strategy` at `fraction` of
        keep_all's peak, or "mixed": the tiny GPT with every choice (MIXED)."""
        if strategy == "mixed" and (model, training) != ("gpt", {}):
            raise ValueError("strategy mixed is the tiny GPT's every choice: model gpt, no "
                             "training options")
        planned = mixed_gpt(mf) if strategy == "mixed" else plan(mf, strategy, fraction,
                                                                 **training)
        schedule = load_schedule(dump_schedule(planned))  # times as the file holds them
        text = dump_schedule(schedule)
        result = run_schedule(schedule, mf)
        base = cls(f"{model} {strategy} {fraction:g}", mf, schedule, text, result)
        reference = base.expected(schedule, mf)
        problem = result.same_as(reference)
        if problem is not None:
            raise AssertionError(f"{base.name}: the unmutated schedule is not exact: {problem}")
        base.references[training_options(schedule)] = result
        return base

    def expected(self, s: Schedule, mf: ModelFile) -> Result:
        """Plain PyTorch with the training options `s` states (its model file's environment,
        batch size, seed, dtype, accumulation, clipping; its host-stepped parameters with
        the host's kernel): what a run of `s` must train."""
        key = training_options(s)
        if key not in self.references:
            c = s.config
            state, losses = reference_train(
                mf, c.batch_size, STEPS, c.seed, c.world_size, dtype=c.dtype,
                accumulate=c.accumulate, clip_grad_norm=c.clip_grad_norm, schedule=s)
            self.references[key] = Result(state, tuple(losses))
        return self.references[key]


def mixed_gpt(mf: ModelFile) -> Schedule:
    """The tiny GPT (`mf`: examples/gpt.py, KARMA_GPT=tiny) on the CPU backend with every
    choice (MIXED: a swapped block whose host step uploads, a recomputed streamed one, one
    kept on the device, and the tail, kept and streamed with the tied head)."""
    graph = block_graph(mf)
    options = PlanOptions(gpu_mem=keep_all_peak_bytes(mf, graph),
                          hardware=load_hardware(HARDWARE), batch_size=graph.batch_size)
    problem = build_problem(graph, options.profile, optimizer=optimizer_profile(mf))
    ev = evaluate(problem, Plan("ilp", MIXED, status="optimal"), options.capacity_bytes)
    model = model_ref(str(mf.path), mf, graph.to_json(), model_env(mf))
    return schedule_from(graph, model, options, ev, single_rank_s=ev.step_s)


def training_options(s: Schedule) -> tuple:
    """What, besides the schedule's own plan, decides what a run trains: the training
    options, and which parameters step with the host's kernel (host_stepped)."""
    c = s.config
    return (s.model, c.batch_size, c.seed, c.world_size, c.dtype, c.accumulate,
            c.clip_grad_norm, tuple(sorted(host_stepped(s).items())))


def run_schedule(s: Schedule, mf: ModelFile, steps: int = STEPS) -> Result:
    """Train as karma-run does (karma.runtime.loop.train), quietly; the final checkpoint's
    weights and the losses."""
    with tempfile.TemporaryDirectory(prefix="karma-fuzz-") as d:
        report = train(s, mf, RunOptions(steps=steps, checkpoint_dir=Path(d),
                                         log=lambda line: None))
        state = model_state_dict(Path(d) / f"step_{steps}")
    return Result(state, tuple(report.losses))


def mutate(base: Base, mutations: list[Mutation]) -> str:
    """`base`'s text with `mutations` applied in order (mutations.mutated)."""
    return mutated(base.text, base.schedule, mutations)


# --- the verdict ------------------------------------------------------------------------------

OUTCOMES = ("refused", "ran", "internal", "differs", "hang")
BUGS = ("internal", "differs", "hang")


@dataclass(frozen=True)
class Verdict:
    outcome: str  # one of OUTCOMES; BUGS are karma's bugs
    detail: str = ""  # the refusal's message, the traceback, or what differs
    stage: str = ""  # where it was decided: "load" (validation) or "run"

    @property
    def bug(self) -> bool:
        return self.outcome in BUGS


class _Hang(Exception):
    pass


def judge(base: Base, text: str, timeout_s: float = TIMEOUT_S) -> Verdict:
    """What karma-run makes of the mutant `text` of `base`'s schedule (see the module's
    docstring)."""
    try:
        s = load_schedule(text, "mutant.yaml")
    except KarmaError as e:
        return Verdict("refused", str(e), "load")
    except Exception:  # noqa: BLE001 - karma-run's internal error
        return Verdict("internal", traceback.format_exc(), "load")
    try:  # the runtime writes it too: its fingerprint is that of the text (schedule_sha256)
        canonical = dump_schedule(s)
    except Exception:  # noqa: BLE001 - a schedule loaded that cannot be written: a bug
        return Verdict("internal", traceback.format_exc(), "load")
    if canonical not in base.seen:
        base.seen[canonical] = _run_verdict(base, s, timeout_s)
    return base.seen[canonical]


def _run_verdict(base: Base, s: Schedule, timeout_s: float) -> Verdict:
    if s == base.schedule:
        return Verdict("ran", "the original schedule", "run")
    try:
        mf, result = _bounded(lambda: _open_and_run(base, s), timeout_s)
    except _Hang:
        return Verdict("hang", f"no end after {timeout_s:g} s", "run")
    except Exception as e:  # noqa: BLE001 - sorted as karma-run sorts it
        reported = user_error(e)
        if reported is not None:
            return Verdict("refused", str(reported), "run")
        return Verdict("internal", "".join(traceback.format_exception(e)), "run")
    try:
        problem = result.same_as(base.expected(s, mf))
    except Exception:  # noqa: BLE001 - the reference itself failed: options plain PyTorch
        return Verdict("internal", "ran, but plain PyTorch with its options failed:\n"
                       + traceback.format_exc(), "run")
    return Verdict("ran", "", "run") if problem is None else Verdict("differs", problem, "run")


def _open_and_run(base: Base, s: Schedule) -> tuple[ModelFile, Result]:
    """As karma-run: the schedule's model file opened (with its environment, checked against
    its fingerprint), then trained. The original model file is reused when the schedule
    names it unchanged (loading it again would give the same)."""
    if s.model == base.schedule.model:
        mf = base.mf
    else:
        with _saved_environment():  # open_model_file sets the schedule's KARMA_* variables
            mf = open_model_file(s, None)
    with _saved_environment():
        return mf, run_schedule(s, mf)


@contextlib.contextmanager
def _saved_environment():
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _bounded(fn, timeout_s: float):
    """fn() on a thread of its own; _Hang if it does not end within `timeout_s` (the thread,
    a daemon, is left behind)."""
    box: dict = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed back to the caller
            box["error"] = e

    worker = threading.Thread(target=target, name="karma-fuzz-run", daemon=True)
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise _Hang()
    if "error" in box:
        raise box["error"]
    return box["value"]


def _reason(message: str) -> str:
    """A refusal's rule ("ops match decisions"), or what kind of error it is."""
    rule = re.search(r"\(rule: ([^:)]+)", message)
    if rule:
        return rule[1]
    for words, kind in (("not valid YAML", "YAML"), ("is given twice", "YAML"),
                        ("missing key", "keys"), ("unknown key", "keys"),
                        ("is not its position", "ids"), ("is not an earlier op", "ids"),
                        ("is not a block", "ids"), ("is not an op", "ids"),
                        ("buffer names are unique", "ids")):
        if words in message:
            return kind
    return "fields" if message.startswith("mutant.yaml: ") else "at run: " + message[:60]


@dataclass
class Tally:
    """Counts of verdicts, and the first few mutants of each bug for the report."""

    tried: int = 0
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(OUTCOMES, 0))
    refused_at_run: int = 0
    trained: int = 0  # ran: schedules other than the original, trained and compared
    reasons: dict[str, int] = field(default_factory=dict)  # refusals by rule (or kind)
    # mutation kind -> [mutants with it, of them trained]: which edits get past validation
    by_kind: dict[str, list[int]] = field(default_factory=dict)
    examples: list[tuple[str, list[Mutation], Verdict]] = field(default_factory=list)

    def add(self, base: Base, mutations: list[Mutation], verdict: Verdict) -> None:
        self.tried += 1
        self.counts[verdict.outcome] += 1
        self.refused_at_run += verdict.outcome == "refused" and verdict.stage == "run"
        self.trained += verdict.outcome == "ran" and verdict.detail == ""
        for kind in {m[0] for m in mutations}:
            counts = self.by_kind.setdefault(kind, [0, 0])
            counts[0] += 1
            counts[1] += verdict.outcome == "ran" and verdict.detail == ""
        if verdict.outcome == "refused":
            reason = _reason(verdict.detail)
            self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if verdict.bug and len(self.examples) < 20:
            self.examples.append((base.name, mutations, verdict))

    @property
    def bugs(self) -> int:
        return sum(self.counts[o] for o in BUGS)

    def text(self) -> str:
        c = self.counts
        return (f"tried {self.tried}: refused {c['refused']} ({c['refused'] - self.refused_at_run}"
                f" by validation, {self.refused_at_run} when run), ran bitwise {c['ran']} "
                f"({self.trained} of them trained, as schedules other than the original), "
                f"internal errors {c['internal']}, not bitwise {c['differs']}, hangs {c['hang']}")

