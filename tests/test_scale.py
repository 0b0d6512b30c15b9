"""Planning for a cluster: nodes, host memory per node, sharded host state, paper scale.

The paper's 17B GPT on 2048 V100s (ABCI nodes: 4 GPUs, 384 GiB) and a 65B GPT on 512 H100s
(DGX H100: 8 GPUs, 2 TiB) are planned on the meta device, each in a process of its own
(bench/scale.py) that reports its time and peak RSS.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from karma.cli.plan import main
from karma.planner.hardware import load_hardware
from karma.planner.host_state import HostUse
from karma.planner.lowering import Choice, fragment
from karma.planner.plan import Plan, evaluate
from karma.planner.problem import Measurements, build_problem
from tests.conftest import EXAMPLES, ROOT
from tests.schedule_fixtures import HARDWARE, tiny_graph

GPT = str(EXAMPLES / "gpt.py")
OFFLOAD = Choice("recompute", "streamed", "host")


def plan_cli(capsys, monkeypatch, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setenv("KARMA_GPT", "tiny")
    code = main([GPT, "--no-measure", *argv])
    out, err = capsys.readouterr()
    return code, out, err


# --- bad input ------------------------------------------------------------------------------

BAD_NODES = [
    (["--world-size", "6", "--nproc-per-node", "4"],
     "--world-size 6 is not a multiple of --nproc-per-node 4"),
    (["--world-size", "6"],  # the v100-16g node's 4 GPUs, by default
     "--world-size 6 is not a multiple of the profile's 4 devices per node"),
    (["--world-size", "16", "--nproc-per-node", "8"], "more than the 4 GPUs of a v100-16g node"),
    (["--host-mem", "lots"], "'lots' is not a size"),
    (["--host-state", "halved"], "--host-state"),
]


@pytest.mark.parametrize("argv,expected", BAD_NODES, ids=[e for _, e in BAD_NODES])
def test_a_node_layout_that_cannot_be_is_bad_input(capsys, monkeypatch, argv, expected):
    code, out, err = plan_cli(capsys, monkeypatch, "--gpu-mem", "1G", "--hardware", "v100-16g",
                              *argv)
    assert code == 2, err
    assert err.startswith("karma-plan: error: ") and expected in err, err
    assert "Traceback" not in err and out == ""


def test_the_json_says_the_host_state_and_the_host_bytes_per_rank_and_node(capsys,
                                                                           monkeypatch):
    code, out, err = plan_cli(capsys, monkeypatch, "--gpu-mem", "1G", "--hardware", "v100-16g",
                              "--world-size", "8", "--strategy", "offload_all", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["host_state"] == "sharded" and doc["nproc_per_node"] == 4  # the node's 4 GPUs
    assert 0 < doc["host_bytes"] < doc["node_host_bytes"] <= doc["host_mem_bytes"]
    assert doc["node_host_bytes"] <= 4 * doc["host_bytes"]


def test_too_little_host_memory_names_the_node_and_what_would_fit(capsys, monkeypatch):
    code, out, err = plan_cli(capsys, monkeypatch, "--gpu-mem", "600K", "--hardware", "v100-16g",
                              "--world-size", "4", "--host-mem", "1M",
                              "--host-state", "replicated")
    assert code == 3, err
    assert "no plan fits the node's host memory" in err, err
    assert "(--host-mem" in err and "--host-state sharded" in err
    assert "--nproc-per-node 2" in err and "Traceback" not in err


# --- the model: host bytes per rank and per node ---------------------------------------------

def offload_all(world_size: int, host_state: str, nproc_per_node: int) -> HostUse:
    _, graph = tiny_graph()
    problem = build_problem(graph, load_hardware(HARDWARE), world_size=world_size,
                            host_state=host_state, nproc_per_node=nproc_per_node)
    return HostUse.of(problem, [fragment(problem, i, OFFLOAD)
                                for i in range(len(problem.blocks))])


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_sharded_state_is_a_rank_s_1_over_n_on_one_node(world_size):
    one = offload_all(1, "replicated", 1)
    sharded = offload_all(world_size, "sharded", world_size)
    # 16 bytes a parameter on one rank; sharded, 12/N own and 4/N of the node's weights
    assert sharded.host_bytes <= one.host_bytes / world_size + 64 * len(tiny_graph()[1].blocks)
    assert sharded.node_host_bytes <= one.host_bytes + 64 * world_size
    replicated = offload_all(world_size, "replicated", world_size)
    assert replicated.node_host_bytes == world_size * one.host_bytes


def test_nodes_of_several_ranks_share_one_copy_of_the_weights():
    four = offload_all(8, "sharded", 4)
    one = offload_all(8, "sharded", 1)
    # a node of four ranks holds the weights once, not four times
    assert four.node_host_bytes < 4 * one.node_host_bytes
    assert four.host_bytes < one.host_bytes


def test_a_sharded_block_reduce_scatters_steps_a_shard_and_all_gathers():
    _, graph = tiny_graph()
    problem = build_problem(graph, load_hardware(HARDWARE), world_size=4, host_state="sharded")
    ev = evaluate(problem, Plan("offload_all", (OFFLOAD,) * len(problem.blocks)), 1 << 30)
    assert ev.host_state == "sharded"
    kinds = [op.kind for op in ev.ops if op.block == 1]
    assert "reduce_scatter" in kinds and "all_gather" in kinds and "allreduce" not in kinds
    step = next(op for op in ev.ops if op.kind == "host_step" and op.block == 1)
    replicated = build_problem(graph, load_hardware(HARDWARE), world_size=4)
    assert step.dur_s == pytest.approx(replicated.blocks[1].host_step_s / 4, rel=1e-5)
    gather = next(op for op in ev.ops if op.kind == "all_gather" and op.block == 1)
    assert step.id in gather.deps and gather.stream == "net"


# --- the model: a node's ranks share its host ([Note: a node's ranks share its host]) --------

def one_node(hardware: str, ranks: int, host_state: str = "replicated"):
    _, graph = tiny_graph()
    return build_problem(graph, load_hardware(hardware), world_size=ranks,
                         host_state=host_state, nproc_per_node=ranks)


@pytest.mark.parametrize("ranks", [2, 4])
def test_a_rank_s_host_step_takes_as_many_times_one_process_s_as_the_node_has_ranks(ranks):
    alone, node = one_node(HARDWARE, 1), one_node(HARDWARE, ranks)
    for a, b in zip(alone.blocks, node.blocks):
        assert b.host_step_s == pytest.approx(ranks * a.host_step_s, rel=1e-12)
        # a GPU is the rank's own
        assert (b.fwd_s, b.bwd_s, b.device_step_s) == (a.fwd_s, a.bwd_s, a.device_step_s)
    # the same ranks on nodes of one rank each step as one process does
    _, graph = tiny_graph()
    spread = build_problem(graph, load_hardware(HARDWARE), world_size=ranks, nproc_per_node=1)
    assert [b.host_step_s for b in spread.blocks] == [b.host_step_s for b in alone.blocks]


def test_one_node_of_n_ranks_sharded_steps_its_blocks_in_one_process_s_time():
    alone, node = one_node(HARDWARE, 1), one_node(HARDWARE, 4, "sharded")
    plan = Plan("offload_all", (OFFLOAD,) * len(node.blocks))
    steps = {op.block: op.dur_s for op in evaluate(node, plan, 1 << 30).ops
             if op.kind == "host_step"}
    assert [steps[i] for i in range(len(alone.blocks))] == pytest.approx(
        [b.host_step_s for b in alone.blocks], rel=1e-5)


def test_cpu_ranks_divide_the_cores_so_two_ranks_a_node_predict_a_longer_step():
    alone, node = one_node("cpu", 1), one_node("cpu", 2)
    for a, b in zip(alone.blocks, node.blocks):
        assert (b.fwd_s, b.bwd_s, b.device_step_s, b.host_step_s) == pytest.approx(
            (2 * a.fwd_s, 2 * a.bwd_s, 2 * a.device_step_s, 2 * a.host_step_s), rel=1e-12)
    assert node.loss_s == pytest.approx(2 * alone.loss_s, rel=1e-12)
    plan = Plan("keep_all", (Choice("keep"),) * len(node.blocks))
    one, two = evaluate(alone, plan, 1 << 30), evaluate(node, plan, 1 << 30)
    assert two.step_s > 1.9 * one.step_s


def test_measured_times_are_one_process_s_and_a_node_of_two_cpu_ranks_doubles_them():
    _, graph = tiny_graph()
    n = len(graph.blocks)
    measured = Measurements(((0.1, 0.2),) * n, ((0.01, 0.03),) * n, loss_s=0.05)
    alone, node = (build_problem(graph, load_hardware("cpu"), world_size=k, measured=measured,
                                 nproc_per_node=k) for k in (1, 2))
    assert [(b.fwd_s, b.bwd_s, b.device_step_s, b.host_step_s) for b in alone.blocks] \
        == [(0.1, 0.2, 0.01, 0.03)] * n and alone.loss_s == 0.05
    assert [(b.fwd_s, b.bwd_s, b.device_step_s, b.host_step_s) for b in node.blocks] \
        == [(0.2, 0.4, 0.02, 0.06)] * n and node.loss_s == 0.1


# --- paper scale --------------------------------------------------------------------------

def scale_case(model: int, state: str) -> dict:
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "scale.py"), "--case",
                          str(model), state, "-"], capture_output=True, text=True, cwd=ROOT,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("model", [0, 1], ids=["gpt17b-2048xV100", "gpt65b-512xH100"])
def test_paper_scale_plans_fit_the_nodes_within_a_minute_and_a_gib(model):
    row = scale_case(model, "sharded")
    assert row["feasible"], row.get("reason")
    assert row["plan_s"] < 60 and row["rss_bytes"] < 1 << 30, row
    assert row["node_host_bytes"] <= row["host_mem_bytes"]
    assert row["node_pinned_bytes"] <= row["pinned_mem_bytes"]
    assert row["nproc_per_node"] == (4 if model == 0 else 8)


@pytest.mark.slow
def test_replicated_state_at_paper_scale_is_refused_naming_the_host_as_fast_as_a_plan():
    row = scale_case(0, "replicated")
    assert not row["feasible"]
    assert "no plan fits the node's host memory" in row["reason"]
    assert "384 GiB there" in row["reason"] and "--host-state sharded" in row["reason"]
    assert row["plan_s"] < 60
