"""The block graph: karma's one picture of a model.

A *block* is the unit of every decision the planner makes: a contiguous run of the model's
forward (a transformer layer, a ResNet bottleneck, the embedding "head", the output "tail").
Blocks are listed in execution order; edges carry the tensors that flow between them,
long skips (block i -> block j > i+1) included.

[Note: each saved storage counted once] Autograd often saves one storage for several blocks:
a ResNet bottleneck's final relu saves its output, which the next bottleneck's first conv
saves as its input; a rotary cos/sin table or an attention mask made in the head is saved by
every layer. Each saved storage is counted once: in the `act_bytes` of the one block that
saves it when no other block does and a block made it, else in one `SharedSaved` entry
(saved by several blocks, or made outside every block: the model's inputs). No block's swap
or recompute frees a shared storage (another block still holds it), so it is live on the
device from its producer's forward to the backward of its first reader, the last of its
readers to run backward.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import networkx as nx


@dataclass(frozen=True)
class Selective:
    """What a block costs under selective recompute (karma/selective_policy.py, [Note: selective
    recompute]), from its forward on its own: see [Note: a block's saved bytes, op by op] in
    karma/ir/measure.py."""

    policy: str  # BlockEntry.policy: which ops it keeps
    kept_bytes: int  # what its policy's ops return, each storage once: kept to the backward
    kept_saved_bytes: int  # of the storages it saves, those its policy's ops made
    recompute_traffic_bytes: int  # what the other ops read and write: the recompute's
    forward_traffic_bytes: int  # what every op of its forward reads and writes
    recompute_flops: int = 0  # of the matmuls and convolutions it recomputes


@dataclass(frozen=True)
class Block:
    """One block of the forward pass, with everything the planner needs to cost it."""

    index: int
    name: str  # e.g. "h.3", "layer2.1", "head", "tail"; a repeated call gets "NAME#k"
    modules: tuple[str, ...]  # the outermost modules whose calls make up the block
    params: tuple[str, ...]  # parameters this block owns (first user of a shared one)
    shared_params: tuple[str, ...]  # parameters it uses that an earlier block owns
    shared_from: tuple[tuple[int, int], ...]  # (owner block, bytes) of those parameters
    param_bytes: int  # bytes of the parameters it owns
    act_bytes: int  # bytes autograd saves for backward that no other block saves (parameters,
    # buffers and the model's inputs excluded; see [Note: each saved storage counted once])
    out_bytes: int  # bytes of the tensors the block returns
    fwd_flops: int
    bwd_flops: int
    fwd_temp_bytes: int  # peak temporaries of its forward, beyond what it saves and returns
    bwd_temp_bytes: int  # peak temporaries of its backward (gradients of its inputs included)
    max_param_bytes: int  # its largest own parameter (an optimizer step's temporaries)
    # under selective recompute, one per policy that can run it (keeping most first)
    selective: tuple[Selective, ...] = ()
    # its nodes are one call of its module and nothing of the caller's (not a head, tail or
    # glue): the runtime can checkpoint it from that module's hooks
    one_call: bool = False

    def __post_init__(self) -> None:
        for field in ("param_bytes", "act_bytes", "out_bytes", "fwd_flops", "bwd_flops",
                      "fwd_temp_bytes", "bwd_temp_bytes", "max_param_bytes"):
            if getattr(self, field) < 0:
                raise ValueError(f"block {self.name}: {field} = {getattr(self, field)} < 0")


@dataclass(frozen=True)
class Edge:
    """Tensors made by block `src` and used by block `dst` (src < dst)."""

    src: int
    dst: int
    bytes: int


@dataclass(frozen=True)
class SharedSaved:
    """Saved storages that no one block's decision frees (see [Note: each saved storage
    counted once]), grouped by who made them and which blocks save them."""

    producer: int  # the block whose forward made them; -1: the model's inputs (or constants)
    readers: tuple[int, ...]  # the blocks whose backward reads them, ascending
    bytes: int

    def __post_init__(self) -> None:
        if not self.readers or list(self.readers) != sorted(set(self.readers)):
            raise ValueError(f"{self}: readers must be distinct block indices, ascending")
        if self.producer > self.readers[0] or self.bytes < 0:
            raise ValueError(f"{self}: made after its first reader, or negative bytes")

    @property
    def freed_after(self) -> int:
        """The block whose backward is the last to read them (the first reader)."""
        return self.readers[0]


@dataclass(frozen=True)
class OptimizerProfile:
    """What the model file's optimizer costs in memory, per byte of parameter (measured by
    karma.ir.optimizer.optimizer_profile)."""

    state_factor: int  # parameter-sized state tensors it keeps (AdamW: 2)
    temp_factor: float  # parameter-sized temporaries a step makes (AdamW: 2)


ADAMW = OptimizerProfile(state_factor=2, temp_factor=2.0)  # the default optimizer's


@dataclass(frozen=True)
class BlockGraph:
    """A model's blocks in execution order and the tensors between them."""

    model: str  # the model file's path as given
    batch_size: int
    total_param_bytes: int  # unique parameter bytes of the whole model
    input_bytes: int  # bytes of the model's inputs (one batch)
    loss_act_bytes: int  # bytes the loss function saves for backward
    blocks: tuple[Block, ...]
    edges: tuple[Edge, ...]
    tracer: str  # "torch.export" or "torch.fx"
    shared_saved: tuple[SharedSaved, ...] = ()  # saved storages several blocks hold
    notes: tuple[str, ...] = ()  # what karma changed to trace the model (not in to_json)
    dtype: str = "fp32"  # the compute dtype it was measured in: fp32, or bf16 under autocast

    def __post_init__(self) -> None:
        owned = sum(b.param_bytes for b in self.blocks)
        if owned != self.total_param_bytes:
            raise ValueError(
                f"blocks own {owned} parameter bytes but the model has {self.total_param_bytes}"
            )
        for e in self.edges:
            if not 0 <= e.src < e.dst < len(self.blocks):
                raise ValueError(f"edge {e} does not go forward between blocks")
        for sh in self.shared_saved:
            if sh.readers[-1] >= len(self.blocks):
                raise ValueError(f"{sh} reads a block beyond the last")

    @property
    def saved_bytes(self) -> int:
        """Bytes autograd saves for the blocks' backward, each storage once (loss excluded)."""
        return sum(b.act_bytes for b in self.blocks) + sum(s.bytes for s in self.shared_saved)

    def block_saved_bytes(self, i: int) -> int:
        """Bytes block i's backward reads: its own act_bytes and the shared storages it saves
        (what a swap of block i copies)."""
        return self.blocks[i].act_bytes + sum(s.bytes for s in self.shared_saved
                                              if i in s.readers)

    def digraph(self) -> nx.DiGraph:
        """The blocks as a networkx DiGraph (nodes are block indices, edges carry `bytes`)."""
        g = nx.DiGraph()
        for b in self.blocks:
            g.add_node(b.index, name=b.name)
        for e in self.edges:
            g.add_edge(e.src, e.dst, bytes=e.bytes)
        return g

    def to_json_dict(self) -> dict:
        return {
            "model": self.model,
            "batch_size": self.batch_size,
            "total_param_bytes": self.total_param_bytes,
            "input_bytes": self.input_bytes,
            "loss_act_bytes": self.loss_act_bytes,
            "tracer": self.tracer,
            "dtype": self.dtype,
            "blocks": [
                {
                    "name": b.name,
                    "modules": list(b.modules),
                    "param_bytes": b.param_bytes,
                    "act_bytes": b.act_bytes,
                    "out_bytes": b.out_bytes,
                    "fwd_flops": b.fwd_flops,
                    "bwd_flops": b.bwd_flops,
                    "fwd_temp_bytes": b.fwd_temp_bytes,
                    "bwd_temp_bytes": b.bwd_temp_bytes,
                    "selective": [asdict(s) for s in b.selective],
                }
                for b in self.blocks
            ],
            "edges": [asdict(e) for e in self.edges],
            "shared_saved": [{"producer": s.producer, "readers": list(s.readers),
                              "bytes": s.bytes} for s in self.shared_saved],
        }

    def to_json(self) -> str:
        return json.dumps(self.to_json_dict(), indent=2)

    def table(self) -> str:
        """A fixed-width table, identical from run to run for the same model and batch."""
        mib = 1024 * 1024
        w = max([16] + [len(b.name) for b in self.blocks])
        head = (
            f"{'#':>3}  {'block':<{w}} {'params MiB':>11} {'acts MiB':>10} {'out MiB':>9}"
            f" {'fwd GFLOP':>10} {'bwd GFLOP':>10}  modules"
        )
        lines = [
            f"model {self.model}  batch {self.batch_size}  traced with {self.tracer}"
            + (f"  measured in {self.dtype} (autocast)" if self.dtype != "fp32" else ""),
            head,
            "-" * len(head),
        ]
        for b in self.blocks:
            mods = ", ".join(b.modules)
            if len(mods) > 48:
                mods = mods[:45] + "..."
            lines.append(
                f"{b.index:>3}  {b.name:<{w}} {b.param_bytes / mib:>11.2f} {b.act_bytes / mib:>10.2f}"
                f" {b.out_bytes / mib:>9.2f} {b.fwd_flops / 1e9:>10.2f} {b.bwd_flops / 1e9:>10.2f}"
                f"  {mods}"
            )
        total_act = self.saved_bytes
        total_fwd = sum(b.fwd_flops for b in self.blocks)
        total_bwd = sum(b.bwd_flops for b in self.blocks)
        lines.append("-" * len(head))
        lines.append(
            f"{'':>3}  {'total':<{w}} {self.total_param_bytes / mib:>11.2f} {total_act / mib:>10.2f}"
            f" {'':>9} {total_fwd / 1e9:>10.2f} {total_bwd / 1e9:>10.2f}"
        )
        lines.append(
            f"inputs {self.input_bytes / mib:.2f} MiB; loss saves {self.loss_act_bytes / mib:.2f} MiB"
        )
        shared = sum(s.bytes for s in self.shared_saved)
        lines.append(
            f"shared saved: {shared / mib:.2f} MiB of the total acts, in {len(self.shared_saved)}"
            " groups" + "".join(
                f"; {'input' if s.producer < 0 else s.producer}->"
                f"{','.join(map(str, s.readers))} {s.bytes / mib:.2f}"
                for s in self.shared_saved[:6])
            + ("; ..." if len(self.shared_saved) > 6 else "")
        )
        skips = [e for e in self.edges if e.dst > e.src + 1]
        lines.append(
            f"edges: {len(self.edges)} ({len(skips)} long skips"
            + (": " + ", ".join(f"{e.src}->{e.dst}" for e in skips[:8]) if skips else "")
            + (", ..." if len(skips) > 8 else "")
            + ")"
        )
        return "\n".join(lines)
