"""The planning problem as plain numbers: what each block costs in time and bytes.

`build_problem` turns a BlockGraph and a Hardware profile into per-block seconds and bytes
for the world size. The graph must be measured in the plan's dtype (`build_block_graph(...,
dtype=...)`): its saved, output, temporary and edge bytes are taken as measured, never scaled.
In bf16 (mixed precision: forward and loss under autocast) weights, gradients and optimizer
state stay fp32, so parameter bytes are the same as in fp32 and there is no separate master
copy; the bf16 copies of the weights that autocast makes are activations, measured as such.
Everything after this point (lowering, simulation, the ILP, the baselines) sees only these
numbers.

Compute time is a roofline estimate: FLOPs at the profile's matmul rate plus the bytes a block
reads and writes at the device's memory bandwidth (elementwise work is memory-bound), unless
measured times are given (karma/calibrate: by default when planning for this machine). Both
are one process's, alone on the machine; a rank shares its node with the node's other ranks
([Note: a node's ranks share its host]).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import cached_property

from karma.ir.graph import ADAMW, Block, BlockGraph, OptimizerProfile
from karma.planner.hardware import Hardware
from karma.planner.simulate import INDEPENDENT, Contention
from karma.schedule import DTYPES, HOST_STATES, RECOMPUTE_ACTS, is_sharded

# bytes an AdamW step reads and writes per fp32 parameter byte on the device: p, g, m, v
# read; p, m, v written
DEVICE_STEP_TRAFFIC = 7


@dataclass(frozen=True)
class BlockCost:
    """One block's costs. Bytes are device bytes as measured in the plan's dtype; weights,
    gradients and optimizer state are fp32 in either dtype."""

    name: str
    fwd_s: float
    bwd_s: float
    param_bytes: int  # fp32 weights it owns, on the device (its gradients are as many bytes)
    shared_from: tuple[tuple[int, int], ...]  # (owner block, device bytes) it also uses
    optim_bytes: int  # device optimizer state of its weights (fp32 moments; no master copy)
    act_bytes: int  # saved for backward, by this block only (see held_saved); in bf16 this
    # includes the bf16 weight copies its matmuls save
    in_bytes: int  # its inputs from earlier blocks
    out_bytes: int
    host_step_s: float  # host optimizer step of its weights, on one rank while the node's
    # other ranks step theirs ([Note: a node's ranks share its host])
    device_step_s: float  # device optimizer step of its weights
    allreduce_s: float  # ring all-reduce of its gradients (0 on one rank)
    reduce_scatter_s: float = 0.0  # ring reduce-scatter of its gradients (sharded host state)
    all_gather_s: float = 0.0  # ring all-gather of its stepped weights (sharded host state)
    fwd_temp_bytes: int = 0  # peak temporaries of its forward beyond what it saves and returns
    bwd_temp_bytes: int = 0  # peak temporaries of its backward (input gradients included)
    step_temp_bytes: int = 0  # temporaries of an optimizer step (a multiple of its largest weight)
    shared_saved_bytes: int = 0  # what it saves that another block (or the batch) also holds:
    # a swap copies it out and back too, into a second device copy
    shared_made_bytes: int = 0  # of shared_saved_bytes, what it made itself: a recompute makes
    # it again
    held_in_bytes: int = 0  # of in_bytes, the shared saved tensors made by earlier blocks:
    # held for it already (HeldSaved), so a recompute's checkpoint keeps nothing more for them
    # selective recompute (karma/selective_policy.py, [Note: selective recompute]), one per policy
    # that can run the block (keeping most first); none: it cannot
    selective: tuple[SelectiveCost, ...] = ()
    # it may recompute in one checkpoint with the next block ([Note: a checkpoint over two
    # blocks] in karma/schedule.py): each is one call of its module, and what it makes only
    # the next block reads, which reads nothing another block made
    joins_next: bool = False

    def selective_under(self, policy: str) -> SelectiveCost:
        """Its costs under `policy`, one of those that can run it."""
        return next(s for s in self.selective if s.policy == policy)

    @property
    def swap_bytes(self) -> int:
        """What a swap copies out and back: everything the block saves."""
        return self.act_bytes + self.shared_saved_bytes

    @property
    def ckpt_bytes(self) -> int:
        """What a recompute keeps from its forward to its backward: its inputs, less those
        held anyway."""
        return self.in_bytes - self.held_in_bytes


@dataclass(frozen=True)
class SelectiveCost:
    """A block's costs under selective recompute, beside its inputs' checkpoint (ckpt_bytes).

    [Note: the selective recompute's time] Its recompute runs the ops the policy does not
    keep, whose time is measured where the blocks are (calibration), or else the forward's
    in the share that the roofline gives them: their memory traffic at the memory bandwidth
    and the FLOPs of the matmuls among them at the matmul rate, over the forward's FLOPs and
    traffic. Taken as a share of the forward's time, it is never more than a whole
    recompute's.
    """

    policy: str  # BlockEntry.policy: which ops it keeps
    kept_bytes: int  # what its policy's ops return, kept from its forward to its backward
    recompute_bytes: int  # the saved bytes its recompute makes again (its own act_bytes and
    # the shared ones it made, less what the policy's ops made)
    recompute_s: float  # the recompute: the ops its policy does not name
    # what it keeps may wait on the host (kept: host): a block of one module call; one of
    # several is checkpointed call by call, where a later call's checkpoint holds what an
    # earlier call kept, so a swap-out would free nothing (karma/runtime/replay/kept.py)
    leaves: bool = True


@dataclass(frozen=True)
class HeldSaved:
    """Saved bytes several blocks hold (see [Note: each saved storage counted once] in
    karma/ir/graph.py), on the device from the forward of the block that made them to the
    backward of their first reader, the last of their readers to run backward.

    [Note: how long a shared saved tensor is held] Only the first reader's choice can shorten
    that: each later reader is assumed to hold the tensor until its backward whatever it
    chooses (conservative: a swap lets go of it earlier), so it is live at least until the
    backward of the next reader. The first reader
      keeps: it holds the tensor until its own backward;
      swaps: its copies out and back are its own buffers (BlockCost.swap_bytes), so the
        original is held only by the later readers;
      recomputes a tensor it made: the recompute makes it again (BlockCost.shared_made_bytes),
        so likewise;
      recomputes a tensor an earlier block made: it is one of its inputs, which its
        checkpoint holds until its backward (so BlockCost.ckpt_bytes leaves it out).
    """

    made_by: int
    first_reader: int
    next_reader: int  # the second reader: it holds the tensor until its backward at least
    bytes: int

    def freed_after(self, first_reader_act: str) -> int:
        """The block whose backward frees them, given the first reader's act choice."""
        if first_reader_act == "keep" or (
                first_reader_act in RECOMPUTE_ACTS and self.made_by < self.first_reader):
            return self.first_reader
        return self.next_reader


@dataclass(frozen=True)
class Problem:
    """Everything the planner decides over, as numbers."""

    blocks: tuple[BlockCost, ...]
    h2d_bytes_per_s: float
    d2h_bytes_per_s: float
    input_bytes: int  # one batch of model inputs, resident all step
    loss_act_bytes: int  # what the loss saves (logits' log-softmax and the like)
    loss_s: float
    host_mem_bytes: int  # the node's, shared by its nproc_per_node ranks
    pinned_mem_bytes: int  # the node's
    world_size: int
    dtype: str
    host_temps_on_device: bool = False  # cpu: the host optimizer's temporaries are private
    held_saved: tuple[HeldSaved, ...] = ()
    contention: Contention = INDEPENDENT  # streams sharing cores (the CPU; hardware.py)
    # the CPU backend's process outside its tensors, in every stage (calibrate/in_context.py, [Note:
    # the process's own memory]); 0 on a GPU, whose measure is its allocator's
    process_bytes: int = 0
    nproc_per_node: int = 1  # ranks per node, which share its host (blocks' times are a rank's)
    host_state: str = "replicated"  # or "sharded": see karma/schedule.py's docstring

    def __post_init__(self) -> None:
        if not self.blocks:
            raise ValueError("a problem needs at least one block")
        if self.world_size < 1:
            raise ValueError(f"world_size = {self.world_size} < 1")
        if not 1 <= self.nproc_per_node <= self.world_size \
                or self.world_size % self.nproc_per_node:
            raise ValueError(f"nproc_per_node = {self.nproc_per_node} does not divide "
                             f"world_size = {self.world_size}")
        if self.host_state not in HOST_STATES:
            raise ValueError(f"host_state {self.host_state!r}")
        if self.process_bytes < 0:
            raise ValueError(f"process_bytes = {self.process_bytes} < 0")
        spans = [(h.made_by, h.first_reader, h.next_reader) for h in self.held_saved]
        if len(set(spans)) != len(spans) or any(
                not 0 <= p <= r0 < r1 < len(self.blocks) for p, r0, r1 in spans):
            raise ValueError(f"held_saved {spans}: each (made_by, first_reader, next_reader) "
                             f"once, 0 <= made_by <= first_reader < next_reader < "
                             f"{len(self.blocks)}")

    @property
    def sharded(self) -> bool:
        """Host-stepped blocks keep 1/world_size of their host state on each rank."""
        return is_sharded(self.host_state, self.world_size)

    @cached_property  # asked by every block's lowering: a scan each made planning O(n^2)
    def weight_users(self) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per block, (user block, device bytes) of the other blocks that use its weights."""
        users: list[list[tuple[int, int]]] = [[] for _ in self.blocks]
        for j, b in enumerate(self.blocks):
            for owner, nbytes in b.shared_from:
                users[owner].append((j, nbytes))
        return tuple(tuple(u) for u in users)

    @cached_property
    def held_by_first_reader(self) -> tuple[tuple[HeldSaved, ...], ...]:
        """Per block, the held_saved entries whose first reader it is, in their order."""
        held: list[list[HeldSaved]] = [[] for _ in self.blocks]
        for h in self.held_saved:
            held[h.first_reader].append(h)
        return tuple(tuple(h) for h in held)

    def h2d_s(self, nbytes: int) -> float:
        return nbytes / self.h2d_bytes_per_s

    def d2h_s(self, nbytes: int) -> float:
        return nbytes / self.d2h_bytes_per_s


def ring_allreduce_s(nbytes: int, world_size: int, net_bytes_per_s: float,
                     net_latency_s: float) -> float:
    """Ring all-reduce: 2 (N-1)/N of the bytes each way, 2 (N-1) latency-bound steps."""
    if world_size == 1 or nbytes == 0:
        return 0.0
    n = world_size
    return 2 * (n - 1) / n * nbytes / net_bytes_per_s + 2 * (n - 1) * net_latency_s


def ring_half_s(nbytes: int, world_size: int, net_bytes_per_s: float,
                net_latency_s: float) -> float:
    """Ring reduce-scatter or all-gather: (N-1)/N of the bytes, N-1 latency-bound steps."""
    return ring_allreduce_s(nbytes, world_size, net_bytes_per_s, net_latency_s) / 2


@dataclass(frozen=True)
class Measurements:
    """What was measured on the planning machine (karma/calibrate), in place of the roofline
    estimate from the profile's rates; None or 0: estimated."""

    block_s: tuple[tuple[float, float], ...] | None = None  # (forward s, backward s) per block
    # each block's optimizer step: (seconds on the device, seconds on the host)
    optimizer_step_s: tuple[tuple[float, float], ...] | None = None
    process_bytes: int = 0  # the process outside its tensors while training (Problem's)
    loss_s: float | None = None  # the loss's forward and backward
    # per block, its selective recompute's seconds by policy (a policy left out: not
    # measured; [Note: the selective recompute's time])
    selective_s: tuple[Mapping[str, float], ...] | None = None

    @property
    def blocks_measured(self) -> bool:
        return self.block_s is not None


ESTIMATED = Measurements()  # nothing measured: every time from the profile's rates


def build_problem(graph: BlockGraph, hw: Hardware, dtype: str = "fp32", world_size: int = 1,
                  optimizer: OptimizerProfile | None = None, measured: Measurements = ESTIMATED,
                  nproc_per_node: int = 1, host_state: str = "replicated",
                  host_mem_bytes: int | None = None) -> Problem:
    """Per-block costs of `graph` on `hw`.

    optimizer: the optimizer's state and temporaries per parameter byte (default AdamW's:
    2 and 2). measured: times (and the process's own memory) measured on this machine,
    replacing the roofline's: each block's forward and backward, its optimizer step's on the
    device and on the host (else from the profile's rates), and the loss's (else three passes
    over what it saves at the memory bandwidth); one process's, which the node's ranks share
    ([Note: a node's ranks share its host]). nproc_per_node, host_state: Problem's;
    host_mem_bytes: the node's host memory, instead of the profile's (its pinned share
    scaled alike).
    """
    optimizer = optimizer or ADAMW
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}; use one of {', '.join(DTYPES)}")
    if graph.dtype != dtype:
        raise ValueError(f"the block graph of {graph.model} was measured in {graph.dtype}, the "
                         f"plan is in {dtype}: the graph must be measured in the plan's dtype; "
                         f"build it with build_block_graph(..., dtype={dtype!r})")
    in_bytes = [0] * len(graph.blocks)
    for e in graph.edges:
        in_bytes[e.dst] += e.bytes
    shared_saved, shared_made, held_in, held = _shared_saved(graph)
    share = RankShare.of(hw, nproc_per_node)
    blocks = tuple(
        replace(_block_cost(b, i, shared_saved[i], hw, dtype, world_size, optimizer, measured,
                            share, shared_made[i]),
                in_bytes=in_bytes[i], shared_made_bytes=shared_made[i],
                held_in_bytes=held_in[i], joins_next=joins)
        for i, (b, joins) in enumerate(zip(graph.blocks, joins_next(graph), strict=True)))
    loss_act_bytes = graph.loss_act_bytes
    loss_s = (measured.loss_s if measured.loss_s is not None
              else 3 * loss_act_bytes / hw.mem_bytes_per_s)
    return Problem(
        blocks=blocks,
        h2d_bytes_per_s=hw.h2d_bytes_per_s,
        d2h_bytes_per_s=hw.d2h_bytes_per_s,
        input_bytes=graph.input_bytes,
        loss_act_bytes=loss_act_bytes,
        loss_s=loss_s * share.compute,
        host_mem_bytes=host_mem_bytes or hw.host_mem_bytes,
        pinned_mem_bytes=(hw.pinned_mem_bytes if host_mem_bytes is None else
                          host_mem_bytes * hw.pinned_mem_bytes // hw.host_mem_bytes),
        world_size=world_size,
        dtype=dtype,
        # On the CPU backend the "device" is the process's private memory, where the host
        # optimizer's temporaries also land; on a GPU they are host memory.
        host_temps_on_device=hw.device_kind == "cpu",
        held_saved=tuple(HeldSaved(p, r0, r1, nbytes)
                         for (p, r0, r1), nbytes in sorted(held.items())),
        contention=Contention.of(vars(hw), nproc_per_node),
        process_bytes=measured.process_bytes,
        nproc_per_node=nproc_per_node,
        host_state=host_state,
    )


def without_pairs(problem: Problem) -> Problem:
    """`problem` with no two blocks able to recompute under one checkpoint (karma-plan
    --no-pairs)."""
    return replace(problem, blocks=tuple(replace(b, joins_next=False) for b in problem.blocks))


def without_selective(problem: Problem) -> Problem:
    """`problem` with no block able to recompute selectively (karma-plan --no-selective)."""
    return replace(problem, blocks=tuple(replace(b, selective=()) for b in problem.blocks))


def joins_next(graph: BlockGraph) -> list[bool]:
    """Per block, whether it may recompute in one checkpoint with the next (BlockCost.
    joins_next): both blocks one call of their module (Block.one_call), every edge out of it
    into the next block and every edge into the next block out of it, and what it saves
    with others saved by the next block only."""
    n = len(graph.blocks)
    out_to: list[set[int]] = [set() for _ in range(n)]
    in_from: list[set[int]] = [set() for _ in range(n)]
    for e in graph.edges:
        out_to[e.src].add(e.dst)
        in_from[e.dst].add(e.src)
    shared_readers: list[set[int]] = [set() for _ in range(n)]
    for sh in graph.shared_saved:
        if sh.producer >= 0:
            shared_readers[sh.producer].update(sh.readers)
    return [i + 1 < n and graph.blocks[i].one_call and graph.blocks[i + 1].one_call
            and out_to[i] == {i + 1} and in_from[i + 1] == {i}
            and shared_readers[i] <= {i, i + 1}
            for i in range(n)]


def _shared_saved(graph: BlockGraph) -> tuple[list[int], list[int], list[int],
                                               dict[tuple[int, int, int], int]]:
    """Per block, the saved bytes it shares with other blocks (or the batch), those of them
    it made, and those made by an earlier block that it takes in; and the held tensors'
    bytes by (maker, first reader, next reader): see HeldSaved."""
    shared_saved, shared_made, held_in = ([0] * len(graph.blocks) for _ in range(3))
    held: dict[tuple[int, int, int], int] = {}
    for sh in graph.shared_saved:
        for r in sh.readers:
            shared_saved[r] += sh.bytes
            shared_made[r] += sh.bytes if sh.producer == r else 0
            # a block saves what another block made only if it is one of its inputs
            held_in[r] += sh.bytes if 0 <= sh.producer < r else 0
        if sh.producer >= 0:  # the model's inputs are resident anyway (Problem.input_bytes)
            key = (sh.producer, sh.readers[0], sh.readers[1])
            held[key] = held.get(key, 0) + sh.bytes
    return shared_saved, shared_made, held_in, held


@dataclass(frozen=True)
class RankShare:
    """How many times longer a rank's work takes than one process's alone on the node.

    [Note: a node's ranks share its host] Times are measured (or estimated from the
    profile's rates) for one process that has the node to itself, but the ranks of a node
    run at once on its host. Their host optimizers step the same blocks at the same time
    (each as its gradients arrive) on the same cores and memory, and a host AdamW step is
    bound by memory bandwidth (about 28 bytes a parameter), which they divide: a rank's host
    step takes k times one process's, k the ranks per node (the profiles' host optimizer
    rates are a node's host). Sharded, a rank steps 1/N of each weight (lowering.py), so one
    node of N ranks steps its blocks in one process's time.
    On the CPU backend the "devices" are the same cores too. torchrun gives each of the k
    ranks OMP_NUM_THREADS=1 where calibration timed the blocks on every core, so the
    forwards, backwards, the loss and device steps take k times as long as well: the node's
    cores divided among its ranks. Measured on the 2-core machine, an 8-layer GPT (width 512,
    sequence 256, vocabulary 8192, batch 8), its keep_all schedule in karma-run, medians of
    steps 2-6: 2.36 s a step on 2 threads alone; 4.42-4.43 s on 1 thread alone (1.88x);
    4.47-4.53 s on 1 thread in each of two processes at once (1.90-1.92x), which is what two
    ranks are (they share the memory bandwidth too). k (2x) is 4-5% above that, where the
    same plan at 1 rank is 7% above its own measure; timing the blocks again in context on a
    rank's thread count would come within 2%, but costs a second calibration (a minute on
    that GPT) for every number of ranks a node, and k holds for the roofline estimate too
    (the cpu profile's rates are every core's). Its 600 MiB plan on 2 ranks, sharded:
    predicted 5.24 s, measured 5.01-5.05 s (2.70 s predicted without the share). The factor
    assumes a rank has cores/k threads: torchrun gives every rank one, which on a machine of
    more cores than ranks wants OMP_NUM_THREADS = cores / k. On a GPU the devices are the
    rank's own: only the host step is shared.
    """

    compute: int  # the device's work (forward, backward, loss, device step): k on the CPU
    host: int  # a host optimizer step: k

    @classmethod
    def of(cls, hw: Hardware, nproc_per_node: int) -> RankShare:
        """The share of a rank of a node of `hw` with `nproc_per_node` ranks."""
        return cls(nproc_per_node if hw.device_kind == "cpu" else 1, nproc_per_node)


ALONE = RankShare(1, 1)  # one rank a node: the node to itself


def _block_cost(b: Block, i: int, shared_saved_bytes: int, hw: Hardware, dtype: str,
                world_size: int, optimizer: OptimizerProfile, measured: Measurements,
                share: RankShare = ALONE, shared_made_bytes: int = 0) -> BlockCost:
    """Block i's costs, but for the bytes it takes in from other blocks (build_problem's), on
    one rank of a node that `share` says how its ranks share."""
    traffic = b.act_bytes + shared_saved_bytes + b.out_bytes + b.param_bytes
    if measured.block_s is not None:
        fwd_s, bwd_s = measured.block_s[i]
    else:
        flops_per_s = hw.flops_per_s[dtype]
        fwd_s = b.fwd_flops / flops_per_s + traffic / hw.mem_bytes_per_s
        bwd_s = b.bwd_flops / flops_per_s + 2 * traffic / hw.mem_bytes_per_s
    if measured.optimizer_step_s is not None:
        device_step_s, host_step_s = measured.optimizer_step_s[i]
    else:
        device_step_s = DEVICE_STEP_TRAFFIC * b.param_bytes / hw.mem_bytes_per_s
        host_step_s = b.param_bytes / hw.host_optim_bytes_per_s
    selective = _selective_costs(b, i, fwd_s, traffic, shared_made_bytes, hw, dtype, measured)
    fwd_s, bwd_s, device_step_s = (t * share.compute for t in (fwd_s, bwd_s, device_step_s))
    host_step_s *= share.host
    selective = tuple(replace(s, recompute_s=s.recompute_s * share.compute) for s in selective)
    net = (b.param_bytes, world_size, hw.net_bytes_per_s, hw.net_latency_s)
    return BlockCost(
        name=b.name, fwd_s=fwd_s, bwd_s=bwd_s, param_bytes=b.param_bytes,
        shared_from=b.shared_from, optim_bytes=optimizer.state_factor * b.param_bytes,
        act_bytes=b.act_bytes, in_bytes=0, out_bytes=b.out_bytes,
        fwd_temp_bytes=b.fwd_temp_bytes, bwd_temp_bytes=b.bwd_temp_bytes,
        step_temp_bytes=int(optimizer.temp_factor * b.max_param_bytes),
        host_step_s=host_step_s, device_step_s=device_step_s,
        allreduce_s=ring_allreduce_s(*net), reduce_scatter_s=ring_half_s(*net),
        all_gather_s=ring_half_s(*net), shared_saved_bytes=shared_saved_bytes,
        selective=selective)


def _selective_costs(b: Block, i: int, fwd_s: float, traffic: int, shared_made_bytes: int,
                     hw: Hardware, dtype: str, measured: Measurements
                     ) -> tuple[SelectiveCost, ...]:
    """Block i's costs under each policy that can run it, its recompute timed or a share of
    its forward ([Note: the selective recompute's time])."""
    timed = measured.selective_s[i] if measured.selective_s is not None else {}
    mem_s = traffic / hw.mem_bytes_per_s  # as _block_cost's roofline
    whole_s = b.fwd_flops / hw.flops_per_s[dtype] + mem_s
    out = []
    for sel in b.selective:
        recompute_s = timed.get(sel.policy)
        if recompute_s is None:
            part_s = (mem_s * sel.recompute_traffic_bytes / max(sel.forward_traffic_bytes, 1)
                      + sel.recompute_flops / hw.flops_per_s[dtype])
            recompute_s = fwd_s * min(part_s / whole_s, 1.0) if whole_s > 0 else 0.0
        out.append(SelectiveCost(
            policy=sel.policy, kept_bytes=sel.kept_bytes,
            recompute_bytes=max(0, b.act_bytes + shared_made_bytes - sel.kept_saved_bytes),
            recompute_s=recompute_s, leaves=len(b.modules) == 1))
    return tuple(out)
