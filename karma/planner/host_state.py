"""Host memory a plan needs, per rank and per node: what each block's host state takes.

A fragment (lowering.py) carries the bytes a block needs on each rank and, once a node, the
bytes the node's ranks share; HostUse sums them into a rank's and a node's figures, which
the ILP, the evaluation and the infeasibility message hold against the node's memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from karma.planner.fragment import Fragment
from karma.planner.problem import BlockCost, Problem


@dataclass(frozen=True)
class HostUse:
    """Host memory a plan needs, per rank and per node ([Note: host state per rank and per
    node]): a rank's figures include its share of what the node's ranks share."""

    host_bytes: int
    pinned_bytes: int
    node_host_bytes: int
    node_pinned_bytes: int

    @classmethod
    def of(cls, problem: Problem, frags: list[Fragment]) -> HostUse:
        k = problem.nproc_per_node
        own = sum(f.host_bytes for f in frags), sum(f.pinned_bytes for f in frags)
        shared = sum(f.node_host_bytes for f in frags), sum(f.node_pinned_bytes for f in frags)
        return cls(own[0] + shard_bytes(shared[0], k), own[1] + shard_bytes(shared[1], k),
                   k * own[0] + shared[0], k * own[1] + shared[1])


def shard_bytes(nbytes: int, world_size: int) -> int:
    """One rank's share of `nbytes` cut in `world_size` parts."""
    return -(-nbytes // world_size)


def add_host_state(f: Fragment, problem: Problem, b: BlockCost, sharded: bool,
                reduce_on_host: bool) -> None:
    """[Note: host state per rank and per node] A host-stepped block keeps fp32 master
    weights, gradients and optimizer state on the host, and the weights its device copies
    are filled from (pinned: the uploads and fetches copy them). Replicated, every rank keeps
    all of it, the masters being the weights it copies from. Sharded, a rank keeps its 1/N
    of gradients (pinned: the gradients' copies land there) and optimizer state, plus all of
    the gradients where they add up over micro-batches before the exchange (the shard is
    then part of them); the whole weights are gathered into one copy per node, which its
    ranks share, and a rank's masters are its rows of it (runtime/params/layout.py)."""
    if not sharded:
        f.host_bytes += b.optim_bytes + 2 * b.param_bytes
        f.pinned_bytes += b.param_bytes
        return
    n = problem.world_size
    grads = b.param_bytes if reduce_on_host else shard_bytes(b.param_bytes, n)
    f.host_bytes += shard_bytes(b.optim_bytes, n) + grads
    f.pinned_bytes += grads
    f.node_host_bytes += b.param_bytes
    f.node_pinned_bytes += b.param_bytes
