"""Following the model's own execution, block by block, through hooks on its modules.

Compute runs where it always does: `model(x)`, `loss_fn`, `loss.backward()` on the calling
thread. `BlockHooks` tells the engine where that execution is:

- a forward pre-hook on each block's modules: block i's forward starts (`enter(i)`); a module
  called several times is one block per call, in order;
- while training, a gradient hook on block i's input made last: block i-1's backward starts
  when block i's has produced that gradient (`backward(i - 1)`); and a hook on the model's
  output: the last block's backward starts with the first gradient to reach it;
- the modules of recompute and selective blocks run under non-reentrant checkpointing, in the
  contexts of their act (selective.py; a selective block's kept outputs in its `KeptSwap`
  where they wait on the host, kept.py), a block with `with_next` and the next one under one
  checkpoint (pair.py), and a swap block's forward under its `SwapStore`'s saved-tensors
  hooks (swap.py).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from functools import partial

import torch
from torch.utils.checkpoint import checkpoint

from karma.modelfile import output_tensors
from karma.runtime.replay.kept import KeptSwap
from karma.runtime.replay.pair import Pairs
from karma.runtime.replay.selective import checkpoint_contexts
from karma.runtime.replay.swap import SwapStore
from karma.runtime.replay.training_options import MixedPrecision
from karma.schedule import RECOMPUTE_ACTS, BlockEntry


class BlockHooks:
    """The hooks on one model, installed once; they act only while `follow` is in force."""

    def __init__(self, model: torch.nn.Module, blocks: Sequence[BlockEntry],
                 swaps: Mapping[int, SwapStore | KeptSwap], precision: MixedPrecision):
        self.model = model
        self.blocks = blocks
        # a swap block's saved tensors; a selective block's kept outputs on the host
        self.swaps = {i: s for i, s in swaps.items() if isinstance(s, SwapStore)}
        self.kept = {i: s for i, s in swaps.items() if isinstance(s, KeptSwap)}
        self.precision = precision
        self.pairs = Pairs(blocks, precision)  # blocks recomputed two under one checkpoint
        self._enter: Callable[[int], None] | None = None  # None: not following
        self._backward: Callable[[int], None] | None = None  # None: a forward without grads
        self._calls: dict[int, int] = defaultdict(int)  # id(module) -> calls this forward
        self._current: int | None = None  # the block whose forward runs
        self._ran_in_block: set[str] = set()  # its modules that have run
        self._swap_hooks = None  # the running swap block's saved-tensor hooks, entered
        self._output_grad_seen = False
        self._handles: list = []
        self._restore: list = []  # (module, its own forward) of the checkpointed modules
        self._install()

    def follow(self, enter: Callable[[int], None],
               backward: Callable[[int], None] | None = None) -> None:
        """Follow one forward (and, with `backward`, its backward): `enter(i)` where block i's
        forward starts, `backward(i)` where its backward does."""
        self._enter, self._backward = enter, backward
        self._calls = defaultdict(int)
        self._current = None
        self._ran_in_block = set()
        self._swap_hooks = None
        self._output_grad_seen = False
        self.pairs.abandon()

    def leave_block(self) -> None:
        """The running block's forward has ended (the next block's starts, or the loss)."""
        if self._current is not None:
            self.precision.block_done()
        if self._swap_hooks is not None:
            self._swap_hooks.__exit__(None, None, None)
            self._swap_hooks = None
        self._current = None

    def stop(self) -> None:
        """Stop following; a swap block's saved-tensor hooks are left (else they would catch
        every later autograd op in the process)."""
        self.leave_block()
        self.pairs.abandon()
        self._enter = self._backward = None

    def remove(self) -> None:
        """Take every hook and checkpoint wrapper off the model."""
        self.stop()
        for h in self._handles:
            h.remove()
        for module, forward in self._restore:
            module.forward = forward

    def _install(self) -> None:
        by_module: dict[str, list[int]] = defaultdict(list)
        for b in self.blocks:
            for m in b.modules:
                by_module[m].append(b.index)
        modules = dict(self.model.named_modules())
        for name, blocks in by_module.items():
            module = modules[name]
            self._handles.append(module.register_forward_pre_hook(
                partial(self._on_module, name, blocks), with_kwargs=True))
            # [Note: recomputing blocks of several modules] a head or tail block is not one
            # call: its modules that own parameters are checkpointed one by one, and the
            # parameter-free ones between them (activations, pooling, often in place) run
            # as they are, since checkpointing an in-place op's input breaks autograd.
            single = all(len(self.blocks[i].modules) == 1 for i in blocks)
            if any(self.blocks[i].act in RECOMPUTE_ACTS for i in blocks) and (
                    single or any(True for _ in module.parameters())):
                self._wrap_recompute(module, blocks)
        self._handles.append(self.model.register_forward_hook(self._on_model_output))

    def _on_module(self, name: str, blocks: list[int], module, args, kwargs) -> None:
        if self._enter is None:
            return
        call = self._calls[id(module)]
        self._calls[id(module)] += 1
        i = blocks[min(call, len(blocks) - 1)]  # a module called several times: one block a call
        if i == self._current and name not in self._ran_in_block:
            self._ran_in_block.add(name)
            return  # another module of the block that is running
        self.leave_block()
        self._ran_in_block = {name}
        if self._backward is not None and i > 0:
            latest = _latest_made((*args, *kwargs.values()))
            if latest is not None:  # its gradient is ready when block i's backward ends
                latest.register_hook(partial(self._on_grad, i - 1))
        self._enter(i)
        self._current = i
        if self._backward is not None and i in self.swaps:
            self._swap_hooks = self.swaps[i].hooks()
            self._swap_hooks.__enter__()

    def _on_model_output(self, module, args, output) -> None:
        """The last block's backward starts when the first gradient reaches a tensor of the
        model's output, wherever it sits (a loss, logits, an encoder's last state)."""
        if self._backward is None:
            return
        for t in output_tensors(output):
            if t.requires_grad:
                t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad):
        if not self._output_grad_seen and self._backward is not None:
            self._output_grad_seen = True
            self._backward(len(self.blocks) - 1)
        return None

    def _on_grad(self, block: int, grad):
        if self._backward is not None:
            self._backward(block)
        return None

    def _wrap_recompute(self, module: torch.nn.Module, blocks: list[int]) -> None:
        """Checkpoint the module's forward, each call in the contexts of its own block (the
        running one: the pre-hook has just set it; outside a followed forward, the first)."""
        forward = module.forward
        buffers = list(module.buffers())

        def checkpointed(*args, **kwargs):
            block = self.blocks[self._current if self._current in blocks else blocks[0]]
            if self._backward is not None and self.pairs.covers(block):
                return self.pairs.call(block, forward, buffers, args, kwargs)
            # a selective block's kept outputs go to the host in a training replay only
            kept = self.kept.get(block.index) if self._backward is not None else None
            contexts = partial(checkpoint_contexts, block, buffers, kept)
            output = checkpoint(forward, *args, use_reentrant=False, context_fn=contexts,
                                **kwargs)
            if kept is not None:
                kept.returned(output)
            return output

        self._restore.append((module, forward))
        module.forward = checkpointed


def _latest_made(values) -> torch.Tensor | None:
    """Of a block's inputs that require grad, the one made last: the previous block's output
    (not, say, a mask or a position bias made once for every block, whatever the order of
    the arguments). Autograd numbers its nodes in the order they are made."""
    made = [a for a in values if isinstance(a, torch.Tensor) and a.requires_grad]
    if not made:
        return None
    return max(made, key=lambda t: t.grad_fn._sequence_nr() if t.grad_fn is not None else -1)
