"""Data parallelism on the CPU with gloo: two ranks train like one process averaging them.

Every schedule (baselines and the ILP at several budgets) of three small models, planned for
two ranks with sharded host state, and a few with replicated host state, trains three steps
on two rank processes (one launch for all of them); the final parameters must equal, bit for
bit, those of karma.reference's data-parallel loop: per step, each rank's batch forward and
backward from its own RNG state, the gradients averaged, one optimizer step (two ranks'
gradients sum in either order to the same bits, an all-reduce's or a reduce-scatter's). Four
ranks sum in another order than the reference: their difference is measured and bounded. Each run is also checked to keep the protocol the CUDA backend
relies on, the net stream's included (tests/protocol.py's checking backend, on every rank).
The same launch trains a few of them under chaos timing ([Note: chaos timing];
tests/test_chaos.py has the one-rank cases), bitwise equal to that loop, and a control with
one missing wait for an all-reduce.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest
import torch

from karma.reference import train_reference
from karma.runtime.checkpoints.checkpoint import latest_checkpoint
from karma.schedule import EXCHANGE_KINDS, dump_schedule
from karma.schedule_load import load_schedule
from karma.testing.exactness import assert_bitwise_equal, block_graph, plan
from karma.testing.exactness import host_stepped as stepped_on_host
from tests.dist_helpers import ROOT, finish, free_port, start_ranks, wait_for_line
from tests.matrix import MODELS, OPTIONS, STRATEGIES, cell_id, cells
from tests.runtime_helpers import load_small
from tests.test_runtime import STEPS, load_model_pt

RANKS = 2
# the training options a model is planned with: all of them, with its LR schedule, for the
# LR-scheduled MLP
TRAINING = {"mlp_schedule": OPTIONS["all"]}
# the examples under every strategy that fits on two ranks, a model with parameters that get
# no gradient, and one with bf16, accumulation, clipping and an LR schedule together; all in
# one two-rank launch (two_rank_runs), so all of it is slow
CASES = [(*c.values, "sharded") for c in cells(MODELS, STRATEGIES, world_size=RANKS)] + [
    (name, s, f, "sharded") for name in ("unused_frozen", "mlp_schedule")
    for s, f in (("keep_all", 1.0), ("offload_all", 1.0), ("ilp", 0.6))] + [
    # each rank a whole copy of the host state, as karma plans where that is faster
    (name, s, f, "replicated") for name in ("gpt", "mlp_schedule")
    for s, f in (("offload_all", 1.0), ("ilp", 0.6))]


def case_id(name: str, strategy: str, fraction: float, host_state: str) -> str:
    return f"{cell_id(name, strategy, fraction)}-{host_state}"


# Under chaos: a mix of device and host steps, fetches and gradients copied after their
# all-reduce (gpt), and all-reduces of host gradients accumulated over micro-batches, with
# clipping, bf16 and an LR schedule (mlp_schedule); three seeds each. The control: a gpt
# keep_all whose last device step no longer waits for its block's all-reduce.
CHAOS_CASES = [(name, "ilp", 0.6, state) for name in ("gpt", "mlp_schedule")
               for state in ("sharded", "replicated")]
CHAOS_SEEDS = (1, 2, 3)
CHAOS_PAUSE_MS = 5
CONTROL_PAUSE_MS = 20
CONTROL = ("gpt", "keep_all", 1.0)


@dataclass(frozen=True)
class TwoRankRuns:
    """What the launch trained: schedule and run directory of each case that fits."""

    plain: dict  # (name, strategy, fraction, host_state) -> (schedule, directory)
    chaos: dict  # (name, strategy, fraction, host_state, seed) -> directory


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> TwoRankRuns:
    root = tmp_path_factory.mktemp("data-parallel")
    runs, plain = [], {}

    def add(schedule, directory: str, **spec) -> Path:
        out = root / directory
        out.mkdir()
        (out / "schedule.yaml").write_text(dump_schedule(schedule))
        runs.append({"schedule": str(out / "schedule.yaml"), "out": str(out), "steps": STEPS,
                     **spec})
        return out

    for name, strategy, fraction, state in CASES:
        schedule = plan(load_small(name), strategy, fraction, world_size=RANKS,
                        host_state=state, **TRAINING.get(name, {}))
        case = (name, strategy, fraction, state)
        plain[case] = (schedule, add(schedule, case_id(*case)))
    chaos = {(*case, seed): add(plain[case][0], f"chaos-{case_id(*case)}-{seed}",
                                env={"KARMA_CHAOS": f"{seed}:{CHAOS_PAUSE_MS}"})
             for case in CHAOS_CASES for seed in CHAOS_SEEDS}
    job = root / "job.json"
    job.write_text(json.dumps({"runs": runs}))
    for rank, (code, _, stderr) in enumerate(
            finish(start_ranks(["-m", "tests.dist_worker", str(job)], RANKS), timeout_s=900)):
        assert code == 0, f"rank {rank} failed:\n{stderr[-4000:]}"
    return TwoRankRuns(plain, chaos)


@dataclass(frozen=True)
class ControlRun:
    """One launch of the control: its directory and each rank's exit code."""

    out: Path
    codes: tuple[int, ...]


@pytest.fixture(scope="module")
def control_runs(tmp_path_factory) -> tuple[int, dict[int, ControlRun]]:
    """The control (CONTROL with its last device step no longer waiting for its block's
    all-reduce) under chaos, one launch per seed: the race it sets up may end a rank with a
    crash (a device step and the all-reduce writing the same gradients at once), which must
    not take other runs with it. Returns the op that no longer waits, and each seed's run."""
    root = tmp_path_factory.mktemp("control")
    schedule = plan(load_small(CONTROL[0]), *CONTROL[1:], world_size=RANKS)
    step, reduce = (next(op.id for op in reversed(schedule.ops) if op.kind == kind)
                    for kind in ("device_step", "allreduce"))
    runs = {}
    for seed in CHAOS_SEEDS:
        out = root / f"control-{seed}"
        out.mkdir()
        (out / "schedule.yaml").write_text(dump_schedule(schedule))
        job = out / "job.json"
        job.write_text(json.dumps({"runs": [{
            "schedule": str(out / "schedule.yaml"), "out": str(out), "steps": STEPS,
            "drop_dep": [step, reduce], "env": {"KARMA_CHAOS": f"{seed}:{CONTROL_PAUSE_MS}"},
            "may_fail": True, "timeout_s": 20.0}]}))
        codes = tuple(code for code, _, _ in finish(
            start_ranks(["-m", "tests.dist_worker", str(job)], RANKS), timeout_s=300))
        runs[seed] = ControlRun(out, codes)
    return step, runs


@cache
def reference(name: str, **host):
    """The data-parallel reference, on one thread like the ranks (torchrun's default), `host`
    (host_stepped's) stepped as a schedule's host-stepped blocks."""
    mf = load_small(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = train_reference(mf, block_graph(mf).batch_size, STEPS, world_size=RANKS,
                              **TRAINING.get(name, {}), **host)
    finally:
        torch.set_num_threads(threads)
    return {n: p.detach().clone() for n, p in ref.model.named_parameters()}, ref.rank_losses


def max_relative_difference(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.double().abs().max().item()
    return (a.double() - b.double()).abs().max().item() / (scale or 1.0)


@pytest.mark.slow
@pytest.mark.parametrize("name,strategy,fraction,host_state", CASES,
                         ids=[case_id(*c) for c in CASES])
def test_two_ranks_equal_one_process_averaging_their_gradients(two_rank_runs, name, strategy,
                                                              fraction, host_state):
    schedule, out = two_rank_runs.plain[(name, strategy, fraction, host_state)]
    assert schedule.config.world_size == RANKS
    # one exchange per block (a block without weights sends nothing); sharded, the host
    # stepped blocks' is a reduce-scatter (an all-reduce with clipping) and an all-gather
    assert sorted(op.block for op in schedule.ops if op.kind in EXCHANGE_KINDS) == list(
        range(len(schedule.blocks)))
    host_stepped = sorted(b.index for b in schedule.blocks if b.optim == "host")
    gathered = sorted(op.block for op in schedule.ops if op.kind == "all_gather")
    assert gathered == (host_stepped if host_state == "sharded" else [])
    ref_params, ref_losses = reference(name, **stepped_on_host(schedule))

    assert_bitwise_equal(final_parameters(out, ref_params), ref_params)

    # every rank trained its own batches with the averaged updates (and karma-run checked
    # that the ranks' final parameters are equal: else the run would have failed)
    for rank in range(RANKS):
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert report["rank"] == rank and report["world_size"] == RANKS
        assert report["losses"] == ref_losses[rank]
        assert report["dist_backend"] == "gloo"
        assert not report["protocol"]["violations"], report["protocol"]["violations"][:5]
        assert 0 < report["protocol"]["collectives"] <= STEPS * len(schedule.blocks)
        assert len(report["allreduce_s"]) == STEPS
        for total, hidden in zip(report["allreduce_s"], report["allreduce_hidden_s"]):
            assert 0 < total and 0 <= hidden <= total
        # phased into the backward: compute ran on while some exchange was in flight
        assert sum(report["allreduce_hidden_s"]) > 0


def final_parameters(out: Path, ref_params: dict) -> dict[str, torch.Tensor]:
    saved = load_model_pt(out / "ckpt", STEPS)
    return {n: saved[n] for n in ref_params}


@pytest.mark.slow
@pytest.mark.parametrize("seed", CHAOS_SEEDS)
@pytest.mark.parametrize("name,strategy,fraction,host_state", CHAOS_CASES,
                         ids=[case_id(*c) for c in CHAOS_CASES])
def test_two_ranks_under_chaos_are_bitwise_the_averaged_loop(two_rank_runs, name, strategy,
                                                             fraction, host_state, seed):
    """The net stream's hand-offs (a block's backward to its all-reduce, the all-reduce to
    the device step or the copy to the host, host gradients to their all-reduce) hold under
    random pauses on both ranks, each rank pausing differently: bitwise, not to 1e-6 (two
    ranks' gradients sum in either order to the same bits)."""
    out = two_rank_runs.chaos[(name, strategy, fraction, host_state, seed)]
    schedule, _ = two_rank_runs.plain[(name, strategy, fraction, host_state)]
    ref_params, ref_losses = reference(name, **stepped_on_host(schedule))
    assert_bitwise_equal(final_parameters(out, ref_params), ref_params)
    for rank in range(RANKS):
        assert json.loads((out / f"rank{rank}.json").read_text())["losses"] == ref_losses[rank]


@pytest.mark.slow
def test_a_device_step_that_skips_its_all_reduce_is_caught_under_chaos(control_runs):
    """The control: gpt keep_all with its last device step no longer waiting for its block's
    all-reduce. Under chaos the step takes gradients that are not yet averaged (or the
    all-reduce writes into gradients already stepped): the ranks end with different
    parameters (karma-run stops, saying so) or wrong ones. When written, every run was caught,
    24 of 24 under chaos (the three seeds, eight times) and 8 of 8 without it: an all-reduce
    waits for the other rank, so a step that skips it nearly always runs first. On the net
    stream a missing wait shows without the pauses too; this control shows that the chaos
    runs above would see one. A rank that crashes (the step and the all-reduce writing the
    same gradients at once can end a rank with a segmentation fault) is caught too."""
    caught = []
    ref_params, _ = reference(CONTROL[0])
    control_op, runs = control_runs
    for seed, run in runs.items():
        if any(run.codes):  # a rank crashed
            caught.append(seed)
            continue
        reports = [json.loads((run.out / f"rank{rank}.json").read_text())
                   for rank in range(RANKS)]
        if any("error" in r for r in reports):
            caught.append(seed)
            continue
        try:
            assert_bitwise_equal(final_parameters(run.out, ref_params), ref_params)
        except AssertionError:
            caught.append(seed)
    assert caught, (f"chaos timing did not expose op {control_op}, a device step that skips "
                    "its all-reduce")


# --- four ranks ----------------------------------------------------------------------------

FOUR = [("gpt", "offload_all", 1.0), ("mlp", "ilp", 0.6)]


@pytest.fixture(scope="module", params=[4, 2], ids=["one-node", "two-nodes"])
def four_rank_runs(request, tmp_path_factory) -> dict:
    """FOUR planned for four ranks with sharded host state, trained in one launch: on one
    node of four, or on two nodes of two (LOCAL_RANK, LOCAL_WORLD_SIZE and GROUP_RANK as
    torchrun sets them), each with its own copy of the weights."""
    root = tmp_path_factory.mktemp("four-ranks")
    runs, outs = [], {}
    for case in FOUR:
        schedule = plan(load_small(case[0]), *case[1:], world_size=4, host_state="sharded")
        out = root / cell_id(*case)
        out.mkdir()
        (out / "schedule.yaml").write_text(dump_schedule(schedule))
        runs.append({"schedule": str(out / "schedule.yaml"), "out": str(out), "steps": STEPS})
        outs[case] = (schedule, out)
    job = root / "job.json"
    job.write_text(json.dumps({"runs": runs}))
    for rank, (code, _, stderr) in enumerate(
            finish(start_ranks(["-m", "tests.dist_worker", str(job)], 4,
                               per_node=request.param), timeout_s=600)):
        assert code == 0, f"rank {rank} failed:\n{stderr[-4000:]}"
    return outs


@pytest.mark.slow
@pytest.mark.parametrize("name,strategy,fraction", FOUR, ids=[cell_id(*c) for c in FOUR])
def test_four_ranks_differ_from_the_averaged_loop_only_in_summation_order(
        four_rank_runs, name, strategy, fraction):
    """Four ranks' gradients are summed by gloo's reduce-scatter in another order than the
    reference's (((a + b) + c) + d), so the parameters differ in the last bits, and AdamW
    carries that on. After three steps, taken as one vector (the model's parameters end to
    end), they are within 1e-6 of the reference relative to its largest element (measured:
    3.4e-7 for the GPT, 1.5e-8 for the MLP). Per tensor the GPT's attention biases differ
    most (1.1e-4 of their own largest element): the gradient of the key projection's bias is
    mathematically zero (it cancels in the softmax) and numerically noise of either sign,
    which AdamW turns into steps of full size (../shared/PYTORCH_NOTES.md)."""
    schedule, out = four_rank_runs[(name, strategy, fraction)]
    assert any(op.kind == "reduce_scatter" for op in schedule.ops)
    mf = load_small(name)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = train_reference(mf, block_graph(mf).batch_size, STEPS, world_size=4,
                              **stepped_on_host(schedule))
    finally:
        torch.set_num_threads(threads)
    ref_params = {n: p.detach() for n, p in ref.model.named_parameters()}
    saved = final_parameters(out, ref_params)
    ours = torch.cat([saved[n].double().flatten() for n in ref_params])
    theirs = torch.cat([p.double().flatten() for p in ref_params.values()])
    relative = ((ours - theirs).abs().max() / theirs.abs().max()).item()
    print(f"{name} {strategy} on 4 ranks, {STEPS} steps: largest difference from the "
          f"reference {relative:.3g} of its largest parameter")
    assert 0 <= relative <= 1e-6
    for rank in range(4):
        report = json.loads((out / f"rank{rank}.json").read_text())
        assert report["losses"] == pytest.approx(ref.rank_losses[rank], rel=1e-6)


# --- resuming at another world size -------------------------------------------------------

RESIZES = [("mlp", 2, 1), ("mlp", 1, 2), ("mlp", 2, 4), ("gpt", 2, 1)]


@pytest.mark.slow
@pytest.mark.parametrize("name,before,after", RESIZES,
                         ids=[f"{n}-{b}to{a}" for n, b, a in RESIZES])
def test_a_run_resumes_at_another_world_size(name, before, after, tmp_path):
    """Two steps on `before` ranks, a checkpoint, two more on `after` ranks from a schedule
    planned for them: the plain loop whose world size changes after step 2 (rank r of M then
    draws batches(B, r, M) from where two steps of batches end; every rank goes on with the
    random stream they all drew alike, which gpt's dropout shows). Bitwise up to two ranks;
    four sum in another order (within 1e-6, as test_four_ranks_... measures). The host steps
    as given: where the fused kernel cuts its work moves bits (reference.py, host_shards),
    and a world size that changes cuts it anew."""
    mf = load_small(name)
    ckpt, report = tmp_path / "ckpt", tmp_path / "report.json"
    for world, steps, extra in ((before, 2, ("--host-optimizer", "as-given")),
                                (after, 4, ("--host-optimizer", "as-given", "--resume",
                                            "--report", str(report)))):
        path = tmp_path / f"s{world}.yaml"
        state = "sharded" if world > 1 else "auto"
        schedule = plan(mf, "offload_all", 1.0, world_size=world, host_state=state)
        path.write_text(dump_schedule(schedule))
        procs = start_ranks(karma_run(str(path), "--steps", str(steps), "--checkpoint-dir",
                                      str(ckpt), *extra), world)
        for rank, (code, _, stderr) in enumerate(finish(procs, timeout_s=300)):
            assert code == 0, f"{world} ranks, rank {rank}: {stderr[-3000:]}"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = train_reference(mf, block_graph(mf).batch_size, 4, world_size=before,
                              resize=(2, after))
    finally:
        torch.set_num_threads(threads)
    ref_params = {n: p.detach() for n, p in ref.model.named_parameters()}
    saved = load_model_pt(ckpt, 4)
    resumed = json.loads(report.read_text())
    assert resumed["steps"] == [3, 4] and resumed["world_size"] == after
    if max(before, after) <= 2:
        assert_bitwise_equal({n: saved[n] for n in ref_params}, ref_params)
        assert resumed["losses"] == ref.losses[2:]
    else:
        ours = torch.cat([saved[n].double().flatten() for n in ref_params])
        theirs = torch.cat([p.double().flatten() for p in ref_params.values()])
        assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= 1e-6
        assert resumed["losses"] == pytest.approx(ref.losses[2:], rel=1e-6)


# --- two nodes on one machine -------------------------------------------------------------

def two_nodes(args: list[str], port: int) -> list[tuple[int, str, str]]:
    """`python -m karma.run ARGS` on two nodes of two ranks, each node its own torchrun
    (c10d rendezvous on this machine), as a cluster launches it."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("KARMA_")},
           "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
         "2", "--node-rank", str(node), "--rdzv-backend", "c10d", "--rdzv-endpoint",
         f"127.0.0.1:{port}", "-m", "karma.run", *args], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE) for node in (0, 1)]
    return finish(procs, timeout_s=300)


@pytest.mark.slow
def test_two_nodes_of_two_train_check_host_memory_save_and_resume(tmp_path):
    """Four ranks as two nodes of two (LOCAL_WORLD_SIZE 2 on each, a copy of the weights on
    each): two steps and a sharded checkpoint, then a resume to step 4 from a fresh launch;
    the plain loop of four ranks within 1e-6, each rank's host memory as the plan predicts
    for nodes of two."""
    mf = load_small("gpt")
    schedule = plan(mf, "offload_all", 1.0, world_size=4, host_state="sharded",
                    nproc_per_node=2)
    assert schedule.config.nproc_per_node == 2
    path, ckpt, report = tmp_path / "s.yaml", tmp_path / "ckpt", tmp_path / "r.json"
    path.write_text(dump_schedule(schedule))
    common = [str(path), "--checkpoint-dir", str(ckpt), "--report", str(report)]
    for steps, extra in ((2, ()), (4, ("--resume",))):
        for node, (code, _, stderr) in enumerate(two_nodes(
                [*common, "--steps", str(steps), *extra], free_port())):
            assert code == 0, f"node {node}: {stderr[-3000:]}"
    resumed = json.loads(report.read_text())
    assert resumed["steps"] == [3, 4] and resumed["world_size"] == 4
    assert len(resumed["rank_host_bytes"]) == 4
    for held in resumed["rank_host_bytes"]:  # 62 KiB over on this tiny GPT: see the 1/N test
        assert held == pytest.approx(resumed["predicted_host_bytes"], abs=128 << 10)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = train_reference(mf, block_graph(mf).batch_size, 4, world_size=4,
                              **stepped_on_host(schedule))
    finally:
        torch.set_num_threads(threads)
    ref_params = {n: p.detach() for n, p in ref.model.named_parameters()}
    saved = load_model_pt(ckpt, 4)
    ours = torch.cat([saved[n].double().flatten() for n in ref_params])
    theirs = torch.cat([p.double().flatten() for p in ref_params.values()])
    assert ((ours - theirs).abs().max() / theirs.abs().max()).item() <= 1e-6
    assert resumed["losses"] == pytest.approx(ref.losses[2:], rel=1e-6)


# --- host memory a rank ------------------------------------------------------------------

@pytest.mark.slow
def test_each_rank_holds_1_over_n_of_one_rank_s_host_state(tmp_path):
    """A GPT of 7.2M parameters whose every block steps on the host (offload_all): karma-run
    --report gives each rank's host memory at its peak (its tier's, and its share of the
    node's copy of the weights), which on N ranks of one node is 1/N of one rank's and what
    the plan predicts (bench/host_bytes.py does it for the 51.5M-parameter GPT, beside
    FSDP2)."""
    env = {"KARMA_GPT": "4x128x4", "KARMA_SEQ": "64"}
    measured = {}
    for n in (1, 2, 4):
        schedule, report = tmp_path / f"s{n}.yaml", tmp_path / f"r{n}.json"
        subprocess.run([sys.executable, "-m", "karma.cli.plan", str(ROOT / "examples" / "gpt.py"),
                        "--hardware", "cpu", "--gpu-mem", "1G", "--batch-size", "1",
                        "--world-size", str(n), "--strategy", "offload_all", "--no-measure",
                        "-o", str(schedule)], env={**os.environ, **env}, check=True,
                       capture_output=True)
        procs = start_ranks(karma_run(str(schedule), "--steps", "2", "--report", str(report)), n,
                            extra_env=env)
        for rank, (code, _, stderr) in enumerate(finish(procs, timeout_s=300)):
            assert code == 0, f"{n} ranks, rank {rank}: {stderr[-3000:]}"
        measured[n] = json.loads(report.read_text())
        assert len(measured[n]["rank_host_bytes"]) == n
    one = measured[1]["rank_host_bytes"][0]
    for n, doc in measured.items():
        for held in doc["rank_host_bytes"]:
            assert held <= 1.1 * one / n, (n, doc["rank_host_bytes"], one)
            assert held == pytest.approx(doc["predicted_host_bytes"], rel=0.05)


# --- launching, bad input and faults -------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_two_ranks(tmp_path_factory) -> str:
    """A schedule of the tiny GPT for two ranks, its host state sharded, written to a file."""
    path = tmp_path_factory.mktemp("gpt2") / "schedule.yaml"
    schedule = plan(load_small("gpt"), "ilp", 0.6, world_size=RANKS, host_state="sharded")
    assert any(op.kind == "all_gather" for op in schedule.ops)
    path.write_text(dump_schedule(schedule))
    return str(path)


def karma_run(*args: str) -> list[str]:
    return ["-m", "karma.run", *args]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 3])
def test_a_world_size_mismatch_names_both_numbers_and_the_fix(gpt_two_ranks, world_size):
    procs = start_ranks(karma_run(gpt_two_ranks, "--steps", "1"), world_size, ranks=[0])
    [(code, _, stderr)] = finish(procs, timeout_s=120)
    assert code == 2
    assert f"planned for 2 rank(s), but this run has {world_size}" in stderr
    assert "torchrun --nproc-per-node 2" in stderr and f"--world-size {world_size}" in stderr
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_an_unreachable_rendezvous_fails_within_the_timeout(gpt_two_ranks):
    start = time.monotonic()
    # rank 1 alone: nobody serves the rendezvous at MASTER_PORT
    procs = start_ranks(karma_run(gpt_two_ranks, "--steps", "1", "--timeout", "3"), RANKS,
                        ranks=[1])
    [(code, _, stderr)] = finish(procs, timeout_s=120)
    elapsed = time.monotonic() - start
    assert code == 2, stderr
    assert "rank 1 could not join the other 1 rank(s) at the rendezvous 127.0.0.1:" in stderr
    assert "within 3 s" in stderr and "Traceback" not in stderr
    # the timeout, plus starting Python and importing torch on a loaded machine; without the
    # watchdog the store's own retries take about twice the timeout
    assert elapsed < 3 + 30, elapsed


@pytest.mark.slow
def test_ranks_running_different_schedules_stop(gpt_two_ranks, tmp_path):
    other = tmp_path / "other.yaml"
    other.write_text(dump_schedule(plan(load_small("gpt"), "keep_all", world_size=RANKS)))
    port = free_port()
    procs = [start_ranks(karma_run(path, "--steps", "1"), RANKS, ranks=[r], port=port)[0]
             for r, path in enumerate([gpt_two_ranks, str(other)])]
    for code, _, stderr in finish(procs, timeout_s=120):
        assert code == 2
        assert "the ranks disagree on the schedule (ranks 0:" in stderr
        assert "copy one schedule to all machines" in stderr


@pytest.mark.slow
def test_ranks_started_with_different_options_stop(gpt_two_ranks):
    port = free_port()
    procs = [start_ranks(karma_run(gpt_two_ranks, "--steps", "1", "--seed", seed), RANKS,
                         ranks=[r], port=port)[0] for r, seed in enumerate(["0", "1"])]
    for code, _, stderr in finish(procs, timeout_s=120):
        assert code == 2
        assert "the ranks disagree on the options" in stderr
        assert "start every rank with the same karma-run arguments" in stderr


def test_a_malformed_world_size_is_bad_input(gpt_two_ranks):
    procs = start_ranks(karma_run(gpt_two_ranks, "--steps", "1"), RANKS, ranks=[0],
                        extra_env={"WORLD_SIZE": "two"})
    [(code, _, stderr)] = finish(procs, timeout_s=120)
    assert code == 2 and "WORLD_SIZE='two' is not a whole number" in stderr
    assert "Traceback" not in stderr


@pytest.mark.slow
def test_a_killed_rank_stops_the_others_and_resume_reproduces_the_run(gpt_two_ranks,
                                                                      tmp_path):
    ckpt = tmp_path / "ckpt"
    procs = start_ranks(karma_run(gpt_two_ranks, "--steps", "400", "--checkpoint-dir",
                                  str(ckpt), "--checkpoint-every", "2"), RANKS)
    wait_for_line(procs, 0, "/step_2", timeout_s=120)  # rank 0 prints the progress lines
    procs[1].send_signal(signal.SIGKILL)  # mid-step: the ranks checkpoint every 2 steps
    killed = time.monotonic()
    [(code, _, stderr), (killed_code, _, _)] = finish(procs, timeout_s=120)
    assert time.monotonic() - killed < 60
    assert killed_code == -signal.SIGKILL
    assert code != 0
    assert "rank 0 of 2 lost the other ranks" in stderr and "--resume" in stderr, stderr
    assert "Traceback" not in stderr

    last = latest_checkpoint(ckpt)
    assert last is not None
    done = int(last.name.removeprefix("step_"))
    assert 2 <= done < 400
    report = tmp_path / "report.json"
    procs = start_ranks(karma_run(gpt_two_ranks, "--steps", str(done + 2), "--checkpoint-dir",
                                  str(ckpt), "--resume", "--report", str(report)), RANKS)
    for rank, (code, _, stderr) in enumerate(finish(procs, timeout_s=300)):
        assert code == 0, f"rank {rank}: {stderr[-3000:]}"
    resumed = json.loads(report.read_text())
    assert resumed["steps"] == [done + 1, done + 2]

    mf = load_small("gpt")  # the uninterrupted run
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref = train_reference(mf, block_graph(mf).batch_size, done + 2, world_size=RANKS,
                              **stepped_on_host(load_schedule(Path(gpt_two_ranks))))
    finally:
        torch.set_num_threads(threads)
    assert resumed["losses"] == pytest.approx(ref.losses[done:], rel=1e-6)
    saved = load_model_pt(ckpt, done + 2)
    worst = max(max_relative_difference(saved[n], p.detach())
                for n, p in ref.model.named_parameters())
    assert worst <= 1e-6


@pytest.mark.slow
def test_a_hung_rank_stops_the_others_after_the_timeout(gpt_two_ranks, tmp_path):
    procs = start_ranks(karma_run(gpt_two_ranks, "--steps", "400", "--checkpoint-dir",
                                  str(tmp_path), "--checkpoint-every", "2", "--timeout", "5"),
                        RANKS)
    try:
        wait_for_line(procs, 0, "/step_2", timeout_s=120)
        procs[1].send_signal(signal.SIGSTOP)  # alive, connections open, never answering
        stopped = time.monotonic()
        procs[0].wait(timeout=120)  # its stdout is drained by wait_for_line's reader
        waited = time.monotonic() - stopped
    finally:
        procs[1].kill()
    [(code, _, stderr), _] = finish(procs, timeout_s=60)
    assert code == 2 and "rank 0 of 2 lost the other ranks" in stderr, stderr
    assert 4 < waited < 40, waited  # the 5 s timeout, not the 30 min of checkpoint waits


def test_torchrun_launches_karma_run(gpt_two_ranks, tmp_path):
    bin_dir = Path(sys.executable).parent
    report = tmp_path / "report.json"
    result = subprocess.run(
        [str(bin_dir / "torchrun"), "--standalone", "--nproc-per-node", str(RANKS),
         "--no-python", str(bin_dir / "karma-run"), gpt_two_ranks, "--steps", "2",
         "--report", str(report)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={k: v for k, v in os.environ.items() if not k.startswith("KARMA_")})
    assert result.returncode == 0, result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 2 and all("all-reduce" in line and "hidden; predicted" in line
                                   for line in lines)
    assert "all-reduce:" in result.stdout and "hidden under backward" in result.stdout
    got = json.loads(report.read_text())
    assert got["world_size"] == RANKS and got["predicted_allreduce_s"] > 0
    assert got["dist_backend"] == "gloo"  # the default on the CPU backend


def test_hidden_time_is_the_all_reduce_outside_compute_waits():
    from karma.runtime.distributed.exchange import hidden_s

    calls = [(0.0, 4.0), (10.0, 12.0)]
    assert hidden_s(calls, []) == 6.0  # compute never waited: all of it hidden
    assert hidden_s(calls, [(3.0, 5.0)]) == 5.0  # one second of the first call was waited on
    assert hidden_s(calls, [(9.0, 13.0)]) == 4.0  # the whole second call was waited on
    assert hidden_s(calls, [(-1.0, 0.5), (1.0, 2.0), (11.5, 20.0)]) == 4.0


# --- the collective backend ----------------------------------------------------------------

def test_the_collective_backend_defaults_to_nccl_on_cuda_and_gloo_on_the_cpu():
    from karma.errors import KarmaError
    from karma.runtime.distributed.process_group import choose_backend

    assert choose_backend(None, "cuda") == "nccl" and choose_backend(None, "cpu") == "gloo"
    assert choose_backend("gloo", "cuda") == "gloo"
    with pytest.raises(KarmaError, match="use --dist-backend gloo"):
        choose_backend("nccl", "cpu")


def test_ranks_beyond_the_gpus_share_them_and_the_gpus_shared_are_found():
    from karma.runtime.bringup import local_device_index
    from karma.runtime.distributed.process_group import shared_gpus

    assert local_device_index({}, 4, current=2) == 2  # no torchrun: the current device
    assert [local_device_index({"LOCAL_RANK": str(r)}, 1, 0) for r in range(2)] == [0, 0]
    assert [local_device_index({"LOCAL_RANK": str(r)}, 2, 0) for r in range(3)] == [0, 1, 0]
    assert shared_gpus(["GPU-a", "GPU-b", "GPU-a", None, None]) == {"GPU-a": [0, 2]}
    assert shared_gpus(["GPU-a", "GPU-b"]) == {}


CHECK_GPUS = """
import os, sys, torch.distributed as dist
from karma.errors import KarmaError
from karma.runtime.distributed import process_group
dist.init_process_group("gloo")
ranks = process_group.Ranks(dist.get_rank(), 2, True, None)
try:
    process_group._check_own_gpus(ranks, sys.argv[1 + dist.get_rank()])
    print("ok")
except KarmaError as e:
    print(e)
dist.destroy_process_group()
"""


@pytest.mark.slow
@pytest.mark.parametrize("gpus,refused", [(["GPU-1", "GPU-1"], True),
                                          (["GPU-1", "GPU-2"], False)])
def test_nccl_is_refused_on_every_rank_when_two_share_a_gpu(gpus, refused):
    """The ranks compare their GPUs' UUIDs over the default group (gloo, as on a GPU
    machine; the UUIDs are given here: this machine has no GPU)."""
    procs = start_ranks(["-c", CHECK_GPUS, *gpus], RANKS)
    for code, out, stderr in finish(procs, timeout_s=120):
        assert code == 0, stderr[-2000:]
        if refused:
            assert "--dist-backend nccl needs a GPU of its own for each rank, but ranks 0, 1 " \
                   "share GPU GPU-1: run several ranks on one GPU with --dist-backend gloo" in out
        else:
            assert out.strip() == "ok"
