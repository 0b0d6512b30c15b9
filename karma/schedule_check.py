"""Semantic validation: a schedule is checked against every invariant the runtime relies on.

Schedules are read, diffed and edited by hand, so the runtime must not trust them.
`load_schedule` checks each field's type and that every id names something (an op's deps
name earlier ops); `validate` then checks that the whole still describes one training step
the runtime can replay, and that it computes what the plan computes. It runs at
the end of every `load_schedule` (karma-run, karma-inspect, karma.Runtime), before any model
is built; `karma-inspect --check` runs just this. A violation is one ScheduleFileError that
names the op or block, the rule, and the fix. The rules, in the order they are checked:

- parameters named once: each parameter is owned by one block; a block's shared_params are
  owned by an earlier block.
- decisions: streamed weights are stepped on the host; only a selective block has a policy
  and keeps outputs on the host, and only one of a single module that is not the last.
- streams: each op kind runs on its stream (schedule.py's module docstring).
- ops match decisions: a block's ops are those of its act, weights and optim (a keep block
  is never swapped, a selective one only with kept: host, a streamed block has its
  fetches, a host-stepped one its grads_to_host and host_step), on several ranks its
  all-reduce; with sharded host state a host-stepped block's reduce-scatter (its all-reduce
  with clipping) and all-gather.
- stages ordered: stages never decrease along the op list (the runtime issues side ops in
  list order as compute reaches their stage).
- compute order: the compute ops follow the model's own execution.
- dependencies: an op that needs another's result waits for it (see [Note: happens-before]
  in schedule_replay.py); a selective block's kept outputs leave in a later stage than its
  forward (the swap-out takes what the forward kept when it is issued).
- buffer lifetime: a buffer is allocated before every use, used before it is freed, and an
  allocated buffer is freed once in the replay; with clipping, fetched weights are not
  freed by an op that may run on into the next step (see _deferred_weight_frees).
- peak within capacity: the buffers live in any stage add up to at most
  config.capacity_bytes (see [Note: the peak walked over stages] in schedule_replay.py).

Once the model is built, `check_model_names` checks what needs it: every parameter and
module a block names exists in the model, each parameter of the model is owned by exactly one
block (a tied parameter under one of its names), and each block's param_bytes are the bytes
of its parameters (the model file built the model that was planned).

This module imports neither the planner nor the IR: the runtime imports it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Mapping

from karma.schedule import (
    DEFERRED_KINDS,
    FETCH_PHASES,
    GRAD_KINDS,
    OP_KINDS,
    OPTIMIZER_STEP_KINDS,
    RECOMPUTE_ACTS,
    STREAM_OF_KIND,
    BlockEntry,
    Op,
    Schedule,
    ScheduleFileError,
    WeightBuffer,
)
from karma.schedule_replay import HappensBefore, walk_peak_bytes
from karma.selective_policy import SELECTIVE_POLICY, parse_policy
from karma.units import format_bytes

_REPLAN = "re-plan with karma-plan"
_FIX = f"or {_REPLAN}"


class _Broken(Exception):
    """One rule broken: the message names the op or block, then the rule and the fix."""


def validate(schedule: Schedule, source: str = "schedule") -> None:
    """Raise ScheduleFileError("SOURCE: ...") naming the op or block and the rule broken, if
    any rule of this module's docstring is; return None for a schedule the runtime can run."""
    try:
        _Checker(schedule).run()
    except _Broken as e:
        raise ScheduleFileError(f"{source}: {e}") from None


def check_model_names(schedule: Schedule, params: Mapping[str, object],
                      modules: Collection[str], source: str = "the schedule") -> None:
    """Once the model is built (the rules that need it): every parameter and module a block
    names exists in the model, each of the model's parameters is owned by one block, and
    each block's param_bytes are its parameters' bytes (the model is the one planned).
    `params`: the model's parameters (tensors) by name, tied ones under each name
    (dict(named_parameters(remove_duplicate=False))); `modules`: its module names."""
    rule = "(rule: parameters named once: each parameter and module a block names exists " \
           "in the model, and each parameter of the model is owned by one block)"
    fix = "re-plan with karma-plan for this model"
    for b in schedule.blocks:
        for key, names, known in (("params", b.params, params),
                                  ("shared_params", b.shared_params, params),
                                  ("modules", b.modules, modules)):
            for name in names:
                if name not in known:
                    raise ScheduleFileError(f"{source}: blocks[{b.index}].{key}: {name!r} is "
                                            f"not in the model {rule}; {fix}")
    owner: dict[int, tuple[int, str]] = {}  # id(parameter) -> (block, the name it owns it by)
    for b in schedule.blocks:
        for name in b.params:
            tensor = id(params[name])
            if tensor in owner:  # tied: two names of one tensor
                block, first = owner[tensor]
                raise ScheduleFileError(
                    f"{source}: blocks[{b.index}].params: {name!r} is the parameter "
                    f"{first!r} of block {block} under another name (tied) {rule}; remove it, "
                    f"or {fix}")
            owner[tensor] = (b.index, name)
    for name, tensor in params.items():
        if id(tensor) not in owner:
            raise ScheduleFileError(f"{source}: the model's parameter {name!r} is owned by no "
                                    f"block: no block lists it in its params {rule}; {fix}")
    for b in schedule.blocks:
        nbytes = sum(params[name].nbytes for name in b.params)
        if nbytes != b.param_bytes:
            raise ScheduleFileError(
                f"{source}: blocks[{b.index}].param_bytes: {b.param_bytes} ("
                f"{format_bytes(b.param_bytes)}), but its parameters in the model take {nbytes} "
                f"({format_bytes(nbytes)}) (rule: the model as planned: each block's param_bytes "
                "are the bytes of its parameters in the model built); the model file built "
                "another model than the one planned (another model.env?): " + fix)


class _Checker:
    """The rules, one method each; `run` checks them in the docstring's order."""

    def __init__(self, s: Schedule):
        self.s = s
        self.n = len(s.blocks)
        self.ops_of: dict[tuple[str, int], list[Op]] = defaultdict(list)  # (kind, block)
        for op in s.ops:
            self.ops_of[op.kind, op.block].append(op)
        self.buffer = {b.name: b for b in s.buffers}
        self.owner = {name: b.index for b in s.blocks for name in b.params}

    def run(self) -> None:
        self.parameters()
        self.decisions()
        self.streams()
        self.ops_match_decisions()
        self.stages()
        self.compute_order()
        self.order = HappensBefore.of(self.s)
        self.dependencies()
        self.buffers()
        self.peak()

    # --- naming ------------------------------------------------------------------------

    def block(self, i: int) -> str:
        return f"block {i} ({self.s.blocks[i].name})"

    def op(self, op: Op | int) -> str:
        op = self.s.ops[op] if isinstance(op, int) else op
        return f"op {op.id} ({op.kind} of {self.block(op.block)})"

    def one(self, kind: str, i: int) -> Op | None:
        found = self.ops_of.get((kind, i))
        return found[0] if found else None

    # --- the rules -----------------------------------------------------------------------

    def parameters(self) -> None:
        rule = "(rule: parameters named once: each parameter is owned by one block, and a " \
               "block's shared_params are owned by an earlier block)"
        owner: dict[str, int] = {}
        for b in self.s.blocks:
            for name in b.params:
                if name in owner:
                    raise _Broken(f"blocks[{b.index}].params: {name!r} is also a parameter of "
                                  f"{self.block(owner[name])} {rule}; list it once, {_FIX}")
                owner[name] = b.index
        for b in self.s.blocks:
            for k, name in enumerate(b.shared_params):
                where = f"blocks[{b.index}].shared_params: {name!r}"
                if name in b.shared_params[:k]:
                    raise _Broken(f"{where} is listed twice {rule}; list it once, {_FIX}")
                if owner.get(name, self.n) >= b.index:
                    who = ("is owned by no block" if name not in owner else
                           f"is owned by {self.block(owner[name])}, not an earlier block")
                    raise _Broken(f"{where} {who} {rule}; remove it, {_FIX}")

    def decisions(self) -> None:
        for b in self.s.blocks:
            if b.weights == "streamed" and b.optim != "host":
                raise _Broken(f"{self.block(b.index)} has weights: streamed and optim: "
                              f"{b.optim} (rule: decisions: streamed weights are stepped on "
                              f"the host, where they live); set blocks[{b.index}].optim to "
                              f"host, {_FIX}")
            if b.policy:
                try:
                    parse_policy(b.policy)
                except ValueError as e:
                    raise _Broken(f"{self.block(b.index)}: {e}; {_FIX}") from None
            if b.kept != "device" and b.act != "selective":
                raise _Broken(f"{self.block(b.index)} has act: {b.act} and kept: {b.kept} "
                              "(rule: decisions: only a selective block keeps outputs, on the "
                              f"device or the host); remove its kept, {_FIX}")
            if b.kept == "host" and b.index == self.n - 1:
                raise _Broken(f"{self.block(b.index)} has kept: host and is the last block "
                              "(rule: decisions: its backward follows its forward at once, so "
                              "what it keeps has no stage to wait on the host in); set its "
                              f"kept to device, {_FIX}")
            if b.kept == "host" and len(b.modules) != 1:
                raise _Broken(f"{self.block(b.index)} has kept: host and {len(b.modules)} "
                              "modules (rule: decisions: what a block of several module calls "
                              "keeps stays on the device, where the checkpoint of each call "
                              f"holds what the one before kept); set its kept to device, {_FIX}")
            if b.with_next:
                self._pair(b)
            if bool(b.policy) != (b.act == "selective"):
                fix = (f"add policy: {SELECTIVE_POLICY}" if b.act == "selective"
                       else "remove its policy")
                raise _Broken(f"{self.block(b.index)} has act: {b.act} and policy: "
                              f"{b.policy or 'none'} (rule: decisions: a block has a policy "
                              f"if and only if its act is selective); {fix}, {_FIX}")

    def streams(self) -> None:
        for op in self.s.ops:
            want = STREAM_OF_KIND[op.kind]
            if op.stream != want:
                raise _Broken(f"{self.op(op)} is on stream {op.stream} (rule: streams: a "
                              f"{op.kind} runs on {want}); set ops[{op.id}].stream to "
                              f"{want}, {_FIX}")

    def ops_match_decisions(self) -> None:
        # ops a decision does not call for first, in list order: each names the op to drop
        seen: dict[tuple[str, int], int] = defaultdict(int)
        for op in self.s.ops:
            if op.kind == "fetch":
                continue
            seen[op.kind, op.block] += 1
            count, why = self._wanted(op.kind, self.s.blocks[op.block])
            if seen[op.kind, op.block] > count:
                raise _Broken(f"{self.op(op)} is one {op.kind} too many for "
                              f"{self.block(op.block)} (rule: ops match decisions: {why}); "
                              f"make the ops and the decision agree, {_FIX}")
        for b in self.s.blocks:
            for kind in OP_KINDS:
                if kind == "fetch":
                    continue
                count, why = self._wanted(kind, b)
                if seen[kind, b.index] < count:
                    raise _Broken(f"{self.block(b.index)} has no {kind} op (rule: ops match "
                                  f"decisions: {why}); make the ops and the decision agree, "
                                  f"{_FIX}")
            self._fetches(b)

    def _wanted(self, kind: str, b: BlockEntry) -> tuple[int, str]:
        """How many ops of `kind` block b has, and why, naming the decision it follows."""
        i, key = b.index, f"blocks[{b.index}]"
        if kind in ("forward", "backward"):
            return 1, f"every block has one {kind}"
        if kind == "loss":
            return int(i == self.n - 1), "one loss, after the last block's forward"
        if kind == "recompute":
            return int(b.act in RECOMPUTE_ACTS), (
                f"{key}.act is {b.act}, and a block recomputes once if its act is recompute "
                "or selective, never otherwise")
        if kind in ("swap_out", "swap_in"):
            if b.act == "selective":
                return int(b.kept == "host"), (
                    f"{key}.kept is {b.kept}, and a selective block's kept outputs are "
                    "swapped out and in once if they are kept on the host, never otherwise")
            return int(b.act == "swap"), (
                f"{key}.act is {b.act}, and a block is swapped out and in once if its act is "
                "swap or it is selective with kept: host, never otherwise")
        if kind == "device_step":
            return int(b.optim == "device"), (
                f"{key}.optim is {b.optim}, and a block is stepped on the device once if its "
                "optim is device, never otherwise")
        if kind in ("grads_to_host", "host_step"):
            return int(b.optim == "host"), (
                f"{key}.optim is {b.optim}, and a block's gradients go to the host and are "
                "stepped there once if its optim is host, never otherwise")
        if kind == "upload":
            return int(b.optim == "host" and b.weights == "resident"), (
                f"{key} has weights: {b.weights} and optim: {b.optim}, and a host-stepped "
                "block's weights are uploaded once if they are resident; streamed ones are "
                "fetched instead, device-stepped ones never leave")
        cfg = self.s.config
        sharded = cfg.sharded and b.optim == "host"
        if kind == "all_gather":
            return int(sharded), (
                f"config.host_state is {cfg.host_state} and {key}.optim is {b.optim}, and on "
                "several ranks a host-stepped block's shards are gathered once if the host "
                "state is sharded, never otherwise")
        scatter = sharded and cfg.clip_grad_norm is None
        if kind == "reduce_scatter":
            return int(scatter), (
                "on several ranks a host-stepped block's gradients are reduce-scattered once "
                "if the host state is sharded and there is no clipping (whose norms need "
                "each gradient whole), never otherwise")
        return int(cfg.world_size > 1 and not scatter), (
            f"config.world_size is {cfg.world_size}, and each block's gradients are all-reduced "
            "once on several ranks (reduce-scattered instead where the host state is sharded, "
            "without clipping), never on one")

    def _fetches(self, b: BlockEntry) -> None:
        """The fetches of block b (as their user): one per streamed owner of the weights it
        reads, for its forward and again for its backward (the last block's forward copy
        lasts through its backward)."""
        u = b.index
        owners = [u] + sorted({self.owner[n] for n in b.shared_params})
        phases = FETCH_PHASES[:1] if u == self.n - 1 else FETCH_PHASES
        wanted = {WeightBuffer(o, phase, u).name: o for o in owners for phase in phases}
        seen: set[str] = set()
        for op in self.ops_of.get(("fetch", u), []):
            name = op.uses[0] if op.uses else None
            if name not in wanted:
                raise _Broken(f"{self.op(op)} fills {name or 'nothing'} (rule: ops match "
                              f"decisions: a fetch names in uses[0] the weights it fills, "
                              f"w.OWNER@fUSER or w.OWNER@bUSER, of a block {self.block(u)} "
                              f"reads: {', '.join(wanted)}); {_REPLAN}")
            o = wanted[name]
            if self.s.blocks[o].weights != "streamed":
                raise _Broken(f"{self.op(op)} fetches the weights of {self.block(o)}, but "
                              f"blocks[{o}].weights is resident (rule: ops match decisions: "
                              f"only streamed weights are fetched); set blocks[{o}].weights "
                              f"to streamed or remove the op, {_FIX}")
            if name in seen:
                raise _Broken(f"{self.op(op)} fetches {name} a second time (rule: ops match "
                              f"decisions: streamed weights are fetched once for each use); "
                              f"remove one, {_FIX}")
            seen.add(name)
        for name, o in wanted.items():
            if self.s.blocks[o].weights == "streamed" and name not in seen:
                raise _Broken(f"{self.block(u)} has no fetch of {name} (rule: ops match "
                              f"decisions: blocks[{o}].weights is streamed, so its weights "
                              f"are fetched before each forward and backward that reads "
                              f"them); {_REPLAN}")

    def _pair(self, b: BlockEntry) -> None:
        """A block with with_next ([Note: a checkpoint over two blocks] in karma/schedule.py)."""
        where = f"{self.block(b.index)} has with_next: true"
        fix = f"set its with_next to false, {_FIX}"
        if b.index == self.n - 1:
            raise _Broken(f"{where} and is the last block (rule: decisions: a block recomputes "
                          f"with the next one); {fix}")
        nxt = self.s.blocks[b.index + 1]
        for block in (b, nxt):
            if block.act not in RECOMPUTE_ACTS or block.kept != "device":
                raise _Broken(f"{where}, and {self.block(block.index)} has act: {block.act}"
                              f"{', kept: host' if block.kept != 'device' else ''} (rule: "
                              "decisions: both blocks of a checkpoint over two recompute, "
                              f"what they keep on the device); {fix}")
            if len(block.modules) != 1:
                raise _Broken(f"{where}, and {self.block(block.index)} has "
                              f"{len(block.modules)} modules (rule: decisions: both blocks "
                              f"of a checkpoint over two are one module call each); {fix}")
        if b.weights != "resident":
            raise _Broken(f"{where} and weights: {b.weights} (rule: decisions: the first "
                          "block of a checkpoint over two recomputes in the next block's "
                          "backward, before its weights would be fetched); set its weights to "
                          f"resident or its with_next to false, {_FIX}")
        if nxt.with_next:
            raise _Broken(f"{where}, and so has {self.block(nxt.index)} (rule: decisions: a "
                          f"checkpoint covers two blocks at most); {fix}")

    def stages(self) -> None:
        for prev, op in zip(self.s.ops, self.s.ops[1:]):
            if op.stage < prev.stage:
                raise _Broken(f"{self.op(op)} is in stage {op.stage}, after op {prev.id} in "
                              f"stage {prev.stage} (rule: stages ordered: the op list is in "
                              f"issue order, so stages never decrease along it); restore "
                              f"its stage, {_FIX}")

    def compute_order(self) -> None:
        """Forwards from block 0 up, the loss, backwards from the last block down, each
        recompute just before its block's backward (a pair's two before the second block's:
        [Note: a checkpoint over two blocks]); device steps anywhere after their block's
        backward (checked with the dependencies)."""
        want = [("forward", i) for i in range(self.n)] + [("loss", self.n - 1)]
        blocks = self.s.blocks
        for i in reversed(range(self.n)):
            if i > 0 and blocks[i - 1].with_next:  # a pair's: the first block's first
                want.append(("recompute", i - 1))
            if blocks[i].act in RECOMPUTE_ACTS and not blocks[i].with_next:
                want.append(("recompute", i))
            want.append(("backward", i))
        ran = [op for op in self.s.ops if op.stream == "compute" and op.kind != "device_step"]
        for op, (kind, i) in zip(ran, want):  # as many as wanted: the counts are checked
            if (op.kind, op.block) != (kind, i):
                raise _Broken(f"{self.op(op)} runs where the model runs the {kind} of "
                              f"{self.block(i)} (rule: compute order: forwards from block 0 "
                              "up, the loss, then backwards from the last block down, each "
                              "recompute just before its block's backward, a pair's two "
                              "(with_next) before the second block's); put the compute "
                              f"ops in that order, {_FIX}")

    def dependencies(self) -> None:
        world, cfg = self.s.config.world_size, self.s.config
        for b in self.s.blocks:
            i = b.index
            fwd, bwd = self.one("forward", i), self.one("backward", i)
            out, into = self.one("swap_out", i), self.one("swap_in", i)
            to_host, step = self.one("grads_to_host", i), self.one("host_step", i)
            ar = self.one("allreduce", i) or self.one("reduce_scatter", i)
            dev, gather = self.one("device_step", i), self.one("all_gather", i)
            on_host = ar is not None and to_host is not None and ar.id > to_host.id
            pairs = [
                (fwd, out, "a block's activations are swapped out after its forward"),
                (out, into, "a block's activations are swapped in after they were swapped out"),
                (into, bwd, "a block's activations are swapped in before its backward"),
                (into, self.one("recompute", i), "what a selective block keeps is swapped in "
                                                 "before its recompute"),
                (bwd, to_host, "a block's gradients go to the host after its backward"),
                (bwd, ar, "a block's gradients are all-reduced after its backward"),
                (bwd, dev, "a block is stepped after its backward"),
                (ar, dev, "a block is stepped after its all-reduce"),
                (to_host, step, "a block is stepped on the host after its gradients arrive"),
                (step, self.one("upload", i), "weights are uploaded after the host step"),
                (step, gather, "the shards are gathered after the host step"),
                (gather, self.one("upload", i), "weights are uploaded after the all-gather"),
            ]
            if on_host:  # accumulated gradients are all-reduced on the host
                pairs += [(to_host, ar, "host gradients are all-reduced after they arrive"),
                          (ar, step, "a block is stepped after its all-reduce")]
            elif ar is not None:
                pairs.append((ar, to_host, "all-reduced gradients go to the host after the "
                                           "all-reduce"))
            pairs += self._fetch_pairs(i)
            for first, then, why in pairs:
                if first is not None and then is not None \
                        and not self.order.before(first.id, then.id):
                    raise _Broken(f"{self.op(then)} may start before {self.op(first)} ends: "
                                  f"no chain of deps orders them (rule: dependencies: {why}); "
                                  f"add {first.id} to ops[{then.id}].deps, {_FIX}")
            if b.kept == "host" and out is not None and out.stage <= fwd.stage:
                raise _Broken(f"{self.op(out)} is in stage {out.stage}, that of its block's "
                              "forward (rule: dependencies: what a selective block keeps is "
                              "swapped out in a later stage, once its forward has kept it); "
                              f"move it to stage {fwd.stage + 1}, {_FIX}")
            if cfg.accumulate > 1 and world > 1 and b.optim == "host" and ar is not None \
                    and to_host is not None and not on_host:
                raise _Broken(f"{self.op(ar)} comes before {self.op(to_host)} (rule: "
                              "dependencies: with accumulation on several ranks a host-stepped "
                              "block's gradients add up on the host and are all-reduced there, "
                              "after its grads_to_host); " + _REPLAN)
        if cfg.clip_grad_norm is not None:
            last = max((op for op in self.s.ops if op.kind in GRAD_KINDS), key=lambda o: o.id)
            early = [op for op in self.s.ops
                     if op.kind in OPTIMIZER_STEP_KINDS and op.id < last.id]
            if early:
                raise _Broken(f"{self.op(early[0])} comes before {self.op(last)}, which makes "
                              "a gradient final (rule: dependencies: with config."
                              "clip_grad_norm every optimizer step follows every gradient); "
                              + _REPLAN)

    def _fetch_pairs(self, u: int) -> list[tuple[Op | None, Op | None, str]]:
        """(fetch, reader) for the weights block u reads: each fetch before its readers."""
        pairs = []
        readers = {"fwd": [self.one("forward", u)],
                   "bwd": [self.one("recompute", u), self.one("backward", u)]}
        if u == self.n - 1:
            readers["fwd"] += readers["bwd"]
        for op in self.ops_of.get(("fetch", u), []):
            phase = WeightBuffer.parse(op.uses[0]).phase
            pairs += [(op, r, "streamed weights arrive before an op that reads them")
                      for r in readers[phase]]
        return pairs

    def buffers(self) -> None:
        rule = "(rule: buffer lifetime: a buffer is allocated before every use and freed " \
               "once, after its last use)"
        for k, b in enumerate(self.s.buffers):
            where = f"buffer {b.name} (buffers[{k}])"
            if b.alloc is not None and b.free is None:
                raise _Broken(f"{where} is allocated by {self.op(b.alloc)} and never freed: "
                              f"every replay would hold another copy {rule}; set its free, "
                              + _FIX)
            if b.alloc is not None and b.free is not None and b.alloc != b.free \
                    and not self.order.before(b.alloc, b.free):
                raise _Broken(f"{where} is freed by {self.op(b.free)}, which may end before "
                              f"{self.op(b.alloc)} allocates it {rule}; restore its alloc "
                              f"and free, {_FIX}")
        for op in self.s.ops:
            for name in op.uses:
                b = self.buffer.get(name)
                if b is None:
                    continue  # a zero-byte buffer is not listed
                if b.alloc is not None and b.alloc != op.id \
                        and not self.order.before(b.alloc, op.id):
                    raise _Broken(f"{self.op(op)} uses buffer {name}, which {self.op(b.alloc)} "
                                  f"allocates, and may start before it {rule}; restore the "
                                  f"buffer's alloc and the op's deps, {_FIX}")
                if b.free is not None and b.free != op.id \
                        and not self.order.before(op.id, b.free):
                    raise _Broken(f"{self.op(op)} uses buffer {name}, which "
                                  f"{self.op(b.free)} frees, and may run after it {rule}; "
                                  f"restore the buffer's free, {_FIX}")
        self._weight_buffers()
        self._deferred_weight_frees()

    def _deferred_weight_frees(self) -> None:
        """With clipping, host steps and uploads may run on into the next step
        ([Note: the training options' contract]). Fetched weights freed by one of them would
        still be held when the next step fetches the same weights, and a fetch finds
        weights it can reuse when it is issued: it would not fill them again, and the
        forward would read them from before their update: w.0@b freed by block 0's host step
        trains different weights in two runs out of three (tests/test_schedule_check.py)."""
        if self.s.config.clip_grad_norm is None:
            return
        for k, b in enumerate(self.s.buffers):
            if b.free is None or WeightBuffer.parse(b.name) is None \
                    or self.s.ops[b.free].kind not in DEFERRED_KINDS:
                continue
            readers = [op.id for op in self.s.ops
                       if op.stream == "compute" and b.name in op.uses]
            fix = f"set its free to {readers[-1]}, {_FIX}" if readers else _REPLAN
            raise _Broken(f"buffer {b.name} (buffers[{k}]) is freed by {self.op(b.free)}, which "
                          "may run on into the next step (rule: buffer lifetime: with "
                          "config.clip_grad_norm fetched weights are freed by the op that reads "
                          "them last, never by a host_step or an upload: the next step's "
                          "fetch would find them still held and use them without their "
                          f"update); {fix}")

    def _weight_buffers(self) -> None:
        """Fetched weights: the runtime releases them when the buffer's free op ends, so
        that op must come after every op that reads them, whatever their `uses` say."""
        rule = "(rule: buffer lifetime: fetched weights are released after the last op " \
               "that reads them)"
        for u in range(self.n):
            for fetch, reader, _ in self._fetch_pairs(u):
                name = fetch.uses[0]
                b = self.buffer.get(name)
                if b is None:
                    owner = WeightBuffer.parse(name).owner
                    if self.s.blocks[owner].param_bytes > 0:
                        raise _Broken(f"{self.op(fetch)} fills buffer {name}, which is not "
                                      f"listed in buffers {rule}; " + _REPLAN)
                    continue
                if b.alloc != fetch.id:
                    raise _Broken(f"buffer {name} is allocated by "
                                  f"{'no op' if b.alloc is None else self.op(b.alloc)}, not "
                                  f"by {self.op(fetch)}, which fills it {rule}; set its "
                                  f"alloc to {fetch.id}, {_FIX}")
                if reader is not None and b.free != reader.id \
                        and not self.order.before(reader.id, b.free):
                    raise _Broken(f"buffer {name} is freed by {self.op(b.free)}, but "
                                  f"{self.op(reader)} reads it and may run after {rule}; "
                                  f"set its free to {reader.id}, {_FIX}")

    def peak(self) -> None:
        capacity = self.s.config.capacity_bytes
        peak, stage = walk_peak_bytes(self.s)
        if peak > capacity:
            raise _Broken(f"the buffers live in stage {stage} add up to {peak} bytes "
                          f"({format_bytes(peak)}), over config.capacity_bytes {capacity} "
                          f"({format_bytes(capacity)}) (rule: peak within capacity: each "
                          "buffer counted from its alloc op's stage through its free op's); "
                          "re-plan with karma-plan for this budget")
