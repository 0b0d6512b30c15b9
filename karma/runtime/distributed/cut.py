"""How sharded host state cuts a parameter over the ranks: rows of dim 0, rank by rank.

Rank r holds rows [r rows, (r + 1) rows) of dim 0, `rows` being dim 0 / N rounded up (the
last ranks' parts are short or empty; a 0-dim tensor is one row): as torch.chunk and
DTensor's Shard(0) cut. Sharded host state (params/layout.py), the exchange's
reduce-scatter (exchange.py) and the checkpoints (checkpoints/dcp_state.py) cut alike.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class Cut(NamedTuple):
    """How a parameter is cut: `rows` rows of dim 0 a rank; this rank's are [start, stop)."""

    rows: int
    start: int
    stop: int

    @classmethod
    def of(cls, shape: torch.Size, world_size: int, rank: int) -> Cut:
        dim0 = shape[0] if len(shape) else 1
        rows = max(1, -(-dim0 // world_size))
        start = min(rank * rows, dim0)
        return cls(rows, start, min(start + rows, dim0))


def rows_of(t: torch.Tensor, cut: Cut) -> torch.Tensor:
    """The rows of `t` a cut gives this rank (a view; a 0-dim tensor is one row)."""
    return (t.view(1) if t.dim() == 0 else t).narrow(0, cut.start, cut.stop - cut.start)
