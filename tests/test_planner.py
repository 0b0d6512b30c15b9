"""The planner on synthetic problems: optima worked out by hand, the ILP against brute force
and the baselines, its memory bound against the simulator, and the simulator's own checks.

Every Problem here is built from BlockCost numbers (`chain`), never from a model, so each
expected time can be derived by hand from the stage model in karma/planner/lowering.py:

    stage 0            prologue (fetch block 0's streamed weights)
    stage 1 + j        forward j (+ the loss after the last); swap-out of j-1; fetch for j+1
    stage 1+n+(n-1-j)  backward j (after its recompute, + its device step); swap-in and fetch
                       for j-1; block j+1's gradients to the host
    stage 2n + 1       epilogue: block 0's gradients to the host
    update             uploads of host-stepped resident weights, after their host steps

A stage lasts as long as its busiest stream (compute, h2d, d2h, net); host steps run on their
own stream once their gradients are on the host.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import random
import time
from collections.abc import Sequence

import pytest

from karma.planner.baselines import BASELINES, keep_all
from karma.planner.ilp import min_capacity_bytes, solve_ilp
from karma.planner.lowering import Choice, valid_choices
from karma.planner.memory import stage_memory
from karma.planner.pairs import mark_pairs
from karma.planner.plan import Evaluation, InfeasiblePlan, Plan, evaluate
from karma.planner.prefetch import refine_prefetch
from karma.planner.problem import BlockCost, HeldSaved, Problem, SelectiveCost
from karma.planner.simulate import ScheduleError, simulate
from karma.units import format_bytes
from tests.matrix import first_fast

GB = 10**9  # decimal, so that sizes are never MiB-aligned by accident
MIB = 1 << 20
HUGE = 10**15  # bytes: a budget nothing reaches
# The hand-worked budgets leave this much over the plan they expect: these tests are about
# choices, not the last bytes (those have tests of their own below).
SLACK = MIB

KEEP = Choice("keep")
SWAP = Choice("swap")
RECOMPUTE = Choice("recompute")


def _per_block(value, n: int, what: str) -> list:
    values = list(value) if isinstance(value, Sequence) else [value] * n
    if len(values) != n:
        raise ValueError(f"{what}: {len(values)} values for {n} blocks")
    return values


def chain(n: int, *, fwd_s=1.0, bwd_s=2.0, act_bytes=GB, param_bytes=0, optim_bytes=None,
          in_bytes=0, out_bytes=0, host_step_s=1e3, device_step_s=0.0, allreduce_s=0.0,
          shared_from=None, link_bytes_per_s: float = 2e9, input_bytes: int = 0,
          loss_act_bytes: int = 0, loss_s: float = 0.0, host_mem_bytes: int = HUGE,
          pinned_mem_bytes: int = HUGE, world_size: int = 1) -> Problem:
    """A chain of n blocks; each per-block argument is a number or a list of n numbers.

    The defaults isolate activations: no weights, no tensors between blocks, one link speed
    both ways, and a host optimizer step so slow (1000 s) that it never pays unless a test
    says otherwise. optim_bytes defaults to 2 x param_bytes (AdamW's two moments).
    """
    cols = {name: _per_block(v, n, name) for name, v in dict(
        fwd_s=fwd_s, bwd_s=bwd_s, act_bytes=act_bytes, param_bytes=param_bytes,
        in_bytes=in_bytes, out_bytes=out_bytes, host_step_s=host_step_s,
        device_step_s=device_step_s, allreduce_s=allreduce_s).items()}
    optim = (_per_block(optim_bytes, n, "optim_bytes") if optim_bytes is not None
             else [2 * p for p in cols["param_bytes"]])
    shared = _per_block(shared_from, n, "shared_from") if shared_from is not None else [()] * n
    blocks = tuple(
        BlockCost(name=f"b{i}", fwd_s=cols["fwd_s"][i], bwd_s=cols["bwd_s"][i],
                  param_bytes=cols["param_bytes"][i], shared_from=shared[i],
                  optim_bytes=optim[i], act_bytes=cols["act_bytes"][i],
                  in_bytes=cols["in_bytes"][i], out_bytes=cols["out_bytes"][i],
                  host_step_s=cols["host_step_s"][i], device_step_s=cols["device_step_s"][i],
                  allreduce_s=cols["allreduce_s"][i])
        for i in range(n))
    return Problem(blocks=blocks, h2d_bytes_per_s=link_bytes_per_s,
                   d2h_bytes_per_s=link_bytes_per_s, input_bytes=input_bytes,
                   loss_act_bytes=loss_act_bytes, loss_s=loss_s, host_mem_bytes=host_mem_bytes,
                   pinned_mem_bytes=pinned_mem_bytes, world_size=world_size, dtype="fp32")


def random_problem(rng: random.Random, n: int, world_size: int = 1) -> Problem:
    """A transformer-ish chain with some variety: blocks with and without weights, the last
    block sharing block 0's weights (tied embeddings) half the time, a PCIe-ish link."""
    params = [rng.choice([0, rng.randint(50, 400) * 10**6]) for _ in range(n)]
    tied = n > 1 and params[0] > 0 and rng.random() < 0.5
    shared = [()] * (n - 1) + [((0, params[0]),) if tied else ()]
    link = rng.choice([2e9, 6e9, 12e9])
    problem = chain(
        n,
        fwd_s=[rng.uniform(0.05, 1.0) for _ in range(n)],
        bwd_s=[rng.uniform(0.1, 2.0) for _ in range(n)],
        act_bytes=[rng.randint(100, 2000) * 10**6 for _ in range(n)],
        param_bytes=params,
        in_bytes=[rng.randint(0, 100) * 10**6 for _ in range(n)],
        out_bytes=[rng.randint(0, 100) * 10**6 for _ in range(n)],
        host_step_s=[p / 3e9 for p in params],
        device_step_s=[7 * p / 8e11 for p in params],
        allreduce_s=[2 * 0.75 * p / 1.25e10 if world_size > 1 else 0.0 for p in params],
        shared_from=shared,
        link_bytes_per_s=link,
        input_bytes=10**7,
        loss_act_bytes=5 * 10**7,
        loss_s=0.01,
        host_mem_bytes=rng.choice([HUGE, 4 * GB]),
        pinned_mem_bytes=rng.choice([HUGE, 2 * GB]),
        world_size=world_size,
    )
    problem = with_shared_outputs(problem, [rng.choice([0, rng.randint(10, 200) * 10**6])
                                            for _ in range(n - 1)])
    # drawn apart, so that the other draws stay those the cases were chosen with
    problem = with_selective(problem, random.Random(f"selective {n} {world_size} {link}"))
    return with_pairs(problem, random.Random(f"pairs {n} {world_size} {link}"))


def with_pairs(problem: Problem, rng: random.Random) -> Problem:
    """Most blocks able to recompute in one checkpoint with the next (BlockCost.joins_next)."""
    n = len(problem.blocks)
    return dataclasses.replace(problem, blocks=tuple(
        dataclasses.replace(b, joins_next=i + 1 < n and rng.random() < 0.7)
        for i, b in enumerate(problem.blocks)))


def with_selective(problem: Problem, rng: random.Random) -> Problem:
    """Most blocks selective-capable under one to three policies, each keeping part of what it
    saves (some more than it saves: outputs autograd does not save) and recomputing the rest
    in part of its forward's time, the next keeping less and recomputing more; the others
    cannot run under a policy."""
    blocks = []
    for b in problem.blocks:
        if rng.random() < 0.25:
            blocks.append(b)
            continue
        policies = []
        kept, share = b.act_bytes * rng.uniform(0.2, 1.1), rng.uniform(0.05, 0.6)
        for least in (0, 64, 512)[:rng.randint(1, 3)]:  # each keeps less, recomputes more
            policies.append(SelectiveCost(
                policy=f"save-matmuls@{least}" if least else "save-matmuls",
                kept_bytes=int(kept),
                recompute_bytes=max(0, b.act_bytes + b.shared_made_bytes
                                    - min(int(kept), b.act_bytes)),
                recompute_s=b.fwd_s * share))
            kept, share = kept * rng.uniform(0.3, 0.8), min(1.0, share * rng.uniform(1.2, 2.0))
        blocks.append(dataclasses.replace(b, selective=tuple(policies)))
    return dataclasses.replace(problem, blocks=tuple(blocks))


def with_shared_outputs(problem: Problem, shared: list[int]) -> Problem:
    """Block i's last shared[i] saved bytes also saved by block i + 1 as its input (a ResNet
    bottleneck's final relu output, the next one's first conv input)."""
    blocks = list(problem.blocks)
    for i, nbytes in enumerate(shared):
        blocks[i] = dataclasses.replace(
            blocks[i], shared_saved_bytes=blocks[i].shared_saved_bytes + nbytes,
            shared_made_bytes=blocks[i].shared_made_bytes + nbytes)
        nxt = blocks[i + 1]
        blocks[i + 1] = dataclasses.replace(
            nxt, shared_saved_bytes=nxt.shared_saved_bytes + nbytes,
            in_bytes=nxt.in_bytes + nbytes, held_in_bytes=nxt.held_in_bytes + nbytes)
    held = tuple(HeldSaved(i, i, i + 1, nbytes) for i, nbytes in enumerate(shared) if nbytes)
    return dataclasses.replace(problem, blocks=tuple(blocks), held_saved=held)


def keep_all_peak(problem: Problem) -> int:
    return evaluate(problem, keep_all(problem, HUGE), HUGE).stage_peak_bytes


def all_plans(problem: Problem):
    """Every plan: each block's valid choice, each pair's second block marked (mark_pairs;
    None where a pair has no second)."""
    return filter(None, map(mark_pairs, itertools.product(
        *(valid_choices(problem, i) for i in range(len(problem.blocks))))))


def brute_force(problem: Problem, capacity: int) -> Evaluation | None:
    """The fastest feasible plan, by simulating every plan."""
    best = None
    for choices in all_plans(problem):
        ev = evaluate(problem, Plan("brute", choices), capacity)
        if ev.feasible and (best is None or ev.serial_step_s < best.serial_step_s):
            best = ev
    return best


def objective_s(plan: Plan) -> float:
    """The solver's objective, as the ILP records it in plan.note ("... objective X s")."""
    return float(plan.note.split("objective ")[1].split()[0])


# --- optima worked out by hand ----------------------------------------------------------


def test_ample_memory_keeps_everything():
    # 3 blocks of 1 GB activations, 0.1 GB weights (0.2 GB AdamW state), a 0.5 GB/s link.
    # With memory to spare, nothing a choice adds can make the step shorter:
    #   swap of block 0 or 1: 1 GB at 0.5 GB/s = 2 s on d2h next to a 1 s forward: +1 s;
    #   recompute: +1 s (a forward) in the block's backward stage;
    #   host optimizer (needed by streamed weights): a 1000 s host step after the backward.
    # So every block keeps, resident, device-stepped: n forwards, then n backwards each
    # followed by its 0.01 s device step on the compute stream:
    #   3 * (1 + 2 + 0.01) = 9.03 s.
    problem = chain(3, fwd_s=1.0, bwd_s=2.0, act_bytes=GB, param_bytes=GB // 10,
                    device_step_s=0.01, link_bytes_per_s=0.5e9)
    plan = solve_ilp(problem, HUGE, gap=0.0)
    ev = evaluate(problem, plan, HUGE)
    assert plan.choices == (KEEP, KEEP, KEEP)
    assert plan.status == "optimal"
    assert ev.serial_step_s == pytest.approx(9.03, rel=1e-9)
    assert ev.serial_step_s == pytest.approx(evaluate(problem, keep_all(problem, HUGE), HUGE)
                                           .serial_step_s, rel=1e-9)


def _three_blocks(link_bytes_per_s: float) -> Problem:
    # Blocks 0 and 1 are heavy, block 2 (say, a head) is light: forward 1, 1.2, 0.2 s,
    # backward 2, 2, 0.4 s; 1 GB of activations each; no weights, no inter-block tensors.
    return chain(3, fwd_s=[1.0, 1.2, 0.2], bwd_s=[2.0, 2.0, 0.4], act_bytes=GB,
                 link_bytes_per_s=link_bytes_per_s)


# Stages of a 3-block chain: 0 prologue, 1-3 forward of blocks 0-2, 4-6 backward of blocks
# 2-0, 7 epilogue, 8 update. keep_all's activations: block 0 lives in stages 1-6, block 1 in
# 2-5, block 2 in 3-4; the peak, 3 GB, is in stages 3 and 4.
KEEP_ALL_S = (1.0 + 1.2 + 0.2) + (2.0 + 2.0 + 0.4)  # 6.8 s: compute-bound


def test_stage_memory_of_keep_all_by_hand():
    problem = _three_blocks(2e9)
    assert stage_memory(problem, [KEEP] * 3) == [0, GB, 2 * GB, 3 * GB, 3 * GB, 2 * GB, GB, 0, 0]
    assert evaluate(problem, keep_all(problem, HUGE), HUGE).serial_step_s == pytest.approx(
        KEEP_ALL_S, rel=1e-9)


def test_a_hidden_swap_costs_nothing():
    # Budget 2 GB (+ slack): stages 3 and 4 must drop one activation. What fits:
    #   swap block 0: live in stages 1-2 (swap-out in stage 2) and 5-6 (swap-in in stage 5);
    #   recompute block 0 (+1 s) or block 1 (+1.2 s);
    #   not swap block 1 (it is still live in stage 3, where it is copied out, and back from
    #   stage 4); not recompute block 2 (its rebuilt activations live in stage 4).
    # At 2 GB/s a swap moves 1 GB in 0.5 s: block 0's swap-out hides behind block 1's 1.2 s
    # forward (stage 2), its swap-in behind block 1's 2 s backward (stage 5). So exactly block
    # 0 swaps, and the time is keep_all's 6.8 s. (Also swapping block 1 would fit but cost
    # 0.3 s + 0.1 s: its copies sit next to block 2's 0.2 s forward and 0.4 s backward.)
    problem = _three_blocks(2e9)
    plan = solve_ilp(problem, 2 * GB + SLACK, gap=0.0)
    ev = evaluate(problem, plan, 2 * GB + SLACK)
    assert plan.choices == (SWAP, KEEP, KEEP)
    assert ev.serial_step_s == pytest.approx(KEEP_ALL_S, rel=1e-9)
    assert ev.stage_peak_bytes == 2 * GB
    assert ev.feasible


def test_a_slow_link_recomputes_instead():
    # The same, at 0.05 GB/s: a swap takes 20 s each way, exposing 18.8 s + 18 s. Recomputing
    # block 0 costs its 1 s forward once more, block 1 its 1.2 s: block 0 recomputes.
    #   6.8 + 1.0 = 7.8 s
    problem = _three_blocks(0.05e9)
    plan = solve_ilp(problem, 2 * GB + SLACK, gap=0.0)
    ev = evaluate(problem, plan, 2 * GB + SLACK)
    assert plan.choices == (RECOMPUTE, KEEP, KEEP)
    assert ev.serial_step_s == pytest.approx(KEEP_ALL_S + 1.0, rel=1e-9)
    assert ev.feasible


def test_no_pinned_memory_for_a_swap_recomputes_instead():
    # The fast link of the hidden-swap case, but pinned host memory for half of one block's
    # activations: no swap fits on the host, so block 0 recomputes (+1 s), as on a slow link.
    problem = dataclasses.replace(_three_blocks(2e9), pinned_mem_bytes=GB // 2)
    cap = 2 * GB + SLACK
    plan = solve_ilp(problem, cap, gap=0.0)
    ev = evaluate(problem, plan, cap)
    assert plan.choices == (RECOMPUTE, KEEP, KEEP)
    assert ev.serial_step_s == pytest.approx(KEEP_ALL_S + 1.0, rel=1e-9)
    assert not evaluate(problem, Plan("x", (SWAP, KEEP, KEEP)), cap).feasible


def _weights_problem() -> Problem:
    # 2 blocks with 1 GB of weights each (2 GB of AdamW state) and 0.5 GB of activations;
    # forward 2 and 0.25 s, backward 3 and 0.5 s; a 1 GB/s link (1 s per block's weights);
    # a 0.5 s host step per block.
    return chain(2, fwd_s=[2.0, 0.25], bwd_s=[3.0, 0.5], act_bytes=GB // 2, param_bytes=GB,
                 host_step_s=0.5, device_step_s=0.01, link_bytes_per_s=1e9)


def test_streaming_weights_is_the_only_way_to_fit():
    # Stages: 0 prologue, 1 fwd 0, 2 fwd 1, 3 bwd 1, 4 bwd 0, 5 epilogue, 6 update.
    # Budget 4 GB (+ slack) = 3 x weights + 2 x activations.
    # Without streaming, stage 4 (block 0's backward) holds both blocks' weights, both
    # gradients (block 1's wait in stage 4 for their copy to the host) and block 0's
    # activations, whatever their choice: >= 4.5 GB. Streaming block 1 (the last block keeps
    # its forward copy, fetched in stage 1, through its backward in stage 3) drops it from
    # stage 4; stage 3 then holds w0, w1, grad 1 and both activations: exactly 4 GB.
    # Block 0 may stay resident (host-stepped) or stream too; on the device optimizer its
    # 2 GB of state never fits. Time, resident block 0 (stage durations):
    #   0: nothing          1: fwd 0 (2) | fetch w1 (1)            2
    #   2: fwd 1 (0.25)                                             0.25
    #   3: bwd 1 (0.5)                                              0.5
    #   4: bwd 0 (3) | grads 1 to host (1)                          3
    #   5: grads 0 to host (1)                                      1      -> stages end 6.75
    #   host step 1 after stage 4 (5.75 + 0.5 = 6.25), host step 0 after stage 5 (7.25),
    #   then block 0's upload (1 s): 8.25 s.
    # Streaming block 0 too adds its fetches: 1 s in the prologue and 0.5 s in stage 3 (1 s
    # next to a 0.5 s backward), and saves the upload: 8.75 s. Any swap or recompute adds
    # time (block 0's swap-out, 0.5 s, sits next to a 0.25 s forward).
    problem = _weights_problem()
    cap = 4 * GB + SLACK
    for choices in all_plans(problem):
        if all(c.weights == "resident" for c in choices):
            assert max(stage_memory(problem, list(choices))) > cap, choices
    plan = solve_ilp(problem, cap, gap=0.0)
    ev = evaluate(problem, plan, cap)
    assert plan.choices == (Choice("keep", "resident", "host"), Choice("keep", "streamed", "host"))
    assert ev.serial_step_s == pytest.approx(8.25, rel=1e-9)
    assert ev.stage_peak_bytes == 4 * GB
    both = evaluate(problem, Plan("x", (Choice("keep", "streamed", "host"),) * 2), cap)
    assert both.feasible and both.serial_step_s == pytest.approx(8.75, rel=1e-9)


# --- the ILP against brute force, the simulator and the baselines ------------------------


@pytest.mark.parametrize("seed", first_fast(range(8)))
def test_ilp_equals_brute_force_on_three_blocks(seed):
    rng = random.Random(seed)
    problem = random_problem(rng, 3, world_size=rng.choice([1, 4]))
    low, high = min_capacity_bytes(problem), keep_all_peak(problem)
    for cap in (low, (low + high) // 2):
        best = brute_force(problem, cap)
        assert best is not None
        ev = evaluate(problem, solve_ilp(problem, cap, gap=0.0), cap)
        assert ev.feasible
        assert ev.serial_step_s == pytest.approx(best.serial_step_s, rel=1e-7, abs=1e-9)


def test_objective_is_the_simulated_step_time():
    problem = random_problem(random.Random(8), 8)
    low, high = min_capacity_bytes(problem), keep_all_peak(problem)
    for cap in (low, (2 * low + high) // 3, (low + 2 * high) // 3):
        plan = solve_ilp(problem, cap, gap=0.0)
        assert plan.status == "optimal"
        # the note keeps 6 decimals
        assert evaluate(problem, plan, cap).serial_step_s == pytest.approx(
            objective_s(plan), rel=1e-7, abs=1e-6)


@pytest.mark.parametrize("seed, n, world_size", [(1, 5, 1), (2, 6, 1), (3, 6, 4), (4, 7, 1),
                                                 (5, 5, 4)])
def test_ilp_is_never_slower_than_a_feasible_baseline(seed, n, world_size):
    problem = random_problem(random.Random(seed), n, world_size)
    low, high = min_capacity_bytes(problem), keep_all_peak(problem)
    for frac in (0.0, 0.25, 0.5, 0.75, 1.0):
        cap = int(low + frac * (high - low))
        baselines = [evaluate(problem, fn(problem, cap), cap) for fn in BASELINES.values()]
        feasible = [b for b in baselines if b.feasible]
        best = min(feasible, key=lambda b: b.serial_step_s, default=None)
        exact = evaluate(problem, solve_ilp(problem, cap, gap=0.0), cap)
        # the pipeline's way: the default gap, starting from the best baseline
        started = evaluate(problem, solve_ilp(problem, cap, start=best.plan if best else None),
                           cap)
        for ev in (exact, started):
            assert ev.feasible
            assert ev.stage_peak_bytes <= cap
            assert ev.peak_device_bytes <= ev.stage_peak_bytes
            for b in feasible:
                assert ev.serial_step_s <= b.serial_step_s + 1e-9, b.plan.strategy
        for b in baselines:
            assert b.peak_device_bytes <= b.stage_peak_bytes, b.plan.strategy
        assert exact.plan.choices[-1].act != "swap"


def test_time_never_increases_with_capacity():
    problem = random_problem(random.Random(11), 7)
    low, high = min_capacity_bytes(problem), keep_all_peak(problem)
    times = []
    for k in range(12):
        cap = low + (high - low) * k // 11
        plan = solve_ilp(problem, cap, gap=0.0)
        ev = evaluate(problem, plan, cap)
        assert ev.feasible, cap
        times.append(ev.serial_step_s)
    for smaller, larger in itertools.pairwise(times):
        assert larger <= smaller + 1e-9
    # at keep_all's peak keep_all fits (the host optimizer may still beat it: it takes the
    # device steps off the compute stream)
    assert times[-1] <= evaluate(problem, keep_all(problem, high), high).serial_step_s + 1e-9
    assert times[0] > times[-1]  # the sweep is not flat: the budget binds at its low end


# --- the smallest budget --------------------------------------------------------------


def test_min_capacity_is_the_smallest_budget_any_plan_fits_rounded_up_to_a_mib():
    problem = random_problem(random.Random(3), 3)
    fits = [max(stage_memory(problem, list(choices))) for choices in all_plans(problem)
            if evaluate(problem, Plan("x", choices), HUGE).feasible]
    assert min_capacity_bytes(problem) == math.ceil(min(fits) / MIB) * MIB


def test_below_min_capacity_is_infeasible_and_min_capacity_solves():
    problem = random_problem(random.Random(4), 6)
    need = min_capacity_bytes(problem)
    with pytest.raises(InfeasiblePlan) as exc:
        solve_ilp(problem, need - MIB)  # under the true minimum: need is it rounded up
    assert exc.value.min_capacity_bytes == need
    assert exc.value.exit_code == 3
    assert format_bytes(need) in str(exc.value)
    ev = evaluate(problem, solve_ilp(problem, need), need)
    assert ev.feasible


def test_non_positive_capacity_is_a_value_error():
    with pytest.raises(ValueError, match="capacity_bytes"):
        solve_ilp(chain(2), 0)


# The last bytes of a budget. The solver sees memory in GiB and accepts constraints that hold
# within its feasibility tolerance (~1e-7 GiB, ~100 bytes).


@pytest.mark.parametrize("under_bytes", [1, 50])
def test_ilp_plan_fits_a_budget_a_few_bytes_under_a_better_plans_peak(under_bytes):
    # Slow link: keep_all (6.8 s, 3 GB) beats every plan that fits under 3 GB (7.8 s). A few
    # bytes under 3 GB the ILP must recompute, not return keep_all as if it fitted.
    problem = _three_blocks(0.05e9)
    cap = 3 * GB - under_bytes
    ev = evaluate(problem, solve_ilp(problem, cap, gap=0.0), cap)
    assert ev.stage_peak_bytes <= cap
    assert ev.serial_step_s == pytest.approx(KEEP_ALL_S + 1.0, rel=1e-9)


def test_ilp_takes_a_plan_that_fits_the_budget_exactly():
    # Slow link, budget = keep_all's peak: keep_all fits (6.8 s) and nothing is faster.
    problem = _three_blocks(0.05e9)
    cap = 3 * GB
    best = evaluate(problem, keep_all(problem, cap), cap)
    assert best.feasible
    ev = evaluate(problem, solve_ilp(problem, cap, gap=0.0, start=best.plan), cap)
    assert ev.serial_step_s <= best.serial_step_s + 1e-9


def test_ilp_respects_pinned_memory_to_the_byte():
    # The hidden-swap case (swap block 0, 1 GB pinned) with one byte less pinned memory.
    problem = dataclasses.replace(_three_blocks(2e9), pinned_mem_bytes=GB - 1)
    cap = 2 * GB + SLACK
    ev = evaluate(problem, solve_ilp(problem, cap, gap=0.0), cap)
    assert ev.pinned_bytes <= problem.pinned_mem_bytes


# --- the last block, and the simulator's checks ------------------------------------------


def test_last_block_has_no_swap_choice_and_no_plan_swaps_it():
    problem = random_problem(random.Random(6), 4)
    assert all(c.act != "swap" for c in valid_choices(problem, 3))
    assert any(c.act == "swap" for c in valid_choices(problem, 2))
    assert BASELINES["swap_all"](problem, HUGE).choices[-1] == KEEP
    # Even where swapping looks free (a fast link, a tight budget), the ILP never swaps it.
    fast = dataclasses.replace(problem, h2d_bytes_per_s=1e15, d2h_bytes_per_s=1e15)
    low, high = min_capacity_bytes(fast), keep_all_peak(fast)
    for cap in (low, (low + high) // 2):
        assert solve_ilp(fast, cap, gap=0.0).choices[-1].act != "swap"


def test_evaluate_rejects_a_swap_of_the_last_block():
    # Its swap-in would be issued in the stage of its own forward, before the swap-out.
    problem = _three_blocks(2e9)
    with pytest.raises((ValueError, ScheduleError), match="cannot swap back in"):
        evaluate(problem, Plan("x", (KEEP, KEEP, SWAP)), HUGE)
    # nor can the block before it prefetch two stages ahead: one block follows it
    with pytest.raises(ValueError, match="only 1 block"):
        evaluate(problem, Plan("x", (KEEP, Choice("swap", ahead=2), KEEP)), HUGE)


def _swap_block_0_schedule():
    # Slow link: block 0's swap-in (20 s) outlasts block 1's backward (2 s), so only the
    # dependency on the swap-in keeps block 0's backward waiting.
    problem = _three_blocks(0.05e9)
    ev = evaluate(problem, Plan("x", (SWAP, KEEP, KEEP)), HUGE)
    ops = list(ev.ops)
    swap_in = next(o for o in ops if o.kind == "swap_in" and o.block == 0)
    backward = next(o for o in ops if o.kind == "backward" and o.block == 0)
    return ev, ops, swap_in, backward


def test_simulate_rejects_a_buffer_used_before_it_is_filled():
    ev, ops, swap_in, backward = _swap_block_0_schedule()
    assert swap_in.id in backward.deps
    simulate(ops, ev.buffers)  # as lowered: valid
    ops[backward.id] = dataclasses.replace(
        backward, deps=tuple(d for d in backward.deps if d != swap_in.id))
    with pytest.raises(ScheduleError, match=r"before buffer act\.0@in is filled"):
        simulate(ops, ev.buffers)


def test_simulate_rejects_a_buffer_used_after_it_is_freed():
    ev, ops, swap_in, backward = _swap_block_0_schedule()
    # free block 0's swapped-in activations with block 2's backward, before block 0's uses them
    early = next(o for o in ops if o.kind == "backward" and o.block == 2)
    buffers = [dataclasses.replace(b, free=early.id) if b.name == "act.0@in" else b
               for b in ev.buffers]
    with pytest.raises(ScheduleError, match=r"uses buffer act\.0@in after"):
        simulate(ops, buffers)


def test_simulate_rejects_ops_out_of_issue_order():
    ev, ops, swap_in, backward = _swap_block_0_schedule()
    first = ops[0]
    ops[0] = dataclasses.replace(first, deps=(backward.id,))
    with pytest.raises(ScheduleError, match="depends on a later op"):
        simulate(ops, ev.buffers)


# --- scale ------------------------------------------------------------------------------


@pytest.mark.slow
def test_500_block_chain_solves():
    # A 2 GB/s link and 30% of keep_all's peak: the budget binds (the plan is slower than
    # keep_all) and swaps, recomputes and streamed weights all appear.
    problem = random_problem(random.Random(500), 500)
    problem = dataclasses.replace(problem, h2d_bytes_per_s=2e9, d2h_bytes_per_s=2e9,
                                  host_mem_bytes=HUGE, pinned_mem_bytes=HUGE)
    cap = keep_all_peak(problem) * 3 // 10
    baselines = [evaluate(problem, fn(problem, cap), cap) for fn in BASELINES.values()]
    best = min((b for b in baselines if b.feasible), key=lambda b: b.serial_step_s)
    started = time.perf_counter()
    plan = solve_ilp(problem, cap, time_limit_s=45.0, start=best.plan)  # the default gap
    elapsed = time.perf_counter() - started
    print(f"500 blocks: {plan.status} in {elapsed:.1f} s (CBC {plan.solve_s:.1f} s); "
          f"{plan.note}; {plan.counts()}; best baseline {best.plan.strategy} "
          f"{best.serial_step_s:.3f} s")
    assert plan.status in ("optimal", "time-limit")
    assert len(plan.choices) == 500
    ev = evaluate(problem, plan, cap)
    assert ev.feasible
    assert ev.serial_step_s <= best.serial_step_s + 1e-9
    assert ev.serial_step_s > evaluate(problem, keep_all(problem, HUGE), HUGE).serial_step_s


def test_a_swap_in_issued_two_stages_ahead_hides_behind_a_longer_backward():
    # 4 blocks: forward 3, 3, 0.1, 0.1 s; backward 0.5, 0.2, 3, 0.5 s; activations 1, 1,
    # 0.1, 1 GB; a 1 GB/s link (1 s per GB). Stages: 0 prologue, 1-4 forward of blocks 0-3
    # (F0-F3), 5-8 backward of blocks 3-0 (B3-B0). keep_all holds 3.1 GB in F3 and B3 and at
    # most 2.1 GB elsewhere; the budget, 2.2 GB, needs 0.9 GB out of F3 and B3. Options:
    #   recompute block 0 or 1: +3 s; block 3 cannot (its recompute lands in B3);
    #   swap block 1: out in F2 (0.1 s of compute: +0.9 s); in at B2, or at B3 (too full);
    #   swap block 0: out in F1 (3 s: hidden); in at B1 (0.2 s: +0.8 s) one stage ahead,
    #   or at B2 (3 s: hidden) two stages ahead, where 2.1 GB leave room for it.
    # So the planner swaps block 0 (the ILP, one stage ahead: +0.8 s), then issues its
    # swap-in two stages ahead (refine_prefetch, a pass after the solve), at keep_all's time.
    problem = chain(4, fwd_s=[3.0, 3.0, 0.1, 0.1], bwd_s=[0.5, 0.2, 3.0, 0.5],
                    act_bytes=[GB, GB, GB // 10, GB], link_bytes_per_s=1e9)
    keep_s = (3.0 + 3.0 + 0.1 + 0.1) + (0.5 + 0.2 + 3.0 + 0.5)
    cap = 2 * GB + GB // 5
    solved = solve_ilp(problem, cap, gap=0.0)
    assert solved.choices[0] == Choice("swap", ahead=1)
    plan = refine_prefetch(problem, solved, cap)
    assert plan.choices[0] == Choice("swap", ahead=2)
    # nothing recomputed (a swap of block 2's 0.1 GB hides too: a tie the solver may take)
    assert all(c.act != "recompute" for c in plan.choices[1:])
    assert evaluate(problem, plan, cap).serial_step_s == pytest.approx(keep_s, rel=1e-9)
    one_ahead = Plan("x", (Choice("swap", ahead=1),) + plan.choices[1:])
    assert evaluate(problem, one_ahead, cap).serial_step_s == pytest.approx(keep_s + 0.8,
                                                                         rel=1e-9)


@pytest.mark.parametrize("optim", ["device", "host"])
def test_every_update_reads_gradients_after_their_all_reduce(optim):
    # A slow network: an update that did not wait for its block's all-reduce would start first.
    problem = chain(4, param_bytes=GB, allreduce_s=50.0, host_step_s=0.1, world_size=4)
    weights = "resident" if optim == "device" else "streamed"
    ev = evaluate(problem, Plan("x", (Choice("keep", weights, optim),) * 4), HUGE)
    sim = simulate(ev.ops, ev.buffers)
    done = {o.block: sim.end_s[o.id] for o in ev.ops if o.kind == "allreduce"}
    readers = [o for o in ev.ops if o.kind in ("device_step", "grads_to_host")]
    assert len(readers) == 4 and len(done) == 4
    for o in readers:
        assert sim.start_s[o.id] >= done[o.block], (o.kind, o.block)


# --- saved tensors several blocks hold ----------------------------------------------------


def test_a_shared_saved_tensor_is_held_until_the_backward_of_a_reader_that_keeps_it():
    # Three 1 GB blocks; block 0's last 0.5 GB is also block 1's input, which it saves.
    # Stages: 0 prologue, 1-3 forwards, 4 bwd 2, 5 bwd 1, 6 bwd 0, 7 epilogue, 8 update.
    G, half = GB, GB // 2
    problem = with_shared_outputs(chain(3, act_bytes=G), [half, 0])
    # all keep: the 0.5 GB counted once, from block 0's forward to its backward
    assert stage_memory(problem, [KEEP] * 3) == [
        0, G + half, 2 * G + half, 3 * G + half, 3 * G + half, 2 * G + half, G + half, 0, 0]
    # block 1 swaps: out go its own 1 GB and a copy of the 0.5 GB; its swap-in (stage 4)
    # brings back 1.5 GB beside the original, which block 0 still holds
    swap1 = stage_memory(problem, [KEEP, SWAP, KEEP])
    assert swap1[4] == G + G + (G + half) + half  # act 0, act 2, act 1 back in, shared
    ops = evaluate(problem, Plan("x", (KEEP, SWAP, KEEP)), HUGE).ops
    assert {op.bytes for op in ops if op.kind in ("swap_out", "swap_in")} == {G + half}
    # block 0 recomputes: the original is held until block 1's backward (stage 5), then
    # block 0's recompute makes it again with its own 1 GB (stage 6)
    assert stage_memory(problem, [RECOMPUTE, KEEP, KEEP]) == [
        0, half, G + half, 2 * G + half, 2 * G + half, G + half, G + half, 0, 0]
    # block 1 recomputes: its checkpoint is the held tensor, nothing more
    assert stage_memory(problem, [KEEP, RECOMPUTE, KEEP]) == [
        0, G + half, G + half, 2 * G + half, 2 * G + half, 2 * G + half, G + half, 0, 0]


def test_ilp_objective_and_memory_match_the_simulator_with_shared_saved_tensors():
    problem = random_problem(random.Random(11), 6)
    assert problem.held_saved
    low, high = min_capacity_bytes(problem), keep_all_peak(problem)
    for cap in (low, (low + high) // 2):
        plan = solve_ilp(problem, cap, gap=0.0)
        ev = evaluate(problem, plan, cap)
        assert ev.feasible and ev.stage_peak_bytes <= cap
        assert ev.peak_device_bytes <= ev.stage_peak_bytes
        assert ev.serial_step_s == pytest.approx(objective_s(plan), rel=1e-7, abs=1e-6)


def test_a_problem_refuses_negative_process_bytes_and_held_spans_out_of_order():
    problem = chain(3)
    with pytest.raises(ValueError, match="process_bytes = -1 < 0"):
        dataclasses.replace(problem, process_bytes=-1)
    with pytest.raises(ValueError, match="held_saved"):
        dataclasses.replace(problem, held_saved=(HeldSaved(2, 1, 0, GB),))  # readers reversed
    with pytest.raises(ValueError, match="held_saved"):
        dataclasses.replace(problem, held_saved=(HeldSaved(0, 1, 2, GB),) * 2)  # twice
