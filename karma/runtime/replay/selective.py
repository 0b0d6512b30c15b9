"""What a recomputed block keeps: the contexts its checkpointed forward runs in.

    context_fn = partial(checkpoint_contexts, block, list(module.buffers()))
    checkpoint(module.forward, x, use_reentrant=False, context_fn=context_fn)

A recompute block keeps only its input and runs its whole forward again just before its
backward. A selective block ([Note: selective recompute] in karma/selective_policy.py) keeps,
beside its input, the outputs of the ops its policy names, and runs every other op again: its
forward
and its recompute run under torch.utils.checkpoint's selective contexts, one dispatch mode
that stores what the policy saves and one that hands it back in the recompute. Either way the
recompute restores the module's buffers afterwards (a BatchNorm's running statistics are
updated once, by the forward). What a selective block keeps may wait for its recompute on
the host (kept.py). The same code serves the CPU and CUDA backends: the policy looks only at
operator names and their arguments' shapes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextlib import AbstractContextManager

import torch
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from karma.errors import KarmaError
from karma.runtime.replay.kept import KeptSwap
from karma.schedule import BlockEntry
from karma.selective_policy import checkpoint_policy

# what torch.utils.checkpoint says when a tensor its selective contexts keep changed in place
_MUTATED = "cached during selective activation checkpoint has been mutated"


def checkpoint_contexts(block: BlockEntry, buffers: list[torch.Tensor],
                        kept: KeptSwap | None = None
                        ) -> tuple[AbstractContextManager, AbstractContextManager]:
    """checkpoint's `context_fn` for one call of a module of `block` (`buffers`: the module's;
    `kept`: where a selective block with kept: host keeps its outputs, kept.py): (the context
    of its forward, that of its recompute)."""
    if block.act != "selective":
        return contextlib.nullcontext(), restore_buffers(buffers)
    policy = checkpoint_policy(block.policy)
    forward, recompute = (create_selective_checkpoint_contexts(policy) if kept is None
                          else kept.contexts(policy))
    return forward, _recompute(block, recompute, buffers)


@contextlib.contextmanager
def _recompute(block: BlockEntry, replay: AbstractContextManager,
               buffers: list[torch.Tensor]) -> Iterator[None]:
    """The selective recompute inside the buffers' restore: the replaying dispatch mode looks
    every op run under it up in what the forward recorded (one the forward did not run, such
    as the restore's clone, is an error there), so the restore runs outside it."""
    try:
        with restore_buffers(buffers), replay:
            yield
    except RuntimeError as e:
        raise_if_kept_output_mutated(block, e)
        raise


def raise_if_kept_output_mutated(block: BlockEntry, e: RuntimeError) -> None:
    """A KarmaError naming the block and the fix where `e` is checkpoint's refusal of a kept
    output changed in place; nothing otherwise."""
    if _MUTATED in str(e):
        raise KarmaError(
            f"block {block.index} ({block.name}) is selective ({block.policy}), and the model "
            "changed in place the output of an op its policy keeps (say an "
            "nn.ReLU(inplace=True) right after a linear layer or a convolution): the "
            "recompute cannot hand that output back; make that op out of place, or set the "
            "block's act to recompute and remove its policy in the schedule") from e


@contextlib.contextmanager
def restore_buffers(buffers: list[torch.Tensor]) -> Iterator[None]:
    """Recomputing a forward must not update running statistics a second time."""
    saved = [b.clone() for b in buffers]
    try:
        yield
    finally:
        with torch.no_grad():
            for b, s in zip(buffers, saved):
                b.copy_(s)
