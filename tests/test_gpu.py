"""The CUDA backend (marked `gpu`, skipped without CUDA; bench/gpu_check.sh runs them).

- Exactness: every schedule of the three small models, planned for an H200 profile, trains
  3 steps on the GPU to the bits of the plain PyTorch loop on the same GPU (the model built on
  the CPU, then moved). Deterministic algorithms are switched on for both; the plain loop is
  first checked to reproduce itself, so that a failure says which of the two is at fault.
  Where a block's optimizer runs on the host, it steps with the CPU's kernels, whose rounding
  differs from the GPU's foreach kernels (addcmul, addcdiv): those schedules are compared to
  a relative 1e-5 instead of bit for bit.
- Capacity: GPT-2 small planned for half of what it needs trains under
  `torch.cuda.set_per_process_memory_fraction` of that budget (a smaller GPU, emulated), with
  its measured peak inside the budget, while the plain loop runs out of memory under it.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

from karma.planner.plan import InfeasiblePlan
from karma.reference import train_reference
from tests.conftest import EXAMPLES
from tests.runtime_helpers import (
    assert_bitwise_equal,
    block_graph,
    keep_all_peak_bytes,
    load_small,
    load_with_env,
    plan,
    run,
)
from tests.test_runtime import MODELS, STEPS, STRATEGIES, load_model_pt

pytestmark = pytest.mark.gpu

HARDWARE = "h200-141g"
MIB = 1 << 20


@pytest.fixture(autouse=True, scope="module")
def deterministic():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    yield
    torch.use_deterministic_algorithms(False)


def reference_on_gpu(mf, steps: int) -> tuple[dict[str, torch.Tensor], list[float]]:
    ref = train_reference(mf, block_graph(mf).batch_size, steps, device="cuda")
    return {k: v.detach().cpu() for k, v in ref.model.state_dict().items()}, ref.losses


_REFERENCES: dict[str, tuple[dict[str, torch.Tensor], list[float]]] = {}


def reference(name: str):
    if name not in _REFERENCES:
        mf = load_small(name)
        first, second = reference_on_gpu(mf, STEPS), reference_on_gpu(mf, STEPS)
        assert first[1] == second[1], "the plain loop does not reproduce itself on this GPU"
        assert_bitwise_equal(first[0], second[0])
        _REFERENCES[name] = first
    return _REFERENCES[name]


@pytest.mark.parametrize("strategy,fraction", STRATEGIES,
                         ids=[f"{s}@{f:g}" if s == "ilp" else s for s, f in STRATEGIES])
@pytest.mark.parametrize("name", MODELS)
def test_cuda_training_is_bitwise_equal_to_plain_pytorch(name, strategy, fraction, tmp_path):
    try:
        schedule = plan(load_small(name), strategy, fraction, hardware=HARDWARE)
    except InfeasiblePlan as e:
        pytest.skip(f"{strategy} does not fit {fraction:g} of keep_all on {name}: {e}")
    ref_sd, ref_losses = reference(name)
    report = run(schedule, load_small(name), STEPS, checkpoint_dir=tmp_path)
    if all(b.optim == "device" for b in schedule.blocks):
        assert report.losses == ref_losses
        assert_bitwise_equal(load_model_pt(tmp_path, STEPS), ref_sd)
    else:  # a host optimizer steps with the CPU's kernels (see the module docstring)
        assert report.losses == pytest.approx(ref_losses, rel=1e-5)
        torch.testing.assert_close(load_model_pt(tmp_path, STEPS), ref_sd, rtol=1e-5, atol=1e-6)
    assert 0 < report.peak_device_bytes <= max(schedule.config.capacity_bytes, 64 * MIB)


def test_a_smaller_gpu_emulated_trains_within_its_budget(tmp_path):
    mf = load_with_env(EXAMPLES / "gpt.py", {"KARMA_GPT": "small", "KARMA_SEQ": "512"})
    needed = keep_all_peak_bytes(mf, hardware=HARDWARE)
    schedule = plan(mf, "ilp", 0.5, hardware=HARDWARE)
    capacity = schedule.config.capacity_bytes
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction((capacity + 256 * MIB) / total)
    try:
        assert not plain_fits(mf, schedule.config.batch_size)
        report = run(schedule, mf, 3)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert needed >= 1.9 * capacity
    assert report.steps == [1, 2, 3]
    assert report.peak_device_bytes <= capacity, (report.peak_device_bytes, capacity)


def plain_fits(mf, batch_size: int) -> bool:
    """One step of the plain loop; False if it runs out of device memory (its tensors are
    freed before this returns: the exception and its frames are gone)."""
    try:
        train_reference(mf, batch_size, 1, device="cuda")
        fits = True
    except torch.cuda.OutOfMemoryError:
        fits = False
    gc.collect()
    torch.cuda.empty_cache()
    return fits


@pytest.mark.parametrize("strategy,fraction", [("keep_all", 1.0), ("recompute_all", 1.0),
                                               ("offload_all", 1.0), ("ilp", 0.6)])
@pytest.mark.parametrize("name", ["gpt", "resnet"])
def test_cuda_bf16_accumulation_and_clipping_follow_the_plain_loop(name, strategy, fraction,
                                                                   tmp_path):
    """bf16 autocast, 2 micro-batches and clipping at 1.0 on the GPU, against the same plain
    loop on the GPU: bitwise where every block steps on the device, relative 1e-5 where a
    host optimizer steps with the CPU's kernels (and the clipping norm sums device and host
    parts in another order)."""
    options = {"dtype": "bf16", "accumulate": 2, "clip_grad_norm": 1.0}
    mf = load_small(name)
    try:
        schedule = plan(mf, strategy, fraction, hardware=HARDWARE, **options)
    except InfeasiblePlan as e:
        pytest.skip(f"{strategy} does not fit {fraction:g} of keep_all on {name}: {e}")
    ref = train_reference(mf, block_graph(mf).batch_size, STEPS, device="cuda", **options)
    ref_sd = {k: v.detach().cpu() for k, v in ref.model.state_dict().items()}
    report = run(schedule, mf, STEPS, checkpoint_dir=tmp_path)
    assert max(ref.grad_norms) > 1.0, "the gradients never reached the clipping norm"
    if all(b.optim == "device" for b in schedule.blocks):
        assert report.losses == ref.losses and report.grad_norms == ref.grad_norms
        assert_bitwise_equal(load_model_pt(tmp_path, STEPS), ref_sd)
    else:
        assert report.losses == pytest.approx(ref.losses, rel=1e-5)
        assert report.grad_norms == pytest.approx(ref.grad_norms, rel=1e-5)
        torch.testing.assert_close(load_model_pt(tmp_path, STEPS), ref_sd, rtol=1e-5, atol=1e-6)
