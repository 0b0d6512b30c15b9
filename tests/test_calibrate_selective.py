"""The selective recompute timed (karma/ir/timing.py, [Note: timing the selective recompute])."""

from __future__ import annotations

import pytest
import torch

from karma.ir.build import build_block_graph
from karma.ir.timing import time_blocks
from karma.modelfile import load_model_file


@pytest.fixture
def one_thread():
    """Time on one thread: on a shared 2-core machine two OpenMP threads wait on each other
    for whole time slices (a ResNet block of 0.3 ms once took 185 ms)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Blocks where the matmuls carry the work: at the tiny sizes the dispatch modes' Python per
# op outweighs the ops the policy skips (the tiny GPT's layers recompute in 1.8x their
# forward), so "cheaper than the forward" needs blocks of some width.
@pytest.mark.parametrize("name, env, batch, blocks", [
    ("gpt", {"KARMA_GPT": "2x256x4x128", "KARMA_SEQ": "128"}, 2, ("h.0", "h.1")),
    ("resnet", {"KARMA_RESNET": "50", "KARMA_RESNET_IMAGE": "32"}, 2,
     ("layer3.1", "layer4.1")),
])
def test_a_selective_recompute_is_timed_below_its_forward(example, one_thread, name, env,
                                                          batch, blocks):
    times = time_blocks(example(name, **env), batch)
    assert all(s is not None and s > 0 for s in times.selective_s)  # every block can run it
    for block in blocks:  # these skip matmuls or convolutions that carry most of the forward
        i = times.names.index(block)
        assert times.selective_s[i] < times.fwd_bwd_s[i][0], (block, times)


INPLACE_RELU = ("return x + self.act(self.norm(self.fc(x)))",
                "return x + self.norm(torch.relu_(self.fc(x)))")


def test_a_block_whose_policy_cannot_run_gets_none(example, tmp_path):
    # a ReLU in place on a linear layer's output: the output the policy keeps has changed
    mf = example("mlp")
    text = mf.path.read_text()
    assert INPLACE_RELU[0] in text
    path = tmp_path / "inplace_mlp.py"
    path.write_text(text.replace(*INPLACE_RELU))
    inplace = load_model_file(path)
    times = time_blocks(inplace, 2, repeats=1)
    graph = build_block_graph(inplace, 2)
    # the IR finds the same blocks, op by op on meta tensors
    assert [s is None for s in times.selective_s] == [b.selective is None for b in graph.blocks] \
        == [False, True, True, True, True, False]
    assert all(s > 0 for s in times.selective_s if s is not None)


def test_a_forward_only_timing_leaves_out_the_backward_and_the_step(example):
    times = time_blocks(example("gpt"), 2, repeats=1, forward_only=True)
    assert all(f > 0 and b == 0 for f, b in times.fwd_bwd_s)
    assert all(s is not None and s > 0 for s in times.selective_s)
    assert set(times.step_s) == {(0.0, 0.0)} and set(times.stepped_bytes) == {0}
