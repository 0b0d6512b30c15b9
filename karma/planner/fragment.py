"""A block's share of a schedule under one choice: the operations it adds and the device
buffers they fill and free, with the host memory it needs (lowering.py builds them; the ILP
sums them, host_state.py adds the host optimizer's state to them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from karma.schedule import round_seconds


@dataclass
class ProtoOp:
    key: tuple  # unique: (kind, block, ...)
    kind: str
    block: int
    stage: int
    stream: str
    dur_s: float  # rounded as the schedule file writes it, so the file simulates the same
    bytes: int = 0
    uses: tuple[str, ...] = ()
    after: tuple[tuple, ...] = ()  # keys of ops it waits for besides the stage barrier

    def __post_init__(self) -> None:
        self.dur_s = round_seconds(self.dur_s)


@dataclass
class ProtoBuffer:
    name: str
    block: int
    bytes: int
    alloc: tuple | None  # key of the op whose start allocates it
    free: tuple | None  # key of the op whose end frees it


@dataclass
class Fragment:
    ops: list[ProtoOp] = field(default_factory=list)
    buffers: list[ProtoBuffer] = field(default_factory=list)
    host_bytes: int = 0  # host memory it needs on each rank
    pinned_bytes: int = 0  # pinned host memory it needs on each rank
    node_host_bytes: int = 0  # host memory it needs once per node (the node's ranks share it)
    node_pinned_bytes: int = 0  # pinned host memory it needs once per node

    def op(self, *args, **kwargs) -> tuple:
        o = ProtoOp(*args, **kwargs)
        self.ops.append(o)
        return o.key

    def buffer(self, name: str, block: int, nbytes: int, alloc, free) -> None:
        if nbytes > 0:
            self.buffers.append(ProtoBuffer(name, block, nbytes, alloc, free))
