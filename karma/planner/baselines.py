"""Baselines: the plans of known systems, with the ILP's signature and return type.

Each takes (problem, capacity_bytes, training) and returns a Plan; `evaluate` judges them all by the
same simulator, and a plan that does not fit is reported as infeasible, not repaired.
"""

from __future__ import annotations

from collections.abc import Callable

from karma.planner.lowering import PLAIN, Choice, Training
from karma.planner.memory import StageMemory
from karma.planner.plan import Plan
from karma.planner.problem import Problem

KEEP = Choice("keep")
SWAP = Choice("swap")
RECOMPUTE = Choice("recompute")


def keep_all(problem: Problem, capacity_bytes: int,
             training: Training = PLAIN) -> Plan:
    """In-core training: everything stays on the device."""
    return Plan("keep_all", (KEEP,) * len(problem.blocks))


def recompute_all(problem: Problem, capacity_bytes: int,
                  training: Training = PLAIN) -> Plan:
    """Checkpoint every block (torch.utils.checkpoint around each layer)."""
    return Plan("recompute_all", (RECOMPUTE,) * len(problem.blocks))


def selective_all(problem: Problem, capacity_bytes: int,
                  training: Training = PLAIN) -> Plan:
    """Selective checkpointing of every block its policy can run (torchtitan's default,
    op-level selective activation checkpointing: keep what every matmul returns, recompute
    the rest); the others recompute whole."""
    return Plan("selective_all", tuple(
        Choice("selective", policy=b.selective[0].policy) if b.selective else RECOMPUTE
        for b in problem.blocks))


def swap_all(problem: Problem, capacity_bytes: int,
             training: Training = PLAIN) -> Plan:
    """vDNN-style: swap every block's activations out and back (the last cannot: it keeps)."""
    n = len(problem.blocks)
    return Plan("swap_all", (SWAP,) * (n - 1) + (KEEP,))


def offload_all(problem: Problem, capacity_bytes: int,
                training: Training = PLAIN) -> Plan:
    """ZeRO-Offload-style: weights and optimizer on the host, activations recomputed."""
    return Plan("offload_all", (Choice("recompute", "streamed", "host"),) * len(problem.blocks))


def greedy(problem: Problem, capacity_bytes: int,
           training: Training = PLAIN) -> Plan:
    """KARMA-style capacity-based heuristic.

    From in-core, walk the blocks from the first (whose activations live longest): swap a
    block when its copies hide behind the next block's compute, recompute it otherwise, until
    the plan fits. If activations alone are not enough, move optimizer state to the host and
    then stream weights, largest blocks first.
    """
    n = len(problem.blocks)
    choices = [KEEP] * n
    memory = StageMemory(problem, training)

    def fits() -> bool:
        return max(memory(choices)) <= capacity_bytes

    for i in range(n):
        if fits():
            break
        b, nxt = problem.blocks[i], problem.blocks[min(i + 1, n - 1)]
        hidden = (problem.d2h_s(b.swap_bytes) <= nxt.fwd_s
                  and problem.h2d_s(b.swap_bytes) <= nxt.bwd_s)
        choices[i] = SWAP if hidden and i < n - 1 else RECOMPUTE
    for weights, optim in (("resident", "host"), ("streamed", "host")):
        for i in sorted(range(n), key=lambda i: -problem.blocks[i].param_bytes):
            if fits():
                break
            choices[i] = Choice(choices[i].act, weights, optim)
    return Plan("greedy", tuple(choices))


BASELINES: dict[str, Callable[[Problem, int, Training], Plan]] = {
    "keep_all": keep_all,
    "recompute_all": recompute_all,
    "selective_all": selective_all,
    "swap_all": swap_all,
    "offload_all": offload_all,
    "greedy": greedy,
}
