"""Two blocks under one checkpoint: a block with `with_next` and the block after it.

    pairs = Pairs(blocks, precision)
    if pairs.covers(block):  # a block with with_next, or the next one (BlockHooks' wrapper)
        out = pairs.call(block, forward, buffers, args, kwargs)

[Note: a checkpoint over two blocks] (karma/schedule.py) says what the schedule asks. The
checkpoint is torch.utils.checkpoint's non-reentrant one in its generator form, as
torch.distributed's composable `checkpoint(module)` drives it from module hooks: the first
block's call opens it and the second block's call closes it, so every tensor either block
saves is the checkpoint's to drop and make again, the tensors the first block hands the
second included. Its recompute runs the first block's forward on the inputs the checkpoint
kept, then the second block's on what that returned (the second block's other arguments,
made before the pair, as they were given), under the random state and autocast state the
pair began with: the same ops in the same order as the forward, so the same values.

Where a block is selective, its policy decides for its own ops (one selective context
for the pair, whose policy follows the running block); the recompute restores both blocks'
buffers afterwards (running statistics are updated once, by the forward).

[Note: nothing between the two blocks] The checkpoint stays open from the first block's
call to the second's, so whatever runs between them (the caller's code, the first module's
forward hooks, the second's pre-hooks) would be recorded but not run again. The planner
pairs blocks whose IR shows nothing between them, but hooks and in-place ops escape the IR:
between the two calls a saved-tensor hook refuses anything autograd would save, the
selective policy refuses an op a policy keeps, and the second call refuses a tensor made
meanwhile or an output of the first changed in place; each names the blocks and the fix
(`karma-plan --no-pairs`). Ops that save nothing and keep nothing (the engine's copies,
views) pass: the recompute does not need them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch.utils.checkpoint import (
    CheckpointPolicy,
    _checkpoint_without_reentrant_generator,
    create_selective_checkpoint_contexts,
)

from karma.errors import KarmaError
from karma.runtime.replay.selective import raise_if_kept_output_mutated, restore_buffers
from karma.runtime.replay.training_options import MixedPrecision
from karma.schedule import BlockEntry
from karma.selective_policy import kept_by


@dataclass
class _Call:
    """One block's forward as the pair's recompute runs it again."""

    block: BlockEntry
    forward: Callable
    buffers: list[torch.Tensor]
    # the second block's arguments, the first block's outputs among them left out (None
    # where they were: `slots` says which output goes there)
    spec: object = None
    leaves: list = field(default_factory=list)
    slots: dict[int, int] = field(default_factory=dict)  # leaf position -> output position


class _Pair:
    """One open pair: the first block has run, the second has not finished."""

    def __init__(self, first: _Call, second: BlockEntry, precision: MixedPrecision):
        self.first = first
        self.second_block = second
        self.second: _Call | None = None  # once the second block is called
        self.running: BlockEntry = first.block
        self.precision = precision
        self.outputs: list | None = None  # the first block's output leaves, until the second
        self.versions: dict[int, int] = {}  # the output tensors' versions when it returned
        self.made_before: int = _next_sequence_nr()
        self.generator: Iterator | None = None
        self.between: contextlib.ExitStack | None = None  # [Note: nothing between the two blocks]

    def refuse(self, what: str) -> KarmaError:
        """[Note: nothing between the two blocks]: what ran between them, named."""
        first, second = self.first.block, self.second_block
        return KarmaError(
            f"between block {first.index} ({first.name}) and block {second.index} "
            f"({second.name}), which recompute under one checkpoint (with_next), {what}; the "
            "recompute would not run it again. Re-plan with karma-plan --no-pairs (the plan "
            "cannot see a module's hooks or an in-place change)")

    def contexts(self):
        """checkpoint's context_fn: selective contexts whose policy follows the running
        block, where a block is selective; the recompute restoring both blocks' buffers."""
        keeps = {b.index: kept_by(b.policy) for b in (self.first.block, self.second_block)
                 if b.act == "selective"}
        if not keeps:
            return contextlib.nullcontext(), self._restoring(contextlib.nullcontext())

        def decide(ctx, op, *args, **kwargs) -> CheckpointPolicy:
            if self.running is None:  # between the two blocks
                if any(keep(op, args) for keep in keeps.values()):
                    raise self.refuse(f"the model ran {op}, an op a selective policy keeps")
                return CheckpointPolicy.PREFER_RECOMPUTE
            keep = keeps.get(self.running.index)
            return CheckpointPolicy.MUST_SAVE if keep is not None and keep(op, args) else \
                CheckpointPolicy.PREFER_RECOMPUTE

        forward, recompute = create_selective_checkpoint_contexts(decide)
        return forward, self._restoring(recompute)

    @contextlib.contextmanager
    def _restoring(self, replay) -> Iterator[None]:
        try:
            with restore_buffers(self.first.buffers + self.second.buffers), replay:
                yield
        except RuntimeError as e:
            raise_if_kept_output_mutated(self.running, e)
            raise

    def recompute(self, *args, **kwargs) -> None:
        """Both forwards again, in the forward's order (the checkpoint's fn)."""
        self.running = self.first.block
        out = self.first.forward(*args, **kwargs)
        self.precision.block_done()
        second = self.second
        made, _ = tree_flatten(out)
        leaves = list(second.leaves)
        for pos, k in second.slots.items():
            leaves[pos] = made[k]
        a, kw = tree_unflatten(leaves, second.spec)
        self.running = second.block
        second.forward(*a, **kw)


class Pairs:
    """The pairs of one model's replay, opened and closed by its blocks' module calls."""

    def __init__(self, blocks: Sequence[BlockEntry], precision: MixedPrecision):
        self.blocks = blocks
        self.precision = precision
        self._open: _Pair | None = None

    def covers(self, block: BlockEntry) -> bool:
        """Whether `block`'s call (in a training forward) opens a pair or closes the open one."""
        return block.with_next or (self._open is not None
                                   and self._open.first.block.index == block.index - 1)

    def call(self, block: BlockEntry, forward: Callable, buffers: list[torch.Tensor],
             args: tuple, kwargs: dict):
        """Run `block`'s forward inside its pair's checkpoint."""
        if block.with_next:
            return self._first(block, forward, buffers, args, kwargs)
        return self._second(block, forward, buffers, args, kwargs)

    def abandon(self) -> None:
        """A forward that ended before the second block ran: close the checkpoint."""
        pair, self._open = self._open, None
        if pair is not None and pair.between is not None:
            pair.between.close()
        if pair is not None and pair.generator is not None:
            pair.generator.close()

    def _first(self, block, forward, buffers, args, kwargs):
        self.abandon()
        pair = _Pair(_Call(block, forward, buffers), self.blocks[block.index + 1],
                     self.precision)
        pair.generator = _checkpoint_without_reentrant_generator(
            pair.recompute, True, pair.contexts, "default", False, True, *args, **kwargs)
        self._open = pair
        try:
            next(pair.generator)
            out = forward(*args, **kwargs)
        except BaseException:
            self.abandon()
            raise
        pair.outputs = tree_flatten(out)[0]
        pair.versions = {id(t): t._version for t in pair.outputs if isinstance(t, torch.Tensor)}
        pair.running = None
        pair.between = contextlib.ExitStack()
        pair.between.enter_context(torch.autograd.graph.saved_tensors_hooks(
            partial(_refuse_saving, pair), _never_unpacked))
        return out

    def _second(self, block, forward, buffers, args, kwargs):
        pair = self._open
        pair.between.close()
        try:
            pair.second = _call_of(block, forward, buffers, args, kwargs, pair)
            pair.outputs = None  # the pair holds them no longer
            pair.running = block
            out = forward(*args, **kwargs)
        except BaseException:
            self.abandon()
            raise
        self._open = None
        try:
            next(pair.generator)
        except StopIteration:
            pass
        pair.generator = None
        return out


def _call_of(block: BlockEntry, forward: Callable, buffers: list[torch.Tensor],
             args: tuple, kwargs: dict, pair: _Pair) -> _Call:
    """The second block's call, with the first block's outputs among its arguments left
    out; a KarmaError where it takes a tensor made between the two blocks (the recompute
    would not make it again)."""
    leaves, spec = tree_flatten((args, kwargs))
    made = {id(t): k for k, t in enumerate(pair.outputs) if isinstance(t, torch.Tensor)}
    slots = {}
    for pos, leaf in enumerate(leaves):
        if not isinstance(leaf, torch.Tensor):
            continue
        if id(leaf) in made:
            if leaf._version != pair.versions[id(leaf)]:
                raise pair.refuse("the model changed in place a tensor the first block "
                                  "returned and the second takes")
            slots[pos] = made[id(leaf)]
            leaves[pos] = None
        elif leaf.grad_fn is not None and leaf.grad_fn._sequence_nr() >= pair.made_before:
            raise pair.refuse("the model made a tensor the second block takes (not one the "
                              "first returned, in a tensor, tuple, list or dict)")
    return _Call(block, forward, buffers, spec, leaves, slots)


def _refuse_saving(pair: _Pair, tensor: torch.Tensor):
    raise pair.refuse(f"autograd saved a tensor of shape {tuple(tensor.shape)} for an op's "
                      "backward")


def _never_unpacked(packed):
    raise AssertionError("nothing is packed between the two blocks")


def _next_sequence_nr() -> int:
    """The sequence number autograd gives the next node it makes on this thread."""
    with torch.enable_grad():
        probe = torch.empty(0, requires_grad=True).view(0)
    return probe.grad_fn._sequence_nr() + 1
