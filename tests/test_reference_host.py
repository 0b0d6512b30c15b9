"""The plain loop with some parameters stepped on the CPU (karma.reference.HostStepped).

On a GPU, that reference is what a schedule with host-stepped blocks must equal bit for bit
(tests/test_gpu.py). Here, on the CPU, with the host optimizer as given every kernel is the
plain loop's, so it must equal the plain loop bit for bit: the code path runs and cannot move
a bit, with clipping and accumulation too, and where the schedule puts only some blocks on
the host. With the fused host kernel (the default) the chosen parameters step through
torch's fused CPU kernel: equal to the plain loop within rounding, and not bitwise.
"""

from __future__ import annotations

import pytest
import torch

from karma.reference import train_reference
from karma.testing.exactness import assert_bitwise_equal, block_graph
from tests.runtime_helpers import load_small

STEPS = 3
OPTIONS = [{}, {"accumulate": 2, "clip_grad_norm": 0.05}, {"clip_grad_norm": 0.05}]


def state(run):
    return {k: v.detach().clone() for k, v in run.model.state_dict().items()}


@pytest.mark.parametrize("options", OPTIONS, ids=["plain", "accumulate+clip", "clip"])
def test_host_stepped_parameters_step_as_the_plain_loop_on_the_cpu(options):
    mf = load_small("mlp")
    batch = block_graph(mf).batch_size
    names = [n for n, _ in mf.build_model().named_parameters()]
    plain = train_reference(mf, batch, STEPS, **options)
    for chosen in (names[::2], names):  # some on the host, or all
        ref = train_reference(mf, batch, STEPS, host_params=chosen, host_optimizer="as-given",
                              **options)
        assert ref.losses == plain.losses and ref.grad_norms == plain.grad_norms
        assert_bitwise_equal(state(ref), state(plain))
        fused = state(train_reference(mf, batch, STEPS, host_params=chosen, **options))
        assert any(not torch.equal(fused[k], v) for k, v in state(plain).items())
        for k, v in state(plain).items():
            torch.testing.assert_close(fused[k], v, rtol=1e-4, atol=1e-6)
    if "clip_grad_norm" in options:
        assert max(plain.grad_norms) > options["clip_grad_norm"]  # clipping did something


def test_host_params_must_name_parameters():
    mf = load_small("mlp")
    with pytest.raises(KeyError, match="names no parameter"):
        train_reference(mf, block_graph(mf).batch_size, 1, host_params={"nope.weight"})
