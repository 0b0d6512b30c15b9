"""Which blocks the planner pairs, and a plan's pairs made whole ([Note: a checkpoint over two
blocks] in karma/schedule.py).

    offers_pair(problem, i)   # valid_choices offers block i with_next variants
    mark_pairs(choices)       # after the solve: each pair's second block marked with_prev
    can_pair(c)               # the ILP's constraint: what the second block may choose

The ILP has a variable for each choice of a pair's first block only; the second takes any
choice that recomputes (can_pair), marked with_prev once the plan is made (mark_pairs), and
the checkpoint its fragment then drops is credited to the first block's choice
(formulation.ilp_fragment). lowering.assemble refuses a plan whose halves disagree
(pairs_agree).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol, TypeVar

from karma.schedule import RECOMPUTE_ACTS

if TYPE_CHECKING:
    from karma.planner.problem import Problem


class Paired(Protocol):
    """What these functions read of a choice (lowering.Choice, which imports them)."""

    act: str
    kept: str
    with_next: bool
    with_prev: bool


C = TypeVar("C", bound=Paired)


def offers_pair(problem: Problem, i: int) -> bool:
    """Whether block i is offered to recompute with the next one: where the blocks allow it
    (BlockCost.joins_next) and what it returns is saved by both blocks (a ResNet block's
    output, its last ReLU's and the next block's first convolution's), which a pair frees
    for most of the step. Where the next block alone saves it (a transformer layer's
    output), a pair frees only the next block's checkpoint for a stage more of the first
    block's activations: offered there, it saved nothing in the golden plans that took it
    and slowed GPT-2 XL's solve 2 to 7 times (bench/RESULTS.md, "The ILP on real models");
    the runtime runs such a pair all the same (a schedule may name it)."""
    return problem.blocks[i].joins_next and any(
        h.made_by == i for h in problem.held_by_first_reader[i])


def can_pair(c: Paired) -> bool:
    """Whether a block under choice c can be the second block of a pair (mark_pairs)."""
    return c.act in RECOMPUTE_ACTS and c.kept == "device" and not c.with_next


def mark_pairs(choices: Sequence[C]) -> tuple[C, ...] | None:
    """`choices` (of valid_choices, which offer a pair's first block only) with the second
    block of each pair marked with_prev; None where a with_next block's next block cannot
    be its second (it keeps or swaps, keeps on the host, has with_next itself, or there is
    none)."""
    out = list(choices)
    for i, c in enumerate(choices):
        if not c.with_next:
            continue
        if i + 1 == len(out) or not can_pair(out[i + 1]):
            return None
        out[i + 1] = replace(out[i + 1], with_prev=True)
    return tuple(out)


def pairs_agree(choices: Sequence[Paired]) -> bool:
    """Whether each block with with_next has a next block with with_prev, and only those."""
    previous = [False] + [c.with_next for c in choices[:-1]]
    return all(c.with_prev == before for c, before in zip(choices, previous)) \
        and not (choices and choices[-1].with_next)
