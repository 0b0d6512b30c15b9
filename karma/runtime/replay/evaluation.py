"""Evaluation: a forward without gradients, its streamed weights fetched block by block.

Nothing is saved for backward, so nothing is swapped or recomputed; each block's streamed
weights are fetched before it runs and released after, synchronously: evaluation is rare
and needs no overlap. (Runtime.evaluate, [Note: evaluation fits in the training budget].)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from karma.runtime.params.streamed import SharedStorage
from karma.schedule import BlockEntry


class BlockByBlock:
    """Holds the streamed weights of the block an evaluation runs, and only those."""

    def __init__(self, blocks: Sequence[BlockEntry], named: Mapping[str, torch.nn.Parameter],
                 shared: SharedStorage):
        self._blocks = blocks
        self._named = named
        self._shared = shared
        self._claimed: list[torch.nn.Parameter] = []

    def enter(self, i: int) -> None:
        """Block i's forward starts: the previous block's weights go, block i's come."""
        self.release()
        b = self._blocks[i]
        streamed = [p for n in (*b.params, *b.shared_params)
                    if self._shared.is_streamed(p := self._named[n])]
        self._shared.fill(self._shared.claim(streamed))
        self._claimed = streamed

    def release(self) -> None:
        if self._claimed:  # claim, fill, compute and release all run on the compute
            self._shared.release(self._claimed)  # stream: the allocator orders reuse
        self._claimed = []
