"""The planner with gradient accumulation and clipping (config.accumulate, config.clip_grad_norm).

The runtime's contract, which these tests pin down on synthetic chains and the tiny GPT:
- accumulate N: the op list is one micro-batch, replayed N times a step; the first N-1 skip
  all-reduces, steps and uploads. A step is (N-1) such replays plus one full one, each
  simulated. Device-stepped gradients live through the whole step; on several ranks a
  host-stepped block's gradients are all-reduced on the host, after its grads_to_host.
- clip: every step op comes after every gradient op (list order and stage), host steps from
  block 0 up, each upload after its block's host step.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from karma.planner.baselines import BASELINES
from karma.planner.ilp import min_capacity_bytes, solve_ilp
from karma.planner.lowering import Choice, Stages, Training
from karma.planner.memory import stage_memory
from karma.planner.plan import Plan, evaluate
from karma.planner.simulate import simulate
from karma.schedule import LAST_MICRO_BATCH_KINDS
from tests.test_planner import GB, HUGE, chain, keep_all_peak, objective_s, random_problem

GRADIENT_KINDS = ("backward", "allreduce", "grads_to_host")
OPTIMIZER_STEPS = ("device_step", "host_step")
# every combination of weights and optimizer, activations of every kind
MIX = [Choice("swap", "resident", "host"), Choice("recompute", "streamed", "host"),
       Choice("keep", "resident", "device"), Choice("swap", "resident", "device"),
       Choice("keep", "streamed", "host"), Choice("keep", "resident", "host")]
CLIP = Training(clip=True)


def mixed(n: int) -> tuple[Choice, ...]:
    """A valid plan of n blocks using every choice in turn (the last block cannot swap)."""
    choices = [MIX[i % len(MIX)] for i in range(n)]
    if choices[-1].act == "swap":
        choices[-1] = dataclasses.replace(choices[-1], act="keep")
    return tuple(choices)


def problem_of(seed: int, world_size: int = 1, n: int = 6):
    """A random transformer-ish chain whose blocks all have weights (so every op exists)."""
    problem = random_problem(random.Random(seed), n, world_size)
    blocks = tuple(b if b.param_bytes else dataclasses.replace(
        b, param_bytes=10**8, optim_bytes=2 * 10**8, host_step_s=0.03, device_step_s=1e-3,
        allreduce_s=0.02 if world_size > 1 else 0.0) for b in problem.blocks)
    return dataclasses.replace(problem, blocks=blocks)


# --- clipping -----------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("accumulate", [1, 3])
def test_with_clipping_every_step_follows_every_gradient(world_size, accumulate):
    problem = problem_of(1, world_size)
    training = Training(accumulate, clip=True)
    ev = evaluate(problem, Plan("x", mixed(6)), HUGE, training)  # simulates: residency checked
    grads = [o for o in ev.ops if o.kind in GRADIENT_KINDS]
    steps = [o for o in ev.ops if o.kind in OPTIMIZER_STEPS]
    assert {o.kind for o in steps} == set(OPTIMIZER_STEPS)
    assert min(o.id for o in steps) > max(o.id for o in grads)
    assert min(o.stage for o in steps) > max(o.stage for o in grads)
    update = Stages(6, world_size).update
    assert {o.stage for o in steps} == {update}
    # ... and in time: no step starts before the last gradient is done
    assert min(ev.sim.start_s[o.id] for o in steps) >= max(ev.sim.end_s[o.id] for o in grads)
    # host steps from block 0 up; each upload after its block's step, in the list and in deps
    host = [o for o in ev.ops if o.kind == "host_step"]
    assert [o.block for o in host] == sorted(o.block for o in host)
    step_of = {o.block: o.id for o in host}
    uploads = [o for o in ev.ops if o.kind == "upload"]
    assert uploads and [o.block for o in uploads] == sorted(o.block for o in uploads)
    for o in uploads:
        assert step_of[o.block] in o.deps and o.id > step_of[o.block]


def test_with_clipping_device_gradients_are_held_until_the_update_stage():
    problem = problem_of(2)
    choices = mixed(6)
    st = Stages(6, 1)
    ev = evaluate(problem, Plan("x", choices), HUGE, CLIP)
    by_name = {b.name: b for b in ev.buffers}
    for i, c in enumerate(choices):
        if c.optim == "device":
            freed_by = ev.ops[by_name[f"grad.{i}"].free]
            assert (freed_by.kind, freed_by.stage) == ("device_step", st.update)
    # held longer than without clipping: the stage bound grows by them, stage by stage
    plain = stage_memory(problem, list(choices))
    clipped = stage_memory(problem, list(choices), CLIP)
    assert all(c >= p for c, p in zip(clipped, plain))
    held = sum(problem.blocks[i].param_bytes for i, c in enumerate(choices) if c.optim == "device")
    assert clipped[st.to_host(0)] - plain[st.to_host(0)] == held  # the epilogue holds them all


@pytest.mark.parametrize("training", [CLIP, Training(3), Training(2, clip=True)])
@pytest.mark.parametrize("world_size", [1, 2])
def test_stage_memory_is_never_below_the_simulated_peak(training, world_size):
    for seed in range(4):
        problem = problem_of(seed, world_size)
        for plan in [Plan("x", mixed(6))] + [fn(problem, HUGE, training)
                                             for fn in BASELINES.values()]:
            ev = evaluate(problem, plan, HUGE, training)
            assert ev.peak_device_bytes <= ev.stage_peak_bytes, (seed, plan.strategy)


def test_overlapped_updates_are_hidden_under_the_next_forward_by_hand():
    # 2 blocks, forward 1 s, backward 2 s, 1 GB of weights each, stepped on the host in
    # 0.5 s and uploaded at 2 GB/s (0.5 s). Clipped, the step is
    #   stages: prologue 0, fwd 1, fwd 1, bwd 2, bwd 2, epilogue (block 0's gradients to
    #   the host, 0.5 s): 6.5 s; then host step 0 (0.5), host step 1 (0.5), upload 1 (0.5)
    #   after its step: 8 s.
    # Overlapped, block 0's step and upload (1 s) are not done by the next forward 0: it
    # waits 1 s; block 1's are done (at 2 s) before its forward (at 2 s): 6.5 + 1 = 7.5 s.
    problem = chain(2, param_bytes=GB, act_bytes=0, host_step_s=0.5)
    ev = evaluate(problem, Plan("x", (Choice("keep", "resident", "host"),) * 2), HUGE, CLIP)
    assert ev.serial_step_s == pytest.approx(8.0)
    assert ev.overlapped_step_s == pytest.approx(7.5)
    # Unclipped, the host steps overlap the backward instead
    plain = evaluate(problem, Plan("x", (Choice("keep", "resident", "host"),) * 2), HUGE)
    assert plain.serial_step_s == pytest.approx(7.5)
    assert plain.overlapped_step_s is None


def test_overlapped_updates_that_take_longer_than_the_forward_show_in_the_step():
    # host steps of 10 s: nothing hides them; a step takes at least both of them
    problem = chain(3, param_bytes=GB, act_bytes=0, host_step_s=10.0)
    ev = evaluate(problem, Plan("x", (Choice("keep", "streamed", "host"),) * 3), HUGE, CLIP)
    assert 30.0 <= ev.overlapped_step_s < ev.serial_step_s
    # hidden completely when they are instant: the step is the serial step without them
    quick = chain(3, param_bytes=GB, act_bytes=0, host_step_s=0.0)
    ev = evaluate(quick, Plan("x", (Choice("keep", "streamed", "host"),) * 3), HUGE, CLIP)
    assert ev.overlapped_step_s == pytest.approx(ev.serial_step_s)


# --- accumulation -------------------------------------------------------------------------


@pytest.mark.parametrize("world_size", [1, 2])
@pytest.mark.parametrize("clip", [False, True])
def test_a_step_is_the_replays_without_the_update_and_one_with_it(world_size, clip):
    problem = problem_of(3, world_size)
    n = 4
    ev = evaluate(problem, Plan("x", mixed(6)), HUGE, Training(n, clip))
    # independently: the ops as written, and with the step's kinds at zero duration
    full = simulate(ev.ops, ev.buffers)
    micro = simulate([dataclasses.replace(o, dur_s=0.0) if o.kind in LAST_MICRO_BATCH_KINDS else o
                      for o in ev.ops], ev.buffers)
    assert micro.serial_step_s < full.serial_step_s
    assert ev.serial_step_s == pytest.approx((n - 1) * micro.serial_step_s + full.serial_step_s,
                                           rel=1e-12)
    for stream, busy in ev.sim.busy_s.items():
        assert busy == pytest.approx((n - 1) * micro.busy_s[stream] + full.busy_s[stream])
    one = evaluate(problem, Plan("x", mixed(6)), HUGE, Training(1, clip))
    assert ev.serial_step_s < n * one.serial_step_s  # the update is paid once, not n times


def test_with_accumulation_device_gradients_live_in_every_stage():
    problem = problem_of(4)
    choices = mixed(6)
    ev = evaluate(problem, Plan("x", choices), HUGE, Training(4))
    by_name = {b.name: b for b in ev.buffers}
    device = [i for i, c in enumerate(choices) if c.optim == "device"]
    host = [i for i, c in enumerate(choices) if c.optim == "host"]
    for i in device:
        assert (by_name[f"grad.{i}"].alloc, by_name[f"grad.{i}"].free) == (None, None)
    for i in host:  # host-stepped: on the device from the backward to grads_to_host only
        assert ev.ops[by_name[f"grad.{i}"].free].kind == "grads_to_host"
    plain = stage_memory(problem, list(choices))
    accumulated = stage_memory(problem, list(choices), Training(4))
    held = sum(problem.blocks[i].param_bytes for i in device)
    assert accumulated[0] - plain[0] == held  # the prologue: before any backward
    assert all(a - p >= 0 for a, p in zip(accumulated, plain))
    assert min(accumulated) >= held


def test_with_accumulation_on_several_ranks_host_gradients_are_reduced_on_the_host():
    problem = problem_of(5, world_size=2)
    choices = mixed(6)
    ev = evaluate(problem, Plan("x", choices), HUGE, Training(2))
    of = {(o.kind, o.block): o for o in ev.ops}
    for i, c in enumerate(choices):
        ar = of["allreduce", i]
        if c.optim == "host":
            to_host, step = of["grads_to_host", i], of["host_step", i]
            assert to_host.id in ar.deps and to_host.stage < ar.stage
            assert f"grad.{i}" not in ar.uses  # the device copy is gone by then
            assert ar.id in step.deps
            assert ev.sim.start_s[ar.id] >= ev.sim.end_s[to_host.id]
            assert ev.sim.start_s[step.id] >= ev.sim.end_s[ar.id]
        else:
            step = of["device_step", i]
            assert ar.id < step.id and ar.stage < step.stage
            assert ev.sim.start_s[step.id] >= ev.sim.end_s[ar.id]
    # one micro-batch per step: as before, the all-reduce reads the device gradients
    before = {(o.kind, o.block): o for o in evaluate(problem, Plan("x", choices), HUGE).ops}
    assert all(f"grad.{i}" in before["allreduce", i].uses for i in range(6))


# --- the ILP --------------------------------------------------------------------------------


@pytest.mark.parametrize("training", [CLIP, Training(4), Training(3, clip=True)])
@pytest.mark.parametrize("world_size", [1, 2])
def test_ilp_objective_and_memory_match_the_simulator(training, world_size):
    problem = problem_of(6, world_size, n=5)
    low, high = min_capacity_bytes(problem, training=training), keep_all_peak(problem)
    assert low <= max(stage_memory(problem, [Choice("keep")] * 5, training))
    for cap in (low, (low + high) // 2, HUGE):
        plan = solve_ilp(problem, cap, gap=0.0, training=training)
        ev = evaluate(problem, plan, cap, training)
        assert ev.feasible and ev.peak_device_bytes <= ev.stage_peak_bytes <= cap
        # refine_prefetch may improve on the solver's plan, never worsen it
        assert ev.serial_step_s <= objective_s(plan) * (1 + 1e-7) + 1e-6
        baselines = [evaluate(problem, fn(problem, cap, training), cap, training)
                     for fn in BASELINES.values()]
        feasible = [b.serial_step_s for b in baselines if b.feasible]
        assert ev.serial_step_s <= min(feasible, default=ev.serial_step_s) * (1 + 1e-7) + 1e-6


@pytest.mark.parametrize("training", [CLIP, Training(4), Training(2, clip=True)])
@pytest.mark.parametrize("world_size", [1, 2])
def test_ilp_objective_is_the_simulated_step_exactly(training, world_size):
    # The solver plans copies one stage ahead (refine_prefetch may then issue some two
    # ahead): its objective is the simulated step of its own plan, to rounding.
    problem = problem_of(7, world_size, n=5)
    low, high = min_capacity_bytes(problem, training=training), keep_all_peak(problem)
    for cap in (low, (2 * low + high) // 3, high):
        plan = solve_ilp(problem, cap, gap=0.0, training=training)
        solved = Plan("x", tuple(dataclasses.replace(c, ahead=1) for c in plan.choices))
        assert evaluate(problem, solved, cap, training).serial_step_s == pytest.approx(
            objective_s(plan), rel=1e-7, abs=1e-6)


# --- the tiny GPT through karma-inspect ------------------------------------------------------


@pytest.mark.parametrize("accumulate,clip", [(1, 1.0), (3, None), (2, 0.5)])
def test_inspect_re_simulates_training_schedules(tmp_path, capsys, accumulate, clip):
    from karma.cli.inspect import main
    from karma.planner.hardware import load_hardware
    from karma.planner.options import PlanOptions
    from karma.planner.pipeline import schedule_from
    from karma.planner.problem import build_problem
    from karma.schedule import ModelRef, dump_schedule
    from tests.schedule_fixtures import HARDWARE, MIXED, TINY_ENV, tiny_graph

    mf, graph = tiny_graph()
    training = Training(accumulate, clip is not None)
    problem = build_problem(graph, load_hardware(HARDWARE))
    capacity = 1 << 20  # with these options MIXED needs more than TINY_CAPACITY_BYTES
    ev = evaluate(problem, Plan("ilp", MIXED, status="optimal"), capacity, training)
    assert ev.feasible  # else karma-inspect refuses it on load (rule: peak within capacity)
    model = ModelRef.now(graph.model, mf.sha256, graph.to_json(), TINY_ENV)
    options = PlanOptions(gpu_mem=capacity, hardware=load_hardware(HARDWARE),
                          batch_size=graph.batch_size, accumulate=accumulate,
                          clip_grad_norm=clip)
    path = tmp_path / "s.yaml"
    path.write_text(dump_schedule(schedule_from(graph, model, options, ev, ev.serial_step_s)))
    code = main([str(path), "--plot", str(tmp_path / "s.png")])
    out = capsys.readouterr().out
    assert code == 0, out
    assert (tmp_path / "s.png").read_bytes().startswith(b"\x89PNG")
    assert ("overlapped" in out) == (clip is not None)
    assert (f"a step of {accumulate} micro-batches" in out) == (accumulate > 1)
