"""Lowering: a plan's per-block choices -> the ordered operations and buffers of a schedule.

Every block contributes a *fragment*: its own operations (forward, backward, and what its
choice adds: swap-out and swap-in, recompute, weight fetches, gradient copy, optimizer step,
upload) and the device buffers they fill and free. The ILP sums the same fragments over a
one-hot choice per block, and the simulator runs the assembled list, so the plan the solver
optimises and the schedule the simulator checks are the same thing by construction.

Stages (n blocks; see karma/schedule.py for what a stage means):

    0               prologue: fetch block 0's streamed weights
    1 + j           forward of block j (and the loss after the last); swap-out of block
                    j-1's activations; prefetch of block j+1's streamed weights
    1 + n + (n-1-j) backward of block j (after its recompute); swap-ins and weight
                    prefetches for block j-1 (or j-2, see below); gradients of block j+1 to
                    the host (all-reduced first, one stage earlier, on several ranks)
    2n + 1 (+1)     epilogue: the last gradients to the host
    last            update: weights stepped on the host go back to their device buffers;
                    with clipping, every optimizer step too (see [Note: clipping])

[Note: how far ahead a copy is issued] A block's swap-in and weight fetches are issued one or
two stages before their use (its choice's `ahead`). Two stages hide a long copy behind more
compute and cost a buffer held one stage longer; either way the copy's time falls in one
stage and its buffer in a known span of stages, so time and memory stay additive per block
and the ILP stays exact.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

from karma.planner.fragment import Fragment, ProtoOp
from karma.planner.host_state import add_host_state, shard_bytes
from karma.planner.pairs import offers_pair, pairs_agree
from karma.planner.problem import Problem
from karma.schedule import (
    ACT_CHOICES,
    FETCH_PHASES,
    HOST_TEMP_PREFIX,
    KEPT_CHOICES,
    OPTIM_CHOICES,
    PROCESS_BUFFER,
    RECOMPUTE_ACTS,
    STREAMS,
    WEIGHT_CHOICES,
    Buffer,
    Op,
    WeightBuffer,
    is_barrier,
    resident_weights,
)


@dataclass(frozen=True, order=True)
class Choice:
    """What a plan does with one block."""

    act: str  # keep | swap | recompute | selective
    weights: str = "resident"  # resident | streamed
    optim: str = "device"  # device | host
    # stages before its use that a swap-in or weight fetch is issued (1 or 2; what a selective
    # block keeps on the host comes back one stage ahead)
    ahead: int = 1
    policy: str = ""  # selective: which ops it keeps (BlockEntry.policy); "" for other acts
    kept: str = "device"  # selective: where what it keeps waits for the backward (BlockEntry)
    # recomputed in one checkpoint with the next block (BlockEntry.with_next), or the next
    # block of such a pair ([Note: a checkpoint over two blocks] in karma/schedule.py)
    with_next: bool = False
    with_prev: bool = False

    def __post_init__(self) -> None:
        paired = self.with_next or self.with_prev
        if self.act not in ACT_CHOICES or self.weights not in WEIGHT_CHOICES \
                or self.optim not in OPTIM_CHOICES or self.ahead not in (1, 2) \
                or bool(self.policy) != (self.act == "selective") \
                or self.kept not in KEPT_CHOICES \
                or (self.kept == "host" and self.act != "selective") \
                or (paired and (self.act not in RECOMPUTE_ACTS or self.kept != "device")) \
                or (self.with_next and (self.with_prev or self.weights != "resident")):
            raise ValueError(f"not a choice: {self}")
        if self.weights == "streamed" and self.optim != "host":
            raise ValueError("streamed weights are stepped on the host")


def valid_choices(problem: Problem, i: int) -> list[Choice]:
    """Choices block i may take: the last block cannot swap (its backward comes next); it is
    selective under each policy that can run it, what it keeps on the device or (but the
    last, and a block of several module calls: SelectiveCost.leaves) on the host; a block
    that copies nothing in has no prefetch distance to choose."""
    n = len(problem.blocks)
    acts = [(a, "") for a in (("keep", "swap", "recompute") if i < n - 1
                               else ("keep", "recompute"))]
    acts += [("selective", s.policy) for s in problem.blocks[i].selective]
    wo = [("resident", "device"), ("resident", "host"), ("streamed", "host")]
    pairs = offers_pair(problem, i)
    out = []
    for a, policy in acts:
        for w, o in wo:
            fetches = a == "swap" or w == "streamed"
            for ahead in (1, 2) if fetches and i + 2 <= n - 1 else (1,):
                out.append(Choice(a, w, o, ahead, policy))
            if a == "selective" and i < n - 1 \
                    and problem.blocks[i].selective_under(policy).leaves:
                out.append(Choice(a, w, o, 1, policy, kept="host"))
            if a in RECOMPUTE_ACTS and pairs and w == "resident":
                out.append(Choice(a, w, o, 1, policy, with_next=True))
    return out


@dataclass(frozen=True)
class Training:
    """How gradients become an optimizer step (the schedule's config.accumulate and
    config.clip_grad_norm), as far as the plan's shape depends on it."""

    accumulate: int = 1  # micro-batches per step; the op list is one micro-batch's replay
    clip: bool = False  # the global gradient norm is clipped: every step after every gradient

    def __post_init__(self) -> None:
        if not isinstance(self.accumulate, int) or self.accumulate < 1:
            raise ValueError(f"accumulate = {self.accumulate!r} must be a whole number >= 1")


PLAIN = Training()  # one micro-batch per step, no clipping: the default everywhere


# [Note: accumulation] With accumulate N the runtime replays the op list N times per step
# and skips the ops of LAST_MICRO_BATCH_KINDS (schedule.py: all-reduces, steps, uploads) in
# the first N-1. Gradients add up between replays: a host-stepped block's on the host (each
# grads_to_host adds), a device-stepped block's in its grad buffer, which then lives through
# the whole step (allocated before the replay, never freed). On several ranks a
# host-stepped block's gradients are all-reduced once, on the host: its all-reduce follows
# its grads_to_host (one stage later), and its host step follows the all-reduce.

# [Note: a shared weight's gradients meet in autograd's input buffer] A weight that later
# blocks also use (a tied embedding) gets one gradient per use, and autograd sums them before
# .grad sees any. The first to arrive, in the backward of the last block using it, waits in
# the input buffer of the weight's AccumulateGrad; each later one (the backward of every
# other user, the owner's last) is added to it out of place, because the waiting gradient
# is a view (the transpose of a matmul's result) that autograd does not add into
# (can_accumulate_inplace in torch/csrc/autograd/input_buffer.cpp). So for a moment the
# waiting sum, the new gradient and their sum are all alive: three copies of the shared
# bytes, two beyond the waiting one, which grad.{i} already counts. (GPT-2 small's tied
# 147 MiB embedding, plain PyTorch 2.13 on the CPU: 294 MiB above the waiting gradient
# during the embedding's backward.) The sum reaches .grad after the owner's backward: taken
# as it is when .grad is empty, added in place when .grad holds earlier micro-batches'
# (a device step with accumulate > 1), where the waiting sum is then a copy of its own.
# The problem knows each user's shared bytes, not which tensors they are: the owner's sum
# covers their union, bounded here by their total (exact for one user, a tied embedding).


# [Note: clipping] The global norm needs every gradient before any update, so with clipping
# every device and host step runs in the update stage, after every backward, all-reduce and
# grads_to_host; host steps (and their uploads) go from block 0 up, the order in which the
# next step needs the weights. Device-stepped blocks hold their gradients until then.


@dataclass(frozen=True)
class Stages:
    """Stage numbering for n blocks on world_size ranks."""

    n: int
    world_size: int

    def fwd(self, j: int) -> int:
        return 1 + j

    def bwd(self, j: int) -> int:
        return 1 + self.n + (self.n - 1 - j)

    def allreduce(self, j: int) -> int:
        return self.bwd(j) + 1

    def to_host(self, j: int) -> int:
        """Stage in which block j's gradients go to the host."""
        return self.bwd(j) + (2 if self.world_size > 1 else 1)

    @property
    def update(self) -> int:
        return self.to_host(0) + 1

    @property
    def count(self) -> int:
        return self.update + 1


def weight_buffer(block: int, choice: Choice, phase: str, user: int, n: int) -> str:
    """Name of the device buffer holding `block`'s weights when `user` runs `phase`."""
    if choice.weights == "resident":
        return resident_weights(block)
    # the last block's backward follows its forward at once: it reads the forward's copy
    return WeightBuffer(block, "fwd" if user == n - 1 else phase, user).name


def users_of(problem: Problem, owner: int) -> list[tuple[int, int]]:
    """(user block, device bytes) of the blocks that use `owner`'s weights, owner excluded."""
    return list(problem.weight_users[owner])


def fragment(problem: Problem, i: int, c: Choice, training: Training = PLAIN) -> Fragment:
    """Block i's operations and buffers under choice c."""
    b = problem.blocks[i]
    n = len(problem.blocks)
    if c.act == "swap" and i + c.ahead > n - 1:
        raise ValueError(f"block {i} ({b.name}) cannot swap back in {c.ahead} stage(s) before "
                         f"its backward: only {n - 1 - i} block(s) follow it; keep or recompute "
                         "it, or prefetch less far ahead")
    st = Stages(n, problem.world_size)
    f = Fragment()
    fwd = f.op(("forward", i), "forward", i, st.fwd(i), "compute", b.fwd_s)
    if c.act in RECOMPUTE_ACTS:  # with the next block's recompute where they are a pair
        f.op(("recompute", i), "recompute", i, st.bwd(i + 1 if c.with_next else i), "compute",
             b.fwd_s if c.act == "recompute" else b.selective_under(c.policy).recompute_s)
    bwd = f.op(("backward", i), "backward", i, st.bwd(i), "compute", b.bwd_s)
    f.buffer(f"tmp.f.{i}", i, b.fwd_temp_bytes, fwd, fwd)
    f.buffer(f"tmp.b.{i}", i, b.bwd_temp_bytes, bwd, bwd)
    _activations(f, problem, st, i, c, fwd, bwd)
    _weights(f, problem, st, i, c)
    _gradients(f, problem, st, i, c, training, bwd)
    return f


def _activations(f: Fragment, problem: Problem, st: Stages, i: int, c: Choice, fwd: tuple,
                 bwd: tuple) -> None:
    """What block i saves for its backward, kept, swapped or recomputed; the saved tensors
    it shares with later blocks, held until their backward, or its own (see [Note: how long
    a shared saved tensor is held] in problem.py)."""
    b = problem.blocks[i]
    for h in problem.held_by_first_reader[i]:
        # recomputed with the next block, what it made is made again before that block's
        # backward: the next block holds it only through its forward (BlockCost.joins_next:
        # no later block reads it)
        free = ("forward", i + 1) if c.with_next and h.made_by == i else \
            ("backward", h.freed_after(c.act))
        f.buffer(f"shared.{h.made_by}.{i}.{h.next_reader}", i, h.bytes,
                 ("forward", h.made_by), free)
    if c.act == "keep":
        f.buffer(f"act.{i}", i, b.act_bytes, fwd, bwd)
    elif c.act == "swap":
        # the swap copies every tensor the block saved, shared ones included; only its own
        # leave the device, and the swap-in makes a second copy of the shared ones
        out = f.op(("swap_out", i), "swap_out", i, st.fwd(i + 1), "d2h",
                   problem.d2h_s(b.swap_bytes), b.swap_bytes, uses=(f"act.{i}",))
        into = f.op(("swap_in", i), "swap_in", i, st.bwd(i + c.ahead), "h2d",
                    problem.h2d_s(b.swap_bytes), b.swap_bytes)
        f.buffer(f"act.{i}", i, b.act_bytes, fwd, out)
        f.buffer(f"act.{i}@in", i, b.swap_bytes, into, bwd)
        f.host_bytes += b.swap_bytes
        f.pinned_bytes += b.swap_bytes
    else:
        # the next block of a pair takes its inputs from the previous block's recompute
        f.buffer(f"ckpt.{i}", i, 0 if c.with_prev else b.ckpt_bytes, fwd, bwd)
        # the recompute makes its own saved tensors again, shared ones it made included; a
        # selective one all but those its policy's ops made, which it kept
        remade = b.act_bytes + b.shared_made_bytes
        if c.act == "selective":
            sel = b.selective_under(c.policy)
            _kept(f, problem, st, i, c, sel.kept_bytes, fwd, bwd)
            remade = sel.recompute_bytes
        f.buffer(f"act.{i}@re", i, remade, ("recompute", i), bwd)
        f.buffer(f"tmp.r.{i}", i, b.fwd_temp_bytes, ("recompute", i), ("recompute", i))


def _kept(f: Fragment, problem: Problem, st: Stages, i: int, c: Choice, kept_bytes: int,
          fwd: tuple, bwd: tuple) -> None:
    """What selective block i keeps (its policy's outputs): on the device from its forward to
    its backward, or copied to the host in the next block's forward and back in the next
    block's backward, before its recompute ([Note: what a selective block keeps, on the host]
    in karma/runtime/replay/kept.py)."""
    if c.kept == "device":
        f.buffer(kept_buffer(i), i, kept_bytes, fwd, bwd)
        return
    out = f.op(("swap_out", i), "swap_out", i, st.fwd(i + 1), "d2h",
               problem.d2h_s(kept_bytes), kept_bytes, uses=(kept_buffer(i),))
    into = f.op(("swap_in", i), "swap_in", i, st.bwd(i + 1), "h2d",
                problem.h2d_s(kept_bytes), kept_bytes)
    f.buffer(kept_buffer(i), i, kept_bytes, fwd, out)
    f.buffer(kept_buffer(i, "host"), i, kept_bytes, into, bwd)
    f.host_bytes += kept_bytes
    f.pinned_bytes += kept_bytes


def kept_buffer(i: int, kept: str = "device") -> str:
    """The device buffer of what selective block i keeps: sac.3, or sac.3@in once it is
    back from the host."""
    return f"sac.{i}" + ("@in" if kept == "host" else "")


def _weights(f: Fragment, problem: Problem, st: Stages, i: int, c: Choice) -> None:
    """Block i's weights on the device: resident, or fetched for itself and then for the
    later blocks that share them."""
    b = problem.blocks[i]
    if c.weights == "resident":
        f.buffer(resident_weights(i), i, b.param_bytes, None, None)
        return
    for user, nbytes in [(i, b.param_bytes)] + users_of(problem, i):
        _stream_weights(f, problem, st, i, user, nbytes, c.ahead)
    if not problem.sharded:  # sharded, the node's copy: _host_state
        f.pinned_bytes += b.param_bytes


def _gradients(f: Fragment, problem: Problem, st: Stages, i: int, c: Choice,
               training: Training, bwd: tuple) -> None:
    """Block i's gradients, their exchange over ranks and its optimizer step."""
    b = problem.blocks[i]
    users = users_of(problem, i)
    first_bwd_user = max([i] + [j for j, _ in users])
    grad = f"grad.{i}"
    # the gradient of a weight later blocks share, added up as it arrives from each (see
    # [Note: a shared weight's gradients meet in autograd's input buffer])
    for j, nbytes in [(j, nbytes) for j, nbytes in users if j != first_bwd_user]:
        f.buffer(f"gradacc.{i}.{j}", i, 2 * nbytes, ("backward", j), ("backward", j))
    shared_bytes = min(b.param_bytes, sum(nbytes for _, nbytes in users))
    f.buffer(f"gradacc.{i}", i, 2 * shared_bytes, bwd, bwd)
    # gradients accumulated on the host are all-reduced there (see [Note: accumulation])
    reduce_on_host = problem.world_size > 1 and c.optim == "host" and training.accumulate > 1
    sharded = problem.sharded and c.optim == "host"
    # sharded: each rank keeps its shard of the gradients, unless clipping needs them whole
    exchange = ("reduce_scatter", b.reduce_scatter_s) if sharded and not training.clip \
        else ("allreduce", b.allreduce_s)
    if problem.world_size > 1 and not reduce_on_host:
        # the gradients travel as one flat buffer: one collective per block, not per tensor
        ar = f.op((exchange[0], i), exchange[0], i, st.allreduce(i), "net", exchange[1],
                  b.param_bytes, uses=(grad,))
        f.buffer(f"artmp.{i}", i, b.param_bytes, ar, ar)
    if c.optim == "device":
        _device_step(f, problem, st, i, training, bwd, first_bwd_user, shared_bytes)
    else:
        _host_step(f, problem, st, i, c, training, first_bwd_user, exchange, reduce_on_host,
                   sharded)


def _device_step(f: Fragment, problem: Problem, st: Stages, i: int, training: Training,
                 bwd: tuple, first_bwd_user: int, shared_bytes: int) -> None:
    """Block i stepped on the device, after its all-reduce on several ranks, with clipping
    in the update stage."""
    b, grad = problem.blocks[i], f"grad.{i}"
    step_stage = st.to_host(i) if problem.world_size > 1 else st.bwd(i)
    step = f.op(("device_step", i), "device_step", i,
                st.update if training.clip else step_stage, "compute",
                b.device_step_s, uses=(grad, resident_weights(i), f"opt.{i}"))
    f.buffer(f"steptmp.{i}", i, b.step_temp_bytes, step, step)
    f.buffer(f"opt.{i}", i, b.optim_bytes, None, None)
    if training.accumulate > 1:  # summed over the micro-batches of a step
        f.buffer(grad, i, b.param_bytes, None, None)
        # once .grad exists, autograd makes each new gradient beside it and adds it in:
        # a second copy of the weights no later block shares, during the block's
        # backward; the shared ones' sum waits beside .grad from their first gradient on
        f.buffer(f"gradnew.{i}", i, b.param_bytes - shared_bytes, bwd, bwd)
        f.buffer(f"gradwait.{i}", i, shared_bytes, ("backward", first_bwd_user), bwd)
    else:
        f.buffer(grad, i, b.param_bytes, ("backward", first_bwd_user), step)


def _host_step(f: Fragment, problem: Problem, st: Stages, i: int, c: Choice,
               training: Training, first_bwd_user: int, exchange: tuple[str, float],
               reduce_on_host: bool, sharded: bool) -> None:
    """Block i's gradients copied to the host (all-reduced there when they add up over
    micro-batches), stepped there, gathered (sharded) and uploaded if resident."""
    b, grad = problem.blocks[i], f"grad.{i}"
    # sharded, a rank copies only its shard of the averaged gradients (all of them when
    # they add up on the host over micro-batches, before the exchange)
    to_host_bytes = b.param_bytes if reduce_on_host or not sharded \
        else shard_bytes(b.param_bytes, problem.world_size)
    to_host = f.op(("grads_to_host", i), "grads_to_host", i,
                   st.allreduce(i) if reduce_on_host else st.to_host(i), "d2h",
                   problem.d2h_s(to_host_bytes), to_host_bytes, uses=(grad,))
    f.buffer(grad, i, b.param_bytes, ("backward", first_bwd_user), to_host)
    # the step starts once its gradients are on the host, beside the backward of the block
    # before it (in the stage the ILP counts it in), not after that backward; summed over
    # micro-batches and all-reduced there, after the stage of that all-reduce
    after: tuple[tuple, ...] = (to_host,)
    if reduce_on_host:
        # counted on the device too: a collective on device memory stages through it
        ar = f.op((exchange[0], i), exchange[0], i, st.to_host(i), "net", exchange[1],
                  b.param_bytes, after=(to_host,))
        f.buffer(f"artmp.{i}", i, b.param_bytes, ar, ar)
        after = (("stage_end", st.to_host(i)), ar)
    if training.clip:  # after every gradient of the step (see [Note: clipping])
        after = (("stage_end", st.update - 1), *after)
    step_stage = st.update if training.clip else st.to_host(i)
    step = f.op(("host_step", i), "host_step", i, step_stage, "host",
                b.host_step_s / problem.world_size if sharded else b.host_step_s,
                after=after)
    if problem.host_temps_on_device:  # see memory.host_temp_bytes
        f.buffer(f"{HOST_TEMP_PREFIX}{i}", i, b.step_temp_bytes, step, step)
    updated = step
    if sharded:
        updated = f.op(("all_gather", i), "all_gather", i, step_stage, "net",
                       b.all_gather_s, b.param_bytes, after=(step,))
    if c.weights == "resident":
        f.op(("upload", i), "upload", i, st.update, "h2d", problem.h2d_s(b.param_bytes),
             b.param_bytes, uses=(resident_weights(i),), after=(updated,))
    add_host_state(f, problem, b, sharded, reduce_on_host)


def _stream_weights(f: Fragment, problem: Problem, st: Stages, owner: int, user: int,
                    nbytes: int, ahead: int) -> None:
    """Fetch `owner`'s weights for `user`'s forward, and again for its backward, `ahead`
    stages before each (the prologue at the earliest, the last block's backward at the
    latest)."""
    n = len(problem.blocks)
    # a fetch lists the buffer it fills in `uses`: the runtime reads the owner from its name
    fwd_buf, bwd_buf = (WeightBuffer(owner, phase, user).name for phase in FETCH_PHASES)
    fetch_f = f.op(("fetch", owner, user, "fwd"), "fetch", user, max(0, st.fwd(user) - ahead),
                   "h2d", problem.h2d_s(nbytes), nbytes, uses=(fwd_buf,))
    if user == n - 1:  # the last block's backward follows at once: keep the forward copy
        f.buffer(fwd_buf, owner, nbytes, fetch_f, ("backward", user))
        return
    f.buffer(fwd_buf, owner, nbytes, fetch_f, ("forward", user))
    fetch_b = f.op(("fetch", owner, user, "bwd"), "fetch", user,
                   st.bwd(min(user + ahead, n - 1)), "h2d", problem.h2d_s(nbytes), nbytes,
                   uses=(bwd_buf,))
    f.buffer(bwd_buf, owner, nbytes, fetch_b, ("backward", user))


def common_fragment(problem: Problem) -> Fragment:
    """What every plan has: the batch, the loss, the tensors flowing between blocks, and the
    process's own memory where it was measured (Problem.process_bytes)."""
    n = len(problem.blocks)
    st = Stages(n, problem.world_size)
    f = Fragment()
    loss = f.op(("loss", n - 1), "loss", n - 1, st.fwd(n - 1), "compute", problem.loss_s)
    f.buffer("inputs", 0, problem.input_bytes, None, None)
    if problem.process_bytes:
        f.buffer(PROCESS_BUFFER, 0, problem.process_bytes, None, None)
    f.buffer("loss", n - 1, problem.loss_act_bytes, loss, ("backward", n - 1))
    for i, b in enumerate(problem.blocks):
        last_use = ("forward", i + 1) if i + 1 < n else ("backward", i)
        f.buffer(f"out.{i}", i, b.out_bytes, ("forward", i), last_use)
    return f


# --- assembly -------------------------------------------------------------------------

_RANK = {"fetch": 0, "swap_in": 1, "upload": 2, "swap_out": 0, "grads_to_host": 1,
         "forward": 0, "loss": 1, "recompute": 0, "backward": 1, "device_step": 2,
         "allreduce": 0, "reduce_scatter": 0, "host_step": 0, "all_gather": 1}
_UPDATE_RANK = {"host_step": 0, "all_gather": 1, "upload": 2}  # a block's, with clipping


def assemble(problem: Problem, choices: list[Choice], training: Training = PLAIN
             ) -> tuple[tuple[Op, ...], tuple[Buffer, ...]]:
    """The schedule's ops (in issue order, with dependencies and uses) and buffers."""
    if not pairs_agree(choices):
        raise ValueError("a block recomputes with the next one only where the next one "
                         f"recomputes with it: {choices}")
    frags = [common_fragment(problem)] + [fragment(problem, i, c, training)
                                          for i, c in enumerate(choices)]
    update = Stages(len(problem.blocks), problem.world_size).update

    def order(o: ProtoOp) -> tuple:
        if training.clip and o.stage == update:
            # device steps, then each block's host step and upload, from block 0 up
            return (o.stage, o.stream != "compute", o.block, _UPDATE_RANK.get(o.kind, 0), o.key)
        # Host steps and uploads go from the last block to the first, as the gradients arrive.
        # a block's all-gather follows its host step, which is on the last stream
        stream = len(STREAMS) if o.kind == "all_gather" else STREAMS.index(o.stream)
        return (o.stage, stream, _RANK[o.kind],
                -o.block if o.kind == "upload" else o.block, o.key)

    protos = sorted((o for fr in frags for o in fr.ops), key=order)
    id_of = {o.key: k for k, o in enumerate(protos)}
    ends = _stage_ends(protos)
    uses_of = _weight_uses(problem, choices)
    ops = []
    for k, o in enumerate(protos):
        # [Note: stage barrier] an op on a barrier stream waits for the end of the stage
        # before its own; a host step only for its gradients on the host (lowering's
        # _host_step: their copy, or the stage of their all-reduce there).
        deps = set(ends(o.stage - 1)) if o.stream != "host" else set()
        for key in o.after:
            deps.update(ends(key[1]) if key[0] == "stage_end" else (id_of[key],))
        ops.append(Op(k, o.kind, o.block, o.stage, o.stream, o.dur_s, o.bytes,
                      tuple(sorted(deps)), o.uses + uses_of.get(o.key, ())))
    buffers = sorted(
        (Buffer(pb.name, pb.block, pb.bytes,
                id_of[pb.alloc] if pb.alloc is not None else None,
                id_of[pb.free] if pb.free is not None else None)
         for fr in frags for pb in fr.buffers),
        key=lambda b: (b.alloc is not None, b.alloc or 0, b.name),
    )
    return tuple(ops), tuple(buffers)


def _stage_ends(protos: list[ProtoOp]):
    """ends(s): the last op on each barrier stream among the ops of stages <= s."""
    snapshots: list[tuple[int, tuple[int, ...]]] = []  # (stage, last ops), stages ascending
    last_on: dict[str, int] = {}
    for k, o in enumerate(protos):
        if is_barrier(o.stream, o.kind):
            last_on[o.stream] = k
        snapshot = tuple(sorted(last_on.values()))
        if snapshots and snapshots[-1][0] == o.stage:
            snapshots[-1] = (o.stage, snapshot)
        else:
            snapshots.append((o.stage, snapshot))
    stages = [s for s, _ in snapshots]

    def ends(stage: int) -> tuple[int, ...]:
        pos = bisect.bisect_right(stages, stage) - 1
        return snapshots[pos][1] if pos >= 0 else ()

    return ends


def _weight_uses(problem: Problem, choices: list[Choice]) -> dict[tuple, tuple[str, ...]]:
    """Weight buffers each forward, recompute and backward reads, owners' choices applied."""
    n = len(choices)
    uses: dict[tuple, tuple[str, ...]] = {}
    for j, b in enumerate(problem.blocks):
        owners = [j] + [o for o, _ in b.shared_from]
        fwd = tuple(weight_buffer(o, choices[o], "fwd", j, n) for o in owners)
        bwd = tuple(weight_buffer(o, choices[o], "bwd", j, n) for o in owners)
        uses[("forward", j)] = fwd
        kept = (kept_buffer(j, choices[j].kept),) if choices[j].act == "selective" else ()
        # the next block of a pair recomputes from what the previous block's recompute makes
        inputs = f"act.{j - 1}@re" if choices[j].with_prev else f"ckpt.{j}"
        uses[("recompute", j)] = (inputs,) + kept + bwd
        uses[("backward", j)] = (_act_buffer(j, choices[j]),) + kept + bwd
    return uses


def _act_buffer(i: int, c: Choice) -> str:
    return {"keep": f"act.{i}", "swap": f"act.{i}@in", "recompute": f"act.{i}@re",
            "selective": f"act.{i}@re"}[c.act]
