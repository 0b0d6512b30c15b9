"""How far ahead copies are issued: a local improvement after the ILP.

The ILP decides every block's activations, weights and optimizer with its copies issued one
stage ahead. With two stages ahead a choice too, gpt-xl plans run into the solver's time limit
(over 60 s, against 0.2 s with one) for no better answer within the gap. So
this pass takes the ILP's plan and, block by block, issues a swap-in or weight fetch two
stages ahead where that shortens the stages it touches and the stage memory still fits. It
is deterministic, and the result is kept only if the simulator agrees that it is faster.
"""

from __future__ import annotations

from dataclasses import replace

from karma.planner.lowering import PLAIN, Stages, Training, fragment, valid_choices
from karma.planner.memory import buffer_spans, host_temp_by_stage, stage_memory
from karma.planner.plan import Plan, evaluate
from karma.planner.problem import Problem
from karma.schedule import BARRIER_STREAMS, is_barrier


def refine_prefetch(problem: Problem, plan: Plan, capacity_bytes: int,
                    training: Training = PLAIN) -> Plan:
    """`plan` with some copies issued two stages ahead, where that is faster and fits."""
    n = len(problem.blocks)
    st = Stages(n, problem.world_size)
    choices = list(plan.choices)
    frags = [fragment(problem, i, c, training) for i, c in enumerate(choices)]
    load = [dict.fromkeys(BARRIER_STREAMS, 0.0) for _ in range(st.count)]
    for f in frags:
        _add_load(load, f, +1)
    host_temp = host_temp_by_stage(problem, frags, training)  # the same whatever `ahead` is
    memory = [m - t for m, t in zip(stage_memory(problem, choices, training), host_temp)]

    changed = False
    for i in range(n):
        c = choices[i]
        if c.ahead != 1 or not (c.act == "swap" or c.weights == "streamed"):
            continue
        candidate = replace(c, ahead=2)
        if replace(candidate, with_prev=False) not in valid_choices(problem, i):
            continue
        new = fragment(problem, i, candidate, training)
        touched = {o.stage for o in frags[i].ops + new.ops}
        before = sum(max(load[k].values()) for k in touched)
        _add_load(load, frags[i], -1)
        _add_load(load, new, +1)
        after = sum(max(load[k].values()) for k in touched)
        new_memory = _shift_memory(problem, memory, frags[i], new)
        fits = all(m + t <= capacity_bytes for m, t in zip(new_memory, host_temp))
        if after < before - 1e-12 and fits:
            choices[i], frags[i], memory, changed = candidate, new, new_memory, True
        else:  # undo
            _add_load(load, new, -1)
            _add_load(load, frags[i], +1)
    if not changed:
        return plan
    refined = replace(plan, choices=tuple(choices))
    if evaluate(problem, refined, capacity_bytes, training).serial_step_s \
            < evaluate(problem, plan, capacity_bytes, training).serial_step_s:
        return refined
    return plan


def _add_load(load: list[dict[str, float]], f, sign: int) -> None:
    for o in f.ops:
        if is_barrier(o.stream, o.kind) and o.stage < len(load):
            load[o.stage][o.stream] += sign * o.dur_s


def _shift_memory(problem: Problem, memory: list[int], old, new) -> list[int]:
    out = list(memory)
    for sign, f in ((-1, old), (+1, new)):
        for first, last, nbytes in buffer_spans(problem, f):
            for k in range(first, last + 1):
                out[k] += sign * nbytes
    return out
