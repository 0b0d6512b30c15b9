"""Streams that share cores (the CPU backend): the simulator's processor sharing, the ILP's
contention constraints, and independent streams (a GPU) left exactly as they were.

The by-hand numbers use the three-block chain of test_planner.py (forward 1, 1.2, 0.2 s,
backward 2, 2, 0.4 s, 1 GB of activations each) over a 1.25 GB/s link: a swap of block 0
copies for 0.8 s each way, beside block 1's 1.2 s forward and 2 s backward.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from karma.planner.baselines import BASELINES
from karma.planner.hardware import dump_hardware, hardware_from_yaml, load_hardware
from karma.planner.ilp import solve_ilp
from karma.planner.lowering import Choice
from karma.planner.plan import Plan, evaluate
from karma.planner.simulate import INDEPENDENT, Contention, _times, simulate
from karma.schedule import Op
from tests.test_planner import GB, KEEP, KEEP_ALL_S, RECOMPUTE, SLACK, SWAP, chain, random_problem

HALF = Contention(compute_slowdown_copy=0.5, copy_slowdown_compute=0.5)


def _op(i: int, stream: str, dur_s: float, deps=()) -> Op:
    return Op(id=i, kind="fwd" if stream == "compute" else "swap_out", block=0, stage=0,
              stream=stream, dur_s=dur_s, bytes=0, deps=tuple(deps))


def _list_schedule(ops) -> tuple[list[float], list[float]]:
    """The simulator before contention: each op at max(its deps' ends, its stream free)."""
    start, end, free = [0.0] * len(ops), [0.0] * len(ops), {}
    for op in ops:
        start[op.id] = max([end[d] for d in op.deps] + [free.get(op.stream, 0.0)])
        end[op.id] = free[op.stream] = start[op.id] + op.dur_s
    return start, end


@pytest.mark.parametrize("seed", range(4))
def test_independent_streams_time_every_op_exactly_as_a_list_schedule(seed):
    problem = random_problem(random.Random(seed), 12, world_size=1 + seed % 2)
    for name, fn in BASELINES.items():
        ops = evaluate(problem, fn(problem, 1 << 60), 1 << 60).ops
        assert _times(ops, INDEPENDENT) == _list_schedule(ops), name  # the same floats


def test_a_copy_beside_compute_shares_the_cores_by_hand():
    ops = [_op(0, "compute", 1.0), _op(1, "h2d", 1.0)]
    assert _times(ops) == ([0.0, 0.0], [1.0, 1.0])
    # both at half speed: both done at 2 s
    assert _times(ops, HALF) == ([0.0, 0.0], [2.0, 2.0])
    # compute at 0.4 and the copy at 0.6 of their speeds: the copy ends at 1 2/3 s, compute
    # has done 2/3 by then, and the last third at full speed
    assert _times(ops, Contention(compute_slowdown_copy=0.6, copy_slowdown_compute=0.4)
                  )[1] == pytest.approx([2.0, 5 / 3])
    # only compute slowed: 0.5 + 1 adds up to more than 1, so the pair is scaled to 1/3 and
    # 2/3 ([Note: every stream on shared cores conserves work]): the copy ends at 1.5 s,
    # compute has done half, the rest at full speed; together the sum of their work
    assert _times(ops, Contention(compute_slowdown_copy=0.5))[1] == pytest.approx([2.0, 1.5])
    # a host step slows compute only by its own fraction; a copy's fraction does not apply
    host = [_op(0, "compute", 1.0), dataclasses.replace(_op(1, "host", 0.5), kind="host_step")]
    assert _times(host, Contention(compute_slowdown_copy=0.9, compute_slowdown_host=0.6,
                                   host_slowdown_compute=0.4))[1] == pytest.approx([1.5, 5 / 6])


def test_side_streams_share_the_cores_with_each_other():
    """[Note: every stream on shared cores conserves work]: a copy and a host step beside
    each other, with compute idle, take their sum on shared cores; on a GPU both 1 s."""
    ops = [_op(0, "h2d", 1.0), dataclasses.replace(_op(1, "host", 1.0), kind="host_step"),
           _op(2, "d2h", 1.0)]
    assert _times(ops)[1] == [1.0, 1.0, 1.0]
    assert _times(ops, HALF)[1] == pytest.approx([3.0, 3.0, 3.0])
    # the network is not the cores: an all-reduce beside them keeps its speed
    net = [_op(0, "h2d", 1.0), _op(1, "net", 1.0)]
    assert _times(net, HALF)[1] == [1.0, 1.0]


def test_a_measured_pair_that_adds_up_to_more_than_one_is_scaled_to_one():
    """[Note: every stream on shared cores conserves work], on pairs this machine measured:
    the profile keeps them as measured; the simulator's speeds add up to at most 1, keeping
    the ratio between the two."""
    over = Contention(compute_slowdown_host=0.397, host_slowdown_compute=0.497)
    busy = ("compute", "host")  # 0.603 + 0.503 = 1.106
    assert over.speed("compute", busy) == pytest.approx(0.603 / 1.106)
    assert over.speed("host", busy) == pytest.approx(0.503 / 1.106)
    under = Contention(compute_slowdown_copy=0.509, copy_slowdown_compute=0.628)
    busy = ("compute", "h2d")  # 0.491 + 0.372: below 1, as measured
    assert under.speed("compute", busy) == pytest.approx(0.491)
    assert under.speed("h2d", busy) == pytest.approx(0.372)
    assert over.speed("compute", ("compute",)) == 1.0  # alone: its full speed


def test_compute_that_waits_for_a_copy_does_not_share_the_cores():
    # compute op 1 waits for the copy: nothing overlaps, nothing slows down
    ops = [_op(0, "h2d", 1.0), _op(1, "compute", 1.0, deps=[0])]
    assert _times(ops, HALF) == ([0.0, 1.0], [1.0, 2.0])


def _three_blocks() -> object:
    return chain(3, fwd_s=[1.0, 1.2, 0.2], bwd_s=[2.0, 2.0, 0.4], act_bytes=GB,
                 link_bytes_per_s=1.25e9)


def test_a_swap_hidden_on_a_gpu_costs_its_copies_on_shared_cores():
    # Swapping block 0 hides behind block 1 on independent streams (6.8 s, keep_all's time).
    # At half speed beside each other, the 0.8 s swap-out ends at 1.6 s with 0.8 s of the
    # 1.2 s forward done: the stage lasts 1.6 + 0.4 = 2.0 s; the swap-in's stage 2.8 s.
    # That is 0.8 s more per copy: 8.4 s.
    gpu = _three_blocks()
    cpu = dataclasses.replace(gpu, contention=HALF)
    plan = Plan("by_hand", (SWAP, KEEP, KEEP))
    on_gpu, on_cpu = evaluate(gpu, plan, 2 * GB + SLACK), evaluate(cpu, plan, 2 * GB + SLACK)
    assert on_gpu.serial_step_s == pytest.approx(KEEP_ALL_S, rel=1e-9)
    assert on_cpu.serial_step_s == pytest.approx(KEEP_ALL_S + 1.6, rel=1e-9)
    assert on_cpu.sim.busy_s == on_gpu.sim.busy_s  # the work is the same; it takes longer
    # a plan without copies runs as on a GPU
    keep = Plan("by_hand", (KEEP,) * 3)
    assert evaluate(cpu, keep, 1 << 60).sim == evaluate(gpu, keep, 1 << 60).sim


def test_the_ilp_recomputes_where_contention_makes_a_swap_dearer():
    # Without contention block 0 swaps for free; with it the swap costs 1.6 s and recomputing
    # block 0 costs its 1 s forward again (6.8 + 1.0 = 7.8 s): the ILP's stage constraints see
    # it, and its objective is the simulated time.
    gpu = _three_blocks()
    cpu = dataclasses.replace(gpu, contention=HALF)
    assert solve_ilp(gpu, 2 * GB + SLACK, gap=0.0).choices == (SWAP, KEEP, KEEP)
    plan = solve_ilp(cpu, 2 * GB + SLACK, gap=0.0)
    assert plan.choices == (RECOMPUTE, KEEP, KEEP)
    assert evaluate(cpu, plan, 2 * GB + SLACK).serial_step_s == pytest.approx(KEEP_ALL_S + 1.0)


def test_the_ilps_stage_sums_match_the_simulator_under_contention():
    # Stages start together at their barriers, so two streams sharing cores last exactly the
    # larger of the two linear bounds: the ILP's objective is the simulated time.
    cpu = dataclasses.replace(_three_blocks(), contention=Contention(0.3, 0.6))
    plan = solve_ilp(cpu, 2 * GB + SLACK, gap=0.0)
    objective = float(plan.note.split("objective ")[1].split(" s")[0])
    assert evaluate(cpu, plan, 2 * GB + SLACK).serial_step_s == pytest.approx(objective, abs=1e-5)


def test_contention_slows_a_host_step_beside_compute():
    # block 3's host step runs during block 1's backward (its gradients reach the host in
    # block 2's backward)
    problem = chain(4, fwd_s=1.0, bwd_s=2.0, act_bytes=GB, param_bytes=GB, host_step_s=1.0)
    plan = Plan("by_hand", (Choice("keep", "resident", "host"),) * 4)
    alone = evaluate(problem, plan, 1 << 60)
    shared = evaluate(dataclasses.replace(problem, contention=Contention(
        compute_slowdown_host=0.5, host_slowdown_compute=0.5)), plan, 1 << 60)
    assert shared.serial_step_s > alone.serial_step_s


def test_independent_streams_zero_only_the_contention():
    cpu = load_hardware("cpu")
    assert Contention.of(cpu.__dict__).shared
    independent = cpu.independent_streams()
    assert not Contention.of(independent.__dict__).shared
    assert independent == dataclasses.replace(
        cpu, compute_slowdown_copy=0.0, copy_slowdown_compute=0.0, compute_slowdown_host=0.0,
        host_slowdown_compute=0.0)


def test_profiles_without_contention_load_as_independent_streams():
    v100 = load_hardware("v100-16g")
    assert (v100.compute_slowdown_copy, v100.copy_slowdown_compute,
            v100.compute_slowdown_host, v100.host_slowdown_compute) == (0, 0, 0, 0)
    assert "slowdown" not in dump_hardware(v100)
    cpu = dataclasses.replace(v100, device_kind="cpu", compute_slowdown_copy=0.45,
                              host_slowdown_compute=0.1)
    text = dump_hardware(cpu)
    assert "compute_slowdown_copy: 0.45" in text and "copy_slowdown_compute" not in text
    assert hardware_from_yaml(text) == cpu


@pytest.mark.parametrize("bad", [-0.1, 0.96, "lots", True])
def test_a_slowdown_must_be_a_fraction(bad):
    from karma.errors import KarmaError

    with pytest.raises(KarmaError, match="compute_slowdown_copy must be a fraction"):
        dataclasses.replace(load_hardware("v100-16g"), compute_slowdown_copy=bad)


def test_simulate_without_contention_is_the_default():
    problem = random_problem(random.Random(7), 8)
    ev = evaluate(problem, BASELINES["swap_all"](problem, 1 << 60), 1 << 60)
    assert simulate(ev.ops, ev.buffers) == simulate(ev.ops, ev.buffers, contention=INDEPENDENT)
    assert simulate(ev.ops, ev.buffers) == ev.sim


def _cpu_schedule(ranks: int = 1):
    """The tiny GPT's offload_all schedule on the cpu profile for `ranks` ranks of one node,
    as karma-plan writes it."""
    from karma.planner.options import PlanOptions
    from karma.planner.pipeline import schedule_from
    from karma.planner.problem import build_problem
    from karma.schedule import ModelRef, dump_schedule
    from karma.schedule_load import load_schedule
    from tests.schedule_fixtures import TINY_CAPACITY_BYTES, tiny_graph

    _, graph = tiny_graph()
    hw = load_hardware("cpu")
    problem = build_problem(graph, hw, world_size=ranks, nproc_per_node=ranks)
    ev = evaluate(problem, BASELINES["offload_all"](problem, TINY_CAPACITY_BYTES),
                  TINY_CAPACITY_BYTES)
    options = PlanOptions(gpu_mem=TINY_CAPACITY_BYTES, hardware=hw, batch_size=graph.batch_size,
                          world_size=ranks, nproc_per_node=ranks)
    s = load_schedule(dump_schedule(schedule_from(
        graph, ModelRef(graph.model, "0" * 64, "0" * 64, ()), options, ev, ev.step_s)))
    return s


def test_a_cpu_schedule_re_simulates_with_the_contention_it_carries():
    # karma-inspect re-simulates a schedule's ops; on a CPU profile it must pass the
    # fractions the schedule's hardware carries (without them it times independent streams)
    s = _cpu_schedule()
    sim = simulate(s.ops, s.buffers, contention=Contention.of(dict(s.hardware)))
    assert sim.step_s == pytest.approx(s.predicted.step_s, rel=1e-5)
    assert simulate(s.ops, s.buffers).step_s < sim.step_s  # independent streams: faster


def test_karma_inspect_accepts_a_cpu_schedule():
    from karma.cli.inspect import check_predicted

    check_predicted(_cpu_schedule(), "s.yaml")
    check_predicted(_cpu_schedule(ranks=2), "s.yaml")  # the host stream apart alike


def test_a_side_op_beside_compute_first_waits_for_a_core_by_hand():
    """[Note: waiting for a core]: the wait holds the stream and takes no core."""
    wait = dataclasses.replace(HALF, side_wait_s=0.2)
    ops = [_op(0, "compute", 1.0), _op(1, "h2d", 0.5)]
    # without the wait both run at half speed from 0: the copy ends at 1 s, compute at 1.5 s
    assert _times(ops, HALF)[1] == pytest.approx([1.5, 1.0])
    # with it compute runs alone to 0.2 s, then both at half until the copy's 0.5 s of work
    # is done at 1.2 s, compute's last 0.3 s at full speed: the copy pays the wait, compute
    # nothing
    assert _times(ops, wait) == ([0.0, 0.0], pytest.approx([1.5, 1.2]))
    # each op of the stream waits again, holding the stream: the second copy starts at
    # 1.2 s and works from 1.4 s; compute is alone for both waits
    two = [_op(0, "compute", 10.0), _op(1, "h2d", 0.5), _op(2, "h2d", 0.5)]
    assert _times(two, wait)[1] == pytest.approx([11.0, 1.2, 2.4])
    # started while compute is idle, a copy finds a core at once
    idle = [_op(0, "h2d", 0.5), _op(1, "compute", 1.0, deps=[0])]
    assert _times(idle, wait) == ([0.0, 0.5], [0.5, 1.5])
    # the network is not the cores
    assert _times([_op(0, "compute", 1.0), _op(1, "net", 0.5)], wait)[1] == [1.0, 0.5]


def test_copies_to_the_host_may_lose_their_own_fraction():
    both = Contention(compute_slowdown_copy=0.6, copy_slowdown_compute=0.5)
    own = dataclasses.replace(both, d2h_slowdown_compute=0.8)
    with_d2h, with_h2d = ("compute", "d2h"), ("compute", "h2d")
    assert both.speed("d2h", with_d2h) == both.speed("h2d", with_h2d) == 0.5  # 0: as h2d's
    assert own.speed("h2d", with_h2d) == 0.5 and own.speed("d2h", with_d2h) == pytest.approx(0.2)
    cpu = dataclasses.replace(load_hardware("cpu"), d2h_slowdown_compute=0.3, side_wait_s=0.001)
    assert Contention.of(cpu.__dict__) == Contention(
        cpu.compute_slowdown_copy, cpu.copy_slowdown_compute, cpu.compute_slowdown_host,
        cpu.host_slowdown_compute, 0.3, 0.001)
    assert cpu.independent_streams() == dataclasses.replace(
        cpu, compute_slowdown_copy=0.0, copy_slowdown_compute=0.0, compute_slowdown_host=0.0,
        host_slowdown_compute=0.0, d2h_slowdown_compute=0.0, side_wait_s=0.0)


def test_ranks_sharing_a_cpu_keep_the_host_stream_apart_from_the_shared_cores():
    """[Note: the host step beside compute, ranks sharing a CPU]: their share counts it."""
    cpu = dataclasses.replace(load_hardware("cpu"), d2h_slowdown_compute=0.3, side_wait_s=0.001)
    alone = Contention.of(cpu.__dict__)
    assert alone.compute_slowdown_host > 0 and alone.host_slowdown_compute > 0
    two = Contention.of(cpu.__dict__, ranks_per_node=2)
    assert two == dataclasses.replace(alone, compute_slowdown_host=0.0, host_slowdown_compute=0.0,
                                      host_apart=True)
    assert two.shared and two.side_wait_s == 0.001  # the copies' fractions and the wait stay
    # apart: a host step beside compute and copies runs at full speed, waits for no core and
    # slows none of them; the copies still share the cores with compute
    busy = {"compute", "h2d", "host"}
    assert two.speed("host", busy) == 1.0 and two.wait_s("host", busy) == 0.0
    assert two.speed("compute", busy) == two.speed("compute", {"compute", "h2d"})
    assert alone.speed("host", busy) < 1.0 and alone.wait_s("host", busy) == 0.001
    assert two.wait_s("h2d", busy) == 0.001
    gpu = dataclasses.replace(cpu, device_kind="cuda")  # a GPU rank's compute is its own
    assert Contention.of(gpu.__dict__, 8) == Contention.of(gpu.__dict__)
    from karma.planner.problem import build_problem
    from tests.schedule_fixtures import tiny_graph

    _, graph = tiny_graph()
    assert build_problem(graph, cpu, world_size=2, nproc_per_node=2).contention == two
    assert build_problem(graph, cpu, world_size=2, nproc_per_node=1).contention == alone


def test_the_wait_is_written_only_when_fitted_and_read_back():
    v100 = load_hardware("v100-16g")
    assert "side_wait_s" not in dump_hardware(v100) and "d2h_slowdown" not in dump_hardware(v100)
    fitted = dataclasses.replace(v100, device_kind="cpu", d2h_slowdown_compute=0.25,
                                 side_wait_s=0.0014)
    text = dump_hardware(fitted)
    assert "side_wait_s: 0.0014" in text and "d2h_slowdown_compute: 0.25" in text
    assert hardware_from_yaml(text) == fitted


@pytest.mark.parametrize("bad", [-0.001, 1.0, "soon", True])
def test_the_wait_must_be_seconds_under_one(bad):
    from karma.errors import KarmaError

    with pytest.raises(KarmaError, match="side_wait_s must be a number of seconds"):
        dataclasses.replace(load_hardware("v100-16g"), side_wait_s=bad)
