"""bf16 (mixed precision): the IR measures blocks under autocast; the planner takes the bytes
as measured (weights, gradients and optimizer state fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import karma.api
from karma.ir.build import build_block_graph
from karma.planner.hardware import load_hardware
from karma.planner.problem import build_problem
from karma.testing.autograd_saved import real_saved_bytes_per_block
from tests.conftest import EXAMPLES, environment


@pytest.mark.parametrize("name", ["mlp", "gpt", "resnet"])
def test_bf16_act_bytes_match_a_real_cpu_forward_under_autocast(example, name):
    # mlp: bf16 layer-norm inputs (fp32 statistics); gpt: fp32 layer norms and residuals,
    # SDPA, a tied weight; resnet: conv + BatchNorm in bf16 with fp32 statistics
    mf = example(name)
    graph = build_block_graph(mf, batch_size=4, dtype="bf16")
    assert graph.dtype == "bf16"

    torch.manual_seed(0)
    model = mf.build_model()
    inputs, _ = mf.checked_example_batch(4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        real = real_saved_bytes_per_block(model, graph, inputs)
    for block, real_bytes in zip(graph.blocks, real):
        assert real_bytes > 0, block.name
        assert graph.block_saved_bytes(block.index) == real_bytes, block.name


def test_bf16_loss_is_measured_under_autocast(example):
    # gpt's loss is cross_entropy on bf16 logits: autocast runs it in fp32, so it saves an
    # fp32 log-softmax of the logits as in fp32, more than the bf16 logits it is given
    mf = example("gpt")
    fp32 = build_block_graph(mf, batch_size=4)
    bf16 = build_block_graph(mf, batch_size=4, dtype="bf16")
    assert bf16.blocks[-1].out_bytes * 2 == fp32.blocks[-1].out_bytes  # bf16 logits
    assert bf16.loss_act_bytes == fp32.loss_act_bytes


def test_bf16_act_bytes_are_measured_not_halved_and_the_problem_takes_them(example):
    mf = example("gpt")
    fp32 = build_block_graph(mf, batch_size=4)
    bf16 = build_block_graph(mf, batch_size=4, dtype="bf16")
    hw = load_hardware("h100-80g")
    problem = build_problem(bf16, hw, "bf16")
    assert "measured in bf16" in bf16.table() and "measured in" not in fp32.table()
    for f, b, cost in zip(fp32.blocks[1:-1], bf16.blocks[1:-1], problem.blocks[1:-1]):
        # layer norms and the residual stream stay fp32: more than half of fp32
        assert f.act_bytes // 2 < b.act_bytes < f.act_bytes, b.name
        assert b.param_bytes == f.param_bytes  # the weights are fp32 under autocast
        assert (cost.act_bytes, cost.out_bytes, cost.param_bytes, cost.optim_bytes) == (
            b.act_bytes, b.out_bytes, b.param_bytes, 2 * b.param_bytes)
        assert (cost.fwd_temp_bytes, cost.bwd_temp_bytes) == (b.fwd_temp_bytes, b.bwd_temp_bytes)
    assert problem.loss_act_bytes == bf16.loss_act_bytes
    # FLOPs at the bf16 rate: the same FLOPs as fp32, faster
    assert fp32.blocks[1].fwd_flops == bf16.blocks[1].fwd_flops
    assert problem.blocks[1].fwd_s < build_problem(fp32, hw, "fp32").blocks[1].fwd_s


def test_problem_refuses_a_graph_measured_in_another_dtype(example):
    graph = build_block_graph(example("mlp"), batch_size=4)
    hw = load_hardware("h100-80g")
    with pytest.raises(ValueError, match=r"measured in fp32.*dtype='bf16'"):
        build_problem(graph, hw, "bf16")
    with pytest.raises(ValueError, match=r"measured in bf16.*dtype='fp32'"):
        build_problem(dataclasses.replace(graph, dtype="bf16"), hw, "fp32")


def swapped_bytes(schedule) -> dict[int, int]:
    """Bytes each swap block's swap_out ops move to the host (not a selective block's kept
    outputs)."""
    out: dict[int, int] = {}
    for op in schedule.ops:
        if op.kind == "swap_out" and schedule.blocks[op.block].act == "swap":
            out[op.block] = out.get(op.block, 0) + op.bytes
    return out


def bf16_over_fp32_swap(env: dict[str, str], gpu_mem: str,
                        strategy: str = "ilp") -> tuple[float, float]:
    """Plans of examples/gpt.py on h100-80g in fp32 and bf16 at the same budget: the ratio
    of the bytes swapped out for the blocks both swap, and of all blocks' act_bytes."""
    with environment(env):
        plans = {dtype: karma.api.plan(EXAMPLES / "gpt.py", gpu_mem, "h100-80g", dtype=dtype,
                                       strategy=strategy, time_limit_s=20.0)
                 for dtype in ("fp32", "bf16")}
    swapped = {dtype: swapped_bytes(s) for dtype, s in plans.items()}
    both = set(swapped["fp32"]) & set(swapped["bf16"])
    assert both, "no block swapped in both plans; lower the budget"
    swap_ratio = (sum(swapped["bf16"][i] for i in both)
                  / sum(swapped["fp32"][i] for i in both))
    act_ratio = (sum(b.act_bytes for b in plans["bf16"].blocks)
                 / sum(b.act_bytes for b in plans["fp32"].blocks))
    return swap_ratio, act_ratio


def test_bf16_plans_of_a_small_gpt_swap_the_measured_bytes():
    # GPT-2 small at sequence 256 in 1.5G: both plans swap layers; a bf16 layer swaps 77.2 MB,
    # an fp32 one 113.4 MB (0.681: layer norms and the residual stream stay fp32)
    swap_ratio, act_ratio = bf16_over_fp32_swap({"KARMA_GPT": "small", "KARMA_SEQ": "256"},
                                                "1.5G")
    assert 0.6 < swap_ratio < 0.75
    assert 0.6 < act_ratio < 0.8


@pytest.mark.slow
def test_bf16_plans_of_gpt2_xl_on_h100_swap_the_measured_bytes():
    # bf16 plans move fewer activation bytes than fp32 ones, measured, not halved.
    # swap_all: the ILP's bf16 plans at 16G and 32G recompute every layer instead (bf16
    # compute is fast on an H100), so only swap_all swaps the same blocks in both dtypes.
    swap_ratio, act_ratio = bf16_over_fp32_swap({"KARMA_GPT": "xl"}, "32G", "swap_all")
    print(f"GPT-2 XL on h100-80g at 32G: bf16/fp32 swapped {swap_ratio:.3f}, acts {act_ratio:.3f}")
    assert 0.55 < swap_ratio < 0.7
    assert 0.55 < act_ratio < 0.7


MASKED_MODEL = '''
import torch
import torch.nn as nn


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))

    def forward(self, x):
        # made on the input's device: a trace on meta bakes in device=meta
        mask = torch.ones(x.shape[1], x.shape[1], device=x.device).tril()
        for layer in self.layers:
            x = mask @ layer(x)
        return x


def build_model():
    return Masked()


def example_batch(batch_size):
    return torch.randn(batch_size, 4, 8), torch.randn(batch_size, 4, 8)


def loss_fn(output, targets):
    return ((output - targets) ** 2).mean()
'''


def test_timing_runs_a_forward_that_makes_tensors_on_the_input_device(tmp_path):
    from karma.ir.timing import time_blocks
    from karma.modelfile import load_model_file

    path = tmp_path / "masked.py"
    path.write_text(MASKED_MODEL)
    times = time_blocks(load_model_file(path), batch_size=2, repeats=1).fwd_bwd_s
    assert len(times) >= 2 and all(f > 0 and b >= 0 for f, b in times)
