"""Data parallelism on the CPU with gloo: two ranks train like one process averaging them.

Every schedule (baselines and the ILP at several budgets) of three small models, planned for
two ranks, trains three steps on two rank processes (one launch for all of them); the final
parameters must equal, to a relative 1e-6, those of karma.reference's data-parallel loop:
per step, each rank's batch forward and backward from its own RNG state, the gradients
averaged, one optimizer step.
"""

from __future__ import annotations

import json
from functools import cache

import pytest
import torch

from karma.planner.plan import InfeasiblePlan
from karma.schedule import dump_schedule
from tests.dist_helpers import finish, start_ranks
from tests.runtime_helpers import block_graph, load_small, plan, reference_train
from tests.test_runtime import MODELS, STEPS, STRATEGIES, load_model_pt

RANKS = 2
CASES = [(name, s, f) for name in MODELS for s, f in STRATEGIES]


def case_id(name: str, strategy: str, fraction: float) -> str:
    return f"{name}-{strategy}@{fraction:g}" if strategy == "ilp" else f"{name}-{strategy}"


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """(name, strategy, fraction) -> (schedule, its run's directory), for those that fit."""
    root = tmp_path_factory.mktemp("data-parallel")
    runs, cases = [], {}
    for name, strategy, fraction in CASES:
        try:
            schedule = plan(load_small(name), strategy, fraction, world_size=RANKS)
        except InfeasiblePlan:
            continue
        out = root / case_id(name, strategy, fraction)
        out.mkdir()
        (out / "schedule.yaml").write_text(dump_schedule(schedule))
        runs.append({"schedule": str(out / "schedule.yaml"), "out": str(out), "steps": STEPS})
        cases[(name, strategy, fraction)] = (schedule, out)
    job = root / "job.json"
    job.write_text(json.dumps({"runs": runs}))
    for rank, (code, _, stderr) in enumerate(
            finish(start_ranks(["-m", "tests.dist_worker", str(job)], RANKS), timeout_s=900)):
        assert code == 0, f"rank {rank} failed:\n{stderr[-4000:]}"
    return cases


@cache
def reference(name: str):
    """The data-parallel reference, on one thread like the ranks (torchrun's default)."""
    mf = load_small(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        from karma.reference import train_reference
        ref = train_reference(mf, block_graph(mf).batch_size, STEPS, world_size=RANKS)
    finally:
        torch.set_num_threads(threads)
    return {n: p.detach().clone() for n, p in ref.model.named_parameters()}, ref.rank_losses


def max_relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.double().abs().max().item()
    return (a.double() - b.double()).abs().max().item() / (scale or 1.0)


@pytest.mark.parametrize("name,strategy,fraction", CASES, ids=[case_id(*c) for c in CASES])
def test_two_ranks_equal_one_process_averaging_their_gradients(two_rank_runs, name, strategy,
                                                              fraction):
    if (name, strategy, fraction) not in two_rank_runs:
        pytest.skip(f"{strategy} does not fit {fraction:g} of keep_all on {name}")
    schedule, out = two_rank_runs[(name, strategy, fraction)]
    assert schedule.config.world_size == RANKS
    assert sum(op.kind == "allreduce" for op in schedule.ops) == sum(
        1 for b in schedule.blocks if b.params)
    ref_params, ref_losses = reference(name)

    saved = load_model_pt(out / "ckpt", STEPS)
    worst = {n: max_relative_difference(saved[n], ref) for n, ref in ref_params.items()}
    assert max(worst.values()) <= 1e-6, sorted(worst.items(), key=lambda kv: -kv[1])[:3]

    for rank in range(RANKS):  # every rank trained its own batches with the averaged updates
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert report["rank"] == rank and report["world_size"] == RANKS
        assert report["losses"] == pytest.approx(ref_losses[rank], rel=1e-6)
        assert len(report["allreduce_s"]) == STEPS
        for total, hidden in zip(report["allreduce_s"], report["allreduce_hidden_s"]):
            assert 0 < total and 0 <= hidden <= total
