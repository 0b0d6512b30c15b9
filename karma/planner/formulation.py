"""The ILP's formulation: variables over a plan's fragments, one function per constraint family.

One binary per (block, choice) picks each block's fragment (karma/planner/lowering.py); the
constraints sum those fragments stage by stage exactly as the simulator runs them, so the
optimum's objective is the simulated step time of the schedule it lowers to (on independent
streams; see [Note: contention in the ILP] for shared cores). `formulate` declares the
variables (`Formulation`, one comment per symbol with its unit), adds every family of
CONSTRAINTS in order, then the objective; ilp.py solves it and reads the plan back.

[Note: contention in the ILP] Where streams share cores (Problem.contention, the CPU), a
stage's compute (W s of work) and a copy (D s) that start together at its barrier slow each
other down (simulate.py's [Note: processor sharing]): compute at 1 - a of its speed while
the copy runs, the copy at 1 - b while compute does. If the copy ends first, after D / (1 - b),
the stage lasts W + a D / (1 - b); if compute does, D + b W / (1 - a). When a + b <= 1 (no
worse than running them one after the other) the stage lasts the larger of the two, so both
are linear constraints beside "as long as its busiest stream". h2d and d2h copies start
together and compute loses a while either runs, so each copy stream has its pair; and as the
simulator's streams conserve work ([Note: every stream on shared cores conserves work]), a
stage lasts at least the sum of its compute and copies. Host steps are not charged here
(when they run against which stage is not a stage sum): the simulator charges them when the
passes after the solve compare the ILP's plan with the baselines (passes.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import pulp

from karma.planner import lowering
from karma.planner.fragment import Fragment, ProtoBuffer
from karma.planner.lowering import Choice, Stages, Training
from karma.planner.memory import buffer_spans, host_temp_bytes, host_temp_first_stage
from karma.planner.pairs import can_pair
from karma.planner.problem import Problem
from karma.schedule import LAST_MICRO_BATCH_KINDS, is_barrier

GIB = float(1 << 30)  # memory in GiB and time in seconds: numbers near 1 for the solver


class Limits(NamedTuple):
    """Memory limits the ILP plans under, in bytes: a rank's device, its node's host."""

    device_bytes: int
    host_bytes: int  # the node's
    pinned_bytes: int  # the node's


# (stage, stream) -> (seconds, the (block, choice) whose fragment has it or None, op kind)
Load = dict[tuple[int, str], list[tuple[float, tuple[int, Choice] | None, str]]]


@dataclass
class Formulation:
    """The ILP of one planning question: its inputs, variables and constraints so far."""

    problem: Problem
    limits: Limits
    training: Training
    minimize_capacity: bool  # the least device memory instead of the least time
    st: Stages
    options: dict[int, list[Choice]]  # the choices each block may take
    frags: dict[tuple[int, Choice], Fragment]  # the fragment of each (block, choice)
    common: Fragment  # what every plan has (the batch, the loss, ...)
    lp: pulp.LpProblem
    # x[i, c] = 1 when block i takes choice c                                       (binary)
    x: dict[tuple[int, Choice], pulp.LpVariable]
    # t[k]: duration of stage k, as long as its busiest barrier stream                 (s)
    t: list[pulp.LpVariable]
    # t1[k]: the same in a micro-batch that does not step (accumulate > 1 only)         (s)
    t1: list[pulp.LpVariable]
    # s[k]: start of stage k; s[update] is when the last barrier stage ends            (s)
    s: list[pulp.LpVariable]
    # h[i]: when block i's host step ends; u[i]: when its upload ends                  (s)
    h: dict[int, pulp.LpVariable]
    u: dict[int, pulp.LpVariable]
    # m[k]: device memory live in stage k                                            (GiB)
    m: list[pulp.LpVariable]
    # host_temp[k]: host step temporaries counted in stage k (0 where a plan has none) (GiB)
    host_temp: list[pulp.LpVariable]
    # replay: the end of the replay that steps; accumulate - 1 others add their stages (s)
    replay: pulp.LpVariable
    # cap: the device memory budget, a variable only when minimising it              (GiB)
    cap: pulp.LpVariable | float
    load: Load  # the barrier streams' work, by stage and stream

    @property
    def micro(self) -> bool:
        return self.training.accumulate > 1

    @property
    def host_order(self) -> list[int]:
        """The order the host steps and uploads run in: from the last block to the first, or
        with clipping (all after the last gradient) from the first (see [Note: clipping])."""
        n = len(self.problem.blocks)
        return list(range(n)) if self.training.clip else list(reversed(range(n)))

    @property
    def step(self) -> pulp.LpAffineExpression:
        """One optimizer step: the replay that steps and accumulate - 1 that do not (they
        end with their stages)."""
        if not self.micro:
            return self.replay
        return self.replay + (self.training.accumulate - 1) * pulp.lpSum(self.t1)

    def chosen(self, value: Callable[[Fragment], float]) -> pulp.LpAffineExpression:
        """Sum over blocks and choices of x[i, c] * value(fragment of (i, c))."""
        return pulp.lpSum(v * self.x[key] for key, f in self.frags.items()
                          if (v := value(f)) != 0)

    def of_kind(self, i: int, kind: str) -> pulp.LpAffineExpression:
        """Seconds of block i's ops of `kind`, by its choice."""
        return pulp.lpSum(o.dur_s * self.x[i, c] for c in self.options[i]
                          for o in self.frags[i, c].ops if o.kind == kind)

    def work(self, k: int, stream: str, stepping: bool) -> pulp.LpAffineExpression:
        """Seconds of work on `stream` in stage k (stepping: in the replay that steps)."""
        return pulp.lpSum(d if key is None else d * self.x[key]
                          for d, key, kind in self.load.get((k, stream), [])
                          if stepping or kind not in LAST_MICRO_BATCH_KINDS)

    def durations(self) -> list[tuple[list[pulp.LpVariable], bool, str]]:
        """(stage durations, whether their replay steps, a name) of each kind of replay."""
        kinds = [(self.t, True, "stage")]
        return kinds + [(self.t1, False, "micro_stage")] if self.micro else kinds


def formulate(problem: Problem, limits: Limits, training: Training,
              minimize_capacity: bool = False) -> Formulation:
    """The fastest plan within `limits`, or with minimize_capacity the plan that needs the
    least device memory (limits.device_bytes is then ignored), as an ILP.

    The time is one optimizer step as simulate() predicts it: accumulate-1 micro-batches
    that do not step (their stages t1, without the ops of LAST_MICRO_BATCH_KINDS) and one
    that does.
    """
    n = len(problem.blocks)
    st = Stages(n, problem.world_size)
    # copies one stage ahead here; a pass after the solve considers two (prefetch.py)
    options = {i: [c for c in lowering.valid_choices(problem, i) if c.ahead == 1] for i in range(n)}
    frags = {(i, c): ilp_fragment(problem, i, c, training)
             for i in range(n) for c in options[i]}
    micro = training.accumulate > 1
    lp = pulp.LpProblem("karma_plan", pulp.LpMinimize)

    def variables(name: str, count: int) -> list[pulp.LpVariable]:
        return [lp.add_variable(f"{name}_{k}", lowBound=0) for k in range(count)]

    common = lowering.common_fragment(problem)
    f = Formulation(
        problem, limits, training, minimize_capacity, st, options, frags, common, lp,
        x={(i, c): lp.add_variable(f"x_{i}_{_tag(c)}", cat="Binary")
           for i in range(n) for c in options[i]},
        t=variables("t", st.update),
        t1=variables("t1", st.update) if micro else [],
        s=variables("s", st.update + 1),
        h=dict(enumerate(variables("h", n))),
        u=dict(enumerate(variables("u", n))),
        m=variables("m", st.count),
        host_temp=variables("host_temp", st.count),
        replay=lp.add_variable("replay_s", lowBound=0),
        cap=lp.add_variable("cap", lowBound=0) if minimize_capacity
        else limits.device_bytes / GIB,
        load=_barrier_load(frags, common, st),
    )
    for constrain in CONSTRAINTS:
        constrain(f)
    # the objective: the least time; or the smallest budget and, among those, the fastest
    # (time is far below 1e3 GiB-s)
    f.lp += f.cap + 1e-6 * f.step if minimize_capacity else f.step
    return f


def ilp_fragment(problem: Problem, i: int, c: Choice, training: Training) -> Fragment:
    """Block i's fragment under c as the ILP sums it. The first block of a pair also carries
    what its second block's fragment drops once marked with_prev (pairs.mark_pairs): the
    second block's checkpoint, a buffer of negative bytes over that checkpoint's stages. The
    second block recomputes (pairs_recompute_together), so its fragment holds that
    checkpoint and the sum is the plan's: one variable a choice of the first block, none
    more for the second."""
    f = lowering.fragment(problem, i, c, training)
    if c.with_next and (ckpt := problem.blocks[i + 1].ckpt_bytes):
        f.buffers.append(ProtoBuffer(f"ckpt.{i + 1}@pair", i + 1, -ckpt, ("forward", i + 1),
                                     ("backward", i + 1)))
    return f


# --- the constraints, one family each, added in this order -----------------------------


def one_choice_per_block(f: Formulation) -> None:
    """[Constraint] every block takes exactly one choice"""
    for i, options in f.options.items():
        f.lp += pulp.lpSum(f.x[i, c] for c in options) == 1, f"one_choice_{i}"


def pairs_recompute_together(f: Formulation) -> None:
    """[Constraint] a block recomputes with the next one only where the next one recomputes
    and can be its second ([Note: a checkpoint over two blocks] in karma/schedule.py;
    pairs.can_pair)"""
    for i, options in f.options.items():
        first = [f.x[i, c] for c in options if c.with_next]
        if first:
            second = [f.x[i + 1, c] for c in f.options[i + 1] if can_pair(c)]
            f.lp += pulp.lpSum(first) <= pulp.lpSum(second), f"pair_{i}"


def _barrier_load(frags: dict[tuple[int, Choice], Fragment], common: Fragment,
                  st: Stages) -> Load:
    """The work of the stages before the update on each barrier stream, op by op."""
    load: Load = {}
    for key, frag in [*frags.items(), (None, common)]:
        for o in frag.ops:
            if is_barrier(o.stream, o.kind) and o.stage < st.update:
                load.setdefault((o.stage, o.stream), []).append((o.dur_s, key, o.kind))
    return load


def stage_lasts_its_busiest_stream(f: Formulation) -> None:
    """[Constraint] a stage lasts as long as the work on its busiest barrier stream (in a
    micro-batch that does not step, without the step's ops)"""
    for (k, stream) in sorted(f.load):
        for durations, stepping, name in f.durations():
            f.lp += durations[k] >= f.work(k, stream, stepping), f"{name}_{k}_{stream}"


def shared_cores_slow_each_other(f: Formulation) -> None:
    """[Constraint] on shared cores (the CPU) a stage's compute and copies slow each other
    down, and together take at least their sum (see [Note: contention in the ILP])"""
    slow = f.problem.contention
    pair = {"compute", "h2d"}  # the speeds the simulator gives the two beside each other
    a, b = 1.0 - slow.speed("compute", pair), 1.0 - slow.speed("h2d", pair)
    if not (a or b):
        return
    for durations, stepping, name in f.durations():
        for k, copy in itertools.product(range(f.st.update), ("h2d", "d2h")):
            if (k, copy) in f.load and (k, "compute") in f.load:
                compute, moved = f.work(k, "compute", stepping), f.work(k, copy, stepping)
                f.lp += durations[k] >= compute + a / (1 - b) * moved, \
                    f"{name}_{k}_compute_beside_{copy}"
                f.lp += durations[k] >= moved + b / (1 - a) * compute, \
                    f"{name}_{k}_{copy}_beside_compute"
        for k in range(f.st.update):  # no set of streams on shared cores beats one alone
            streams = ("compute", "h2d", "d2h")
            if sum((k, stream) in f.load for stream in streams) > 1:
                f.lp += durations[k] >= pulp.lpSum(f.work(k, stream, stepping)
                                                   for stream in streams), \
                    f"{name}_{k}_conserves_work"


def stages_run_in_order(f: Formulation) -> None:
    """[Constraint] stages run one after another"""
    f.lp += f.s[0] == 0, "start"
    for k in range(f.st.update):
        f.lp += f.s[k + 1] == f.s[k] + f.t[k], f"stage_{k}_end"


def host_steps_one_at_a_time(f: Formulation) -> None:
    """[Constraint] host steps run one at a time, each once its gradients are on the host
    (the stage's first copy to the host; after the stage of their all-reduce there where
    they add up over micro-batches: lowering's _host_step), in host_order; with clipping all
    after the last gradients"""
    prev = None
    for i in f.host_order:
        step_s = f.of_kind(i, "host_step")
        if f.training.clip:
            ready = f.s[f.st.update]
        elif f.problem.world_size > 1 and f.training.accumulate > 1:  # all-reduced on the host
            ready = f.s[f.st.to_host(i) + 1]
        else:
            ready = f.s[f.st.to_host(i)] + f.of_kind(i, "grads_to_host")
        f.lp += f.h[i] >= ready + step_s, f"host_after_grads_{i}"
        if prev is not None:
            f.lp += f.h[i] >= prev + step_s, f"host_in_order_{i}"
        prev = f.h[i]


def uploads_follow_their_step(f: Formulation) -> None:
    """[Constraint] uploads of host-stepped resident weights follow their step, one at a
    time, after the last barrier stage"""
    prev = f.s[f.st.update]
    for i in f.host_order:
        up_s = f.of_kind(i, "upload")
        f.lp += f.u[i] >= prev + up_s, f"upload_in_order_{i}"
        f.lp += f.u[i] >= f.h[i] + up_s, f"upload_after_step_{i}"
        prev = f.u[i]


def replay_ends_when_every_stream_is_done(f: Formulation) -> None:
    """[Constraint] the replay that steps ends when every stream is done (with clipping,
    the device steps run in the update stage, one after another); on shared cores no
    sooner than the whole work of its streams ([Note: every stream on shared cores conserves
    work]: without it the ILP overlapped host steps it did not pay for, and the simulator's
    last word took a baseline instead)"""
    device_steps_s = f.chosen(lambda frag: sum(o.dur_s for o in frag.ops
                                               if o.kind == "device_step")) \
        if f.training.clip else 0
    last = f.host_order[-1]
    f.lp += f.replay >= f.s[f.st.update] + device_steps_s, "end_of_stages"
    f.lp += f.replay >= f.h[last], "end_of_host_steps"
    f.lp += f.replay >= f.u[last], "end_of_uploads"
    if f.problem.contention.shared:
        def cores_s(frag: Fragment) -> float:
            return sum(o.dur_s for o in frag.ops if o.stream in f.problem.contention.core_streams)

        f.lp += f.replay >= f.chosen(cores_s) + cores_s(f.common), "streams_conserve_work"


def device_memory_within_capacity(f: Formulation) -> None:
    """[Constraint] device memory in every stage stays under capacity: buffers counted from
    the stage that allocates them to the stage that frees them, and host step temporaries
    as host_temp_by_stage counts them (in each stage the largest of those whose host step
    may have started by then, so they never shrink)"""
    delta: list[list] = [[] for _ in range(f.st.count + 1)]
    for key, frag in [*f.frags.items(), (None, f.common)]:
        for first, last, nbytes in buffer_spans(f.problem, frag):
            delta[first].append((nbytes / GIB, key))
            delta[last + 1].append((-nbytes / GIB, key))
    temps = f.host_temp
    for k in range(1, f.st.count):
        f.lp += temps[k] >= temps[k - 1], f"host_temp_grows_{k}"
    for (i, c), frag in f.frags.items():
        if (nbytes := host_temp_bytes(frag)) > 0:
            first = host_temp_first_stage(f.problem, i, f.training)
            f.lp += temps[first] >= nbytes / GIB * f.x[i, c], f"host_temp_{i}_{_tag(c)}"
    for k in range(f.st.count):
        change = pulp.lpSum(v if key is None else v * f.x[key] for v, key in delta[k])
        f.lp += f.m[k] == (f.m[k - 1] if k else 0) + change, f"memory_{k}"
        f.lp += f.m[k] + temps[k] <= f.cap, f"capacity_{k}"


def node_host_memory_within_limits(f: Formulation) -> None:
    """[Constraint] host memory and pinned host memory, of the node: its ranks' own, plus
    what they share once ([Note: host state per rank and per node] in host_state.py)"""
    k = f.problem.nproc_per_node
    f.lp += f.chosen(lambda frag: (k * frag.host_bytes + frag.node_host_bytes) / GIB) \
        <= f.limits.host_bytes / GIB, "host_memory"
    f.lp += f.chosen(lambda frag: (k * frag.pinned_bytes + frag.node_pinned_bytes) / GIB) \
        <= f.limits.pinned_bytes / GIB, "pinned"


CONSTRAINTS: tuple[Callable[[Formulation], None], ...] = (
    one_choice_per_block,
    pairs_recompute_together,
    stage_lasts_its_busiest_stream,
    shared_cores_slow_each_other,
    stages_run_in_order,
    host_steps_one_at_a_time,
    uploads_follow_their_step,
    replay_ends_when_every_stream_is_done,
    device_memory_within_capacity,
    node_host_memory_within_limits,
)


_ACT_TAGS = {"keep": "k", "swap": "s", "recompute": "r", "selective": "c"}  # one letter each


def _tag(c: Choice) -> str:
    """A variable name's part for choice c, unique among choices (a selective policy's
    threshold after its letter: karma/selective_policy.py; h where what it keeps goes to the
    host)."""
    least = c.policy.partition("@")[2] if c.act == "selective" else ""
    host = "h" if c.kept == "host" else ""
    pair = "n" if c.with_next else ""  # a pair's second is marked after the solve
    return f"{_ACT_TAGS[c.act]}{least}{host}{pair}{c.weights[0]}{c.optim[0]}{c.ahead}"
