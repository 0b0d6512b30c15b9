"""Selective recompute in the IR and the planner: what a block keeps and makes again, op by
op, and the choice the ILP, the baselines and the schedule make of it (karma/schedule.py,
[Note: selective recompute]). The runtime's replay of it: tests/test_selective.py."""

from __future__ import annotations

import dataclasses

import pytest

from karma.ir.build import build_block_graph
from karma.modelfile import load_model_file
from karma.planner.baselines import selective_all
from karma.planner.hardware import load_hardware
from karma.planner.lowering import Choice, fragment, valid_choices
from karma.planner.problem import Measurements, build_problem
from karma.schedule import ScheduleFileError, dump_schedule
from karma.schedule_check import validate
from karma.schedule_load import load_schedule
from karma.selective_policy import SELECTIVE_POLICY
from tests.conftest import EXAMPLES, MODELS, environment

F32 = 4
MLP_ENV = {"KARMA_MLP_WIDTH": "16", "KARMA_MLP_DEPTH": "2", "KARMA_MLP_IN": "8"}
BATCH = 4


@pytest.fixture(scope="module")
def mlp_graph():
    with environment(MLP_ENV):
        return build_block_graph(load_model_file(EXAMPLES / "mlp.py"), BATCH)


def test_a_layer_keeps_its_matmul_output_and_makes_the_rest_again(mlp_graph):
    # examples/mlp.py's Layer: x + gelu(layer_norm(fc(x))). Its forward saves fc's output
    # (for the norm), the norm's mean and rstd and its output (for gelu); fc's input is the
    # block's input. The policy keeps fc's output; the recompute makes the rest again.
    width = int(MLP_ENV["KARMA_MLP_WIDTH"])
    layer = next(b for b in mlp_graph.blocks if b.name.startswith("layers."))
    assert [s.policy for s in layer.selective] == [SELECTIVE_POLICY]  # one matmul: one policy
    sel = layer.selective[0]
    assert sel.kept_bytes == BATCH * width * F32
    assert sel.kept_saved_bytes == sel.kept_bytes
    assert layer.act_bytes - sel.kept_saved_bytes == BATCH * width * F32 + 2 * BATCH * F32
    assert 0 < sel.recompute_traffic_bytes < sel.forward_traffic_bytes


def test_a_kept_output_changed_in_place_rules_the_block_out():
    graph = build_block_graph(load_model_file(MODELS / "inplace_matmul.py"), BATCH)
    layers = [b for b in graph.blocks if b.name.startswith("layers.")]
    assert [len(b.selective) for b in layers] == [1, 0, 1]


def test_gpt_keeps_matmul_outputs_autograd_does_not_save():
    # an attention projection's and the MLP's last matmul's outputs are only added to the
    # residual: nothing saves them, but the policy keeps them (the checkpoint caches every
    # output of a kept op)
    with environment({"KARMA_GPT": "tiny"}):
        graph = build_block_graph(load_model_file(EXAMPLES / "gpt.py"), 2)
    layer = next(b for b in graph.blocks if b.name.startswith("h."))
    every = layer.selective[0]
    assert every.policy == SELECTIVE_POLICY
    assert every.kept_bytes > every.kept_saved_bytes > 0
    assert every.kept_saved_bytes < layer.act_bytes


def test_a_bottleneck_offers_policies_that_keep_less_and_recompute_more():
    # a ResNet bottleneck's convolutions take 2w (the last 1x1), 8w (the first 1x1) and 18w
    # (the 3x3) FLOPs an output element: each policy drops the cheapest kind left
    with environment({"KARMA_RESNET": "tiny"}):
        graph = build_block_graph(load_model_file(EXAMPLES / "resnet.py"), 2)
    block = next(b for b in graph.blocks if b.name == "layer1.1")
    policies = block.selective
    assert [p.policy.partition("@")[0] for p in policies] == [SELECTIVE_POLICY] * 3
    assert policies[0].policy == SELECTIVE_POLICY and policies[0].recompute_flops == 0
    width = 8  # KARMA_RESNET=tiny's base width; layer1 keeps it
    assert [p.policy for p in policies[1:]] == [f"{SELECTIVE_POLICY}@{8 * width}",
                                                f"{SELECTIVE_POLICY}@{18 * width}"]
    for more, less in zip(policies, policies[1:]):
        assert less.kept_bytes < more.kept_bytes
        assert less.kept_saved_bytes < more.kept_saved_bytes
        assert less.recompute_flops > more.recompute_flops
        assert less.recompute_traffic_bytes > more.recompute_traffic_bytes


def test_the_selective_fragment_keeps_the_kept_bytes_and_recomputes_in_its_time(mlp_graph):
    problem = build_problem(mlp_graph, load_hardware("v100-16g"))
    i = next(k for k, b in enumerate(mlp_graph.blocks) if b.name.startswith("layers."))
    b = problem.blocks[i]
    choice = Choice("selective", policy=SELECTIVE_POLICY)
    assert choice in valid_choices(problem, i)
    f = fragment(problem, i, choice)
    sel = b.selective_under(SELECTIVE_POLICY)
    recompute = next(op for op in f.ops if op.kind == "recompute")
    assert recompute.dur_s == pytest.approx(sel.recompute_s, rel=1e-5)  # 6 digits
    assert 0 < sel.recompute_s < b.fwd_s  # a share of the forward (roofline)
    buffers = {buf.name: buf.bytes for buf in f.buffers}
    assert buffers[f"sac.{i}"] == sel.kept_bytes
    assert buffers[f"act.{i}@re"] == sel.recompute_bytes
    assert buffers.get(f"ckpt.{i}", 0) == b.ckpt_bytes  # a buffer of no bytes is left out
    whole = {buf.name: buf.bytes for buf in fragment(problem, i, Choice("recompute")).buffers}
    assert f"sac.{i}" not in whole


def test_a_measured_selective_recompute_is_its_op_time(mlp_graph):
    n = len(mlp_graph.blocks)
    measured = Measurements(block_s=((0.01, 0.02),) * n,
                            selective_s=tuple({SELECTIVE_POLICY: 0.001 * (k + 1)}
                                              for k in range(n)))
    problem = build_problem(mlp_graph, load_hardware("cpu"), measured=measured)
    timed = [k for k, b in enumerate(problem.blocks) if b.selective]
    assert timed
    for k in timed:
        sel = problem.blocks[k].selective_under(SELECTIVE_POLICY)
        assert sel.recompute_s == pytest.approx(0.001 * (k + 1))


def test_blocks_the_policy_cannot_run_have_no_selective_choice():
    graph = build_block_graph(load_model_file(MODELS / "inplace_matmul.py"), BATCH)
    problem = build_problem(graph, load_hardware("v100-16g"))
    plan = selective_all(problem, 1 << 40)
    for i, (b, c) in enumerate(zip(problem.blocks, plan.choices)):
        policies = {ch.policy for ch in valid_choices(problem, i) if ch.act == "selective"}
        assert policies == {s.policy for s in b.selective}
        assert c == (Choice("selective", policy=b.selective[0].policy) if b.selective
                     else Choice("recompute"))


def test_a_selective_schedule_names_its_policy_and_the_validator_checks_it():
    from karma.testing.exactness import plan

    with environment(MLP_ENV):
        mf = load_model_file(EXAMPLES / "mlp.py")
        s = plan(mf, "selective_all", 1.5)  # keeping and remaking, more than keep_all
    assert {(b.act, b.policy) for b in s.blocks} == {("selective", SELECTIVE_POLICY)}
    assert load_schedule(dump_schedule(s)).blocks == s.blocks
    validate(s)
    blocks = list(s.blocks)
    blocks[0] = dataclasses.replace(blocks[0], policy="")
    with pytest.raises(ScheduleFileError, match="policy if and only if its act is selective"):
        validate(dataclasses.replace(s, blocks=tuple(blocks)))
    blocks[0] = dataclasses.replace(blocks[0], act="recompute", policy=SELECTIVE_POLICY)
    with pytest.raises(ScheduleFileError, match="remove its policy"):
        validate(dataclasses.replace(s, blocks=tuple(blocks)))
    blocks[0] = dataclasses.replace(blocks[0], act="selective", policy="save-matmuls@x")
    with pytest.raises(ScheduleFileError, match="is not a selective policy"):
        validate(dataclasses.replace(s, blocks=tuple(blocks)))
    text = dump_schedule(s).replace(f"policy: {SELECTIVE_POLICY},", "policy: save-all,", 1)
    with pytest.raises(ScheduleFileError, match="'save-all' is not a selective policy"):
        load_schedule(text)


def test_no_selective_plans_without_the_choice():
    import karma

    with environment(MLP_ENV):
        path = EXAMPLES / "mlp.py"
        kw = {"gpu_mem": "1G", "hardware": "v100-16g", "batch_size": BATCH,
              "measure": "estimate", "strategy": "selective_all", "log": lambda note: None}
        offered = karma.plan(path, **kw)
        without = karma.plan(path, selective=False, **kw)
    assert {b.act for b in offered.blocks} == {"selective"}
    assert {b.act for b in without.blocks} == {"recompute"}  # no block is offered a policy

