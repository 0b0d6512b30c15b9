"""A plan (one choice per block) and its evaluation by lowering and simulation.

Every strategy, the ILP and each baseline, returns a `Plan`; `evaluate` lowers it to the
schedule's operations and simulates them, so all strategies are judged by the same model.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from karma.errors import KarmaError
from karma.planner.host_state import HostUse
from karma.planner.lowering import PLAIN, Choice, Training, assemble, fragment
from karma.planner.memory import stage_memory
from karma.planner.problem import Problem
from karma.planner.simulate import SimResult, simulate
from karma.schedule import Buffer, Op


class InfeasiblePlan(KarmaError):
    """No plan fits the device memory (resource "device"; the message gives the smallest
    budget that would), or the node's host memory (resource "host")."""

    exit_code = 3

    def __init__(self, message: str, min_capacity_bytes: int, resource: str = "device"):
        super().__init__(message)
        self.min_capacity_bytes = min_capacity_bytes
        self.resource = resource
        self.batch_size = 1  # the batch planned for, where known (karma.api sets it)


@dataclass(frozen=True)
class Plan:
    """A strategy's decision for every block."""

    strategy: str  # "ilp" or a baseline's name (baselines.BASELINES)
    choices: tuple[Choice, ...]
    status: str = "heuristic"  # optimal | time-limit | heuristic | fallback
    solve_s: float = 0.0
    note: str = ""

    def counts(self) -> dict[str, int]:
        acts = Counter(c.act for c in self.choices)
        return {
            "keep": acts["keep"],
            "swap": acts["swap"],
            "recompute": acts["recompute"],
            "selective": acts["selective"],
            "kept_on_host": sum(c.kept == "host" for c in self.choices),
            "pairs": sum(c.with_next for c in self.choices),  # two blocks, one checkpoint
            "streamed_weights": sum(c.weights == "streamed" for c in self.choices),
            "host_optimizer": sum(c.optim == "host" for c in self.choices),
        }


@dataclass(frozen=True)
class Evaluation:
    """A plan lowered and simulated."""

    plan: Plan
    ops: tuple[Op, ...]
    buffers: tuple[Buffer, ...]
    sim: SimResult
    capacity_bytes: int
    stage_peak_bytes: int  # the ILP's memory bound: the largest sum of buffers live in a stage
    host: HostUse  # per rank and per node
    host_mem_bytes: int  # the node's
    pinned_mem_bytes: int  # the node's
    training: Training = PLAIN
    host_state: str = "replicated"  # the problem's: sharded only on several ranks

    @property
    def host_bytes(self) -> int:
        """Per rank, its share of the node's shared bytes included."""
        return self.host.host_bytes

    @property
    def pinned_bytes(self) -> int:
        return self.host.pinned_bytes

    @property
    def feasible(self) -> bool:
        return (self.stage_peak_bytes <= self.capacity_bytes
                and self.host.node_host_bytes <= self.host_mem_bytes
                and self.host.node_pinned_bytes <= self.pinned_mem_bytes)

    @property
    def serial_step_s(self) -> float:
        """One optimizer step (all its micro-batches), updates after the backward."""
        return self.sim.serial_step_s

    @property
    def overlapped_step_s(self) -> float | None:
        """With clipping: one step if the updates overlapped the next forward."""
        return self.sim.overlapped_step_s

    @property
    def step_s(self) -> float:
        """One optimizer step as the runtime runs it (SimResult.step_s)."""
        return self.sim.step_s

    @property
    def peak_device_bytes(self) -> int:
        return self.sim.peak_device_bytes


def evaluate(problem: Problem, plan: Plan, capacity_bytes: int,
             training: Training = PLAIN) -> Evaluation:
    choices = list(plan.choices)
    if len(choices) != len(problem.blocks):
        raise ValueError(f"plan has {len(choices)} choices for {len(problem.blocks)} blocks")
    ops, buffers = assemble(problem, choices, training)
    frags = [fragment(problem, i, c, training) for i, c in enumerate(choices)]
    return Evaluation(
        plan=plan,
        ops=ops,
        buffers=buffers,
        sim=simulate(ops, buffers, training.accumulate, training.clip, problem.contention),
        capacity_bytes=capacity_bytes,
        stage_peak_bytes=max(stage_memory(problem, choices, training)),
        host=HostUse.of(problem, frags),
        host_state="sharded" if problem.sharded else "replicated",
        host_mem_bytes=problem.host_mem_bytes,
        pinned_mem_bytes=problem.pinned_mem_bytes,
        training=training,
    )
