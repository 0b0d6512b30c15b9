"""The CUDA backend (marked `gpu`, skipped without CUDA; bench/gpu_check.sh runs them).

- Exactness: every schedule of the three small models, planned for an H200 profile, trains
  3 steps on the GPU to the bits of the plain PyTorch loop on the same GPU (the model built on
  the CPU, then moved), the parameters a schedule steps on the host stepped on the CPU in the
  reference too (karma.reference, [Note: a reference with host-stepped parameters]).
  Deterministic algorithms are switched on for both, with errors, not warnings, for an op
  that has no deterministic kernel (memory-efficient attention then leaves its split-key path
  with atomics); the plain loop is first checked to reproduce itself, so that a failure says
  which of the two is at fault.
- Selective blocks: recompute_all and offload_all of the three models, every block made
  selective, in fp32 and bf16, bitwise equal to the plain loop on the GPU; and with their
  kept outputs on the host (kept: host), every copy started late.
- Races: with every copy and all-reduce started late (`torch.cuda._sleep` on its stream
  before the op) and every buffer a copy fills poisoned with NaN before it (deterministic
  mode's fill of uninitialized memory, and the streamed weights' storage filled by hand), a
  consumer that did not wait for its copy reads NaN or stale bytes. GPT-2 small's swap, offload
  and mixed schedules must still train to the reference's bits, must have moved what their
  schedules move through the host tier, and must stay within the planner's bound on device
  memory. A backend that drops compute's waits for the fetches, and one that releases only at
  the end of each replay, show that these checks fail when the ordering is wrong.
- Capacity: GPT-2 small planned for half of what it needs trains on a GPU of that budget,
  emulated (`--cap-device-memory`), with its measured peak inside the budget, while the plain
  loop runs out of memory there.
- Two ranks on the one GPU through gloo: a job of schedules planned for 2 ranks trains to the
  bits of the gradient-averaged reference; NCCL is refused there with one line, exit 2.
"""

from __future__ import annotations

import gc
import json
import os

import pytest
import torch

from karma.reference import train_reference
from karma.runtime.backends.cuda_backend import CudaBackend
from karma.runtime.params.streamed import SharedStorage
from karma.runtime.replay.swap import SwapStore
from karma.schedule import dump_schedule
from karma.testing.exactness import (
    assert_bitwise_equal,
    block_graph,
    keep_all_peak_bytes,
    load_with_env,
    plan,
    run,
)
from tests.conftest import EXAMPLES
from tests.dist_helpers import finish, start_ranks
from tests.matrix import MODELS, STRATEGIES, cells
from tests.runtime_helpers import load_small
from tests.test_runtime import STEPS, load_model_pt
from tests.test_selective import selective

pytestmark = pytest.mark.gpu  # skipped without CUDA (conftest.py)

HARDWARE = "h200-141g"
MIB = 1 << 20


@pytest.fixture(autouse=True, scope="module")
def deterministic():
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=False)
    torch.utils.deterministic.fill_uninitialized_memory = True  # NaN in every torch.empty
    yield
    torch.use_deterministic_algorithms(False)


def host_params(schedule) -> frozenset[str]:
    """The parameters the schedule steps on the host (the reference steps them on the CPU)."""
    return frozenset(n for b in schedule.blocks if b.optim == "host" for n in b.params)


_REFERENCES: dict[tuple, object] = {}


def reference(mf, host: frozenset[str] = frozenset(), world_size: int = 1, **training):
    """The plain loop on the GPU (karma.reference), with `host` stepped on the CPU; the first
    time for a model, run twice to check that it reproduces itself."""
    key = (id(mf), host, world_size, tuple(sorted(training.items())))
    if key not in _REFERENCES:
        runs = [train_reference(mf, block_graph(mf).batch_size, STEPS, device="cuda",
                                world_size=world_size, host_params=host, **training)
                for _ in range(1 if _REFERENCES else 2)]
        if len(runs) == 2:
            assert runs[0].rank_losses == runs[1].rank_losses, \
                "the plain loop does not reproduce itself on this GPU"
            assert_bitwise_equal(state(runs[0]), state(runs[1]))
        _REFERENCES[key] = runs[0]
    return _REFERENCES[key]


def state(ref) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in ref.model.state_dict().items()}


def params(ref) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in ref.model.named_parameters()}


def within_bound(report, schedule, slack_bytes: int) -> bool:
    """The measured peak within the planner's own bound (predicted.stage_peak_bytes), plus
    10% and `slack_bytes` for what the plan does not count: the caching allocator's rounding
    (a large block is not split for less than 1 MiB) and library workspaces."""
    bound = schedule.predicted.stage_peak_bytes * 1.1 + slack_bytes
    return 0 < report.peak_device_bytes <= bound


# --- exactness -----------------------------------------------------------------------------

@pytest.mark.parametrize("name,strategy,fraction", cells(MODELS, STRATEGIES, hardware=HARDWARE))
def test_cuda_training_is_bitwise_equal_to_plain_pytorch(name, strategy, fraction, tmp_path):
    mf = load_small(name)
    schedule = plan(mf, strategy, fraction, hardware=HARDWARE)
    ref = reference(mf, host_params(schedule))
    report = run(schedule, mf, STEPS, checkpoint_dir=tmp_path)
    assert report.losses == ref.losses
    assert_bitwise_equal(load_model_pt(tmp_path, STEPS), state(ref))
    # tiny models: the slack dominates; GPT-2 small's races test below is the memory test
    assert within_bound(report, schedule, 16 * MIB), report.peak_device_bytes


@pytest.mark.parametrize("name,strategy,fraction", cells(
    ("gpt", "resnet"), (("keep_all", 1.0), ("recompute_all", 1.0), ("offload_all", 1.0),
                        ("ilp", 0.6)), hardware=HARDWARE))
def test_cuda_bf16_accumulation_and_clipping_follow_the_plain_loop(name, strategy, fraction,
                                                                   tmp_path):
    """bf16 autocast, 2 micro-batches and clipping at 1.0 on the GPU, against the same plain
    loop on the GPU, host-stepped parameters stepped on the CPU there too: bitwise."""
    options = {"dtype": "bf16", "accumulate": 2, "clip_grad_norm": 1.0}
    mf = load_small(name)
    schedule = plan(mf, strategy, fraction, hardware=HARDWARE, **options)
    ref = reference(mf, host_params(schedule), **options)
    report = run(schedule, mf, STEPS, checkpoint_dir=tmp_path)
    assert max(ref.grad_norms) > 1.0, "the gradients never reached the clipping norm"
    assert report.losses == ref.losses and report.grad_norms == ref.grad_norms
    assert_bitwise_equal(load_model_pt(tmp_path, STEPS), state(ref))


@pytest.mark.parametrize("name,strategy,dtype", [
    (name, strategy, dtype) for name in MODELS for strategy in ("recompute_all", "offload_all")
    for dtype in ("fp32", "bf16")])
def test_cuda_selective_blocks_follow_the_plain_loop(name, strategy, dtype, tmp_path):
    """Every block selective (tests/test_selective.py: the same ops, the matmuls' outputs
    kept), on the GPU against the plain loop on the GPU: bitwise."""
    mf = load_small(name)
    schedule = selective(plan(mf, strategy, hardware=HARDWARE, dtype=dtype))
    ref = reference(mf, host_params(schedule), dtype=dtype)
    report = run(schedule, mf, STEPS, checkpoint_dir=tmp_path)
    assert report.losses == ref.losses
    assert_bitwise_equal(load_model_pt(tmp_path, STEPS), state(ref))


@pytest.mark.parametrize("name,strategy,dtype", [
    (name, strategy, dtype) for name in MODELS for strategy in ("recompute_all", "offload_all")
    for dtype in ("fp32", "bf16")])
def test_cuda_selective_blocks_keeping_on_the_host_follow_the_plain_loop(name, strategy, dtype,
                                                                         monkeypatch, tmp_path):
    """Selective blocks with kept: host (tests/test_kept_on_host.py), every copy late on its
    stream (LateCopies, below): a recompute that read its kept outputs before their swap-in
    had landed would read an empty tensor. Bitwise against the plain loop on the GPU."""
    mf = load_small(name)
    schedule = plan(mf, strategy, hardware=HARDWARE, dtype=dtype, kept_on_host=True)
    assert any(b.kept == "host" for b in schedule.blocks)
    monkeypatch.setattr("karma.runtime.runtime.make_backend", lambda kind: LateCopies())
    ref = reference(mf, host_params(schedule), dtype=dtype)
    report = run(schedule, mf, STEPS, checkpoint_dir=tmp_path)
    assert report.losses == ref.losses
    assert_bitwise_equal(load_model_pt(tmp_path, STEPS), state(ref))


@pytest.mark.parametrize("name,strategy,dtype", [
    (name, strategy, dtype) for name in MODELS for strategy in ("recompute_all", "selective_all")
    for dtype in ("fp32", "bf16")])
def test_cuda_pairs_follow_the_plain_loop(name, strategy, dtype, tmp_path):
    """Two blocks recomputed under one checkpoint (tests/test_pairs.py), on the GPU: the
    pair's recompute restores the CUDA random state dropout drew from; bitwise against the
    plain loop on the GPU."""
    mf = load_small(name)
    schedule = plan(mf, strategy, hardware=HARDWARE, dtype=dtype, paired=True)
    assert any(b.with_next for b in schedule.blocks)
    ref = reference(mf, host_params(schedule), dtype=dtype)
    report = run(schedule, mf, STEPS, checkpoint_dir=tmp_path)
    assert report.losses == ref.losses
    assert_bitwise_equal(load_model_pt(tmp_path, STEPS), state(ref))


# --- races: late copies, poisoned memory ---------------------------------------------------

SLEEP_CYCLES = 20_000_000  # about 10 ms at the H200's clock: far longer than any copy here


class LateCopies(CudaBackend):
    """Every h2d, d2h and net op starts late on its stream: whatever reads its result without
    waiting for its event reads what the memory held before (NaN: see `poisoned`)."""

    def __init__(self):
        super().__init__(torch.device("cuda", torch.cuda.current_device()))

    def order_after(self, deps, stream, op_id=None):
        super().order_after(deps, stream, op_id)
        if stream in ("h2d", "d2h", "net"):
            torch.cuda._sleep(SLEEP_CYCLES)  # on the worker's current stream: this one


class SkipsFetchWaits(LateCopies):
    """Broken on purpose: compute does not wait for the h2d ops it depends on."""

    def order_after(self, deps, stream, op_id=None):
        if stream == "compute":
            deps = [d for d in deps if self._stream_of.get(d) != "h2d"]
        super().order_after(deps, stream, op_id)


class ReleasesLate(LateCopies):
    """Broken on purpose: what copies hold is released only when the replay ends."""

    def release_due(self, op_ids):
        pass

    def _poll(self):
        pass


@pytest.fixture
def poisoned(monkeypatch):
    """Streamed weights get NaN in the storage a fetch gives back, before the fetch's copy
    (swap-in buffers and all-reduce buffers come from torch.empty, which deterministic mode
    fills with NaN); and a count of what went through the host tier."""
    moved = {"swap_out": 0, "fill": 0}
    claim, fill, swap_out = SharedStorage.claim, SharedStorage.fill, SwapStore.swap_out

    def poisoned_claim(self, params):
        got = claim(self, params)
        with torch.no_grad():
            for p in got:
                with torch.autograd._unsafe_preserve_version_counter(p):
                    p.fill_(float("nan"))
        return got

    def counted_fill(self, params):
        moved["fill"] += sum(p.numel() for p in params)
        return fill(self, params)

    def counted_swap_out(self):
        moved["swap_out"] += sum(e.device.numel() for e in self._entries)
        return swap_out(self)

    monkeypatch.setattr(SharedStorage, "claim", poisoned_claim)
    monkeypatch.setattr(SharedStorage, "fill", counted_fill)
    monkeypatch.setattr(SwapStore, "swap_out", counted_swap_out)
    return moved


@pytest.fixture(scope="module")
def gpt_small():
    return load_with_env(EXAMPLES / "gpt.py", {"KARMA_GPT": "small", "KARMA_SEQ": "256"})


RACES = [("swap_all", 1.0), ("offload_all", 1.0), ("ilp", 0.5)]


@pytest.mark.parametrize("strategy,fraction", RACES,
                         ids=[f"{s}@{f:g}" if s == "ilp" else s for s, f in RACES])
def test_late_copies_and_poisoned_memory_change_nothing(gpt_small, strategy, fraction,
                                                        poisoned, monkeypatch, tmp_path):
    schedule = plan(gpt_small, strategy, fraction, hardware=HARDWARE)
    monkeypatch.setattr("karma.runtime.runtime.make_backend", lambda kind: LateCopies())
    report = run(schedule, gpt_small, STEPS, checkpoint_dir=tmp_path)
    ref = reference(gpt_small, host_params(schedule))
    assert report.losses == ref.losses
    assert_bitwise_equal(load_model_pt(tmp_path, STEPS), state(ref))
    # the host tier was really used: what the schedule swaps and streams went through it
    kinds = {op.kind for op in schedule.ops}
    assert (poisoned["swap_out"] > 0) == ("swap_out" in kinds), poisoned
    assert (poisoned["fill"] > 0) == ("fetch" in kinds), poisoned
    if strategy == "swap_all":
        assert "swap_out" in kinds
    if strategy == "offload_all":
        assert "fetch" in kinds and all(b.optim == "host" for b in schedule.blocks)
    assert within_bound(report, schedule, 64 * MIB), \
        (report.peak_device_bytes, schedule.predicted.stage_peak_bytes)


def test_the_race_checks_catch_compute_that_does_not_wait_for_its_fetches(
        gpt_small, poisoned, monkeypatch, tmp_path):
    schedule = plan(gpt_small, "offload_all", 1.0, hardware=HARDWARE)
    monkeypatch.setattr("karma.runtime.runtime.make_backend", lambda kind: SkipsFetchWaits())
    report = run(schedule, gpt_small, STEPS, checkpoint_dir=tmp_path)
    ref = reference(gpt_small, host_params(schedule))
    assert report.losses != ref.losses  # NaN, or stale weights


def test_the_memory_check_catches_releases_that_come_late(gpt_small, monkeypatch):
    schedule = plan(gpt_small, "swap_all", 1.0, hardware=HARDWARE)
    monkeypatch.setattr("karma.runtime.runtime.make_backend", lambda kind: ReleasesLate())
    report = run(schedule, gpt_small, 2)
    assert not within_bound(report, schedule, 64 * MIB), \
        (report.peak_device_bytes, schedule.predicted.stage_peak_bytes)


# --- capacity ------------------------------------------------------------------------------

def test_a_smaller_gpu_emulated_trains_within_its_budget(tmp_path):
    mf = load_with_env(EXAMPLES / "gpt.py", {"KARMA_GPT": "small", "KARMA_SEQ": "512"})
    needed = keep_all_peak_bytes(mf, hardware=HARDWARE)
    schedule = plan(mf, "ilp", 0.5, hardware=HARDWARE)
    capacity = schedule.config.capacity_bytes
    backend = CudaBackend()
    _REFERENCES.clear()  # earlier tests' reference models, on this GPU
    gc.collect()
    torch.cuda.empty_cache()
    # a card with the schedule's budget, what is in use outside the allocator (the CUDA
    # context), what this process still holds in it (below the run's baseline, as a
    # framework's own tensors would be), and 256 MiB for workspaces and the allocator's
    # rounding
    card = (capacity + backend.outside_allocator_bytes() + torch.cuda.memory_allocated()
            + 256 * MIB)
    try:
        backend.cap(card)
        assert not plain_fits(mf, schedule.config.batch_size)
        report = run(schedule, mf, 3, cap_device_memory=card)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    assert needed >= 1.9 * capacity
    assert report.steps == [1, 2, 3]
    assert report.peak_device_bytes <= capacity, (report.peak_device_bytes, capacity)
    # the whole card's use: what the allocator reserved, and what was in use outside it
    assert report.device_peak_reserved_bytes + report.device_outside_allocator_bytes <= card


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


# --- two ranks on the one GPU --------------------------------------------------------------

TWO_RANKS = [("gpt", "keep_all", 1.0), ("gpt", "swap_all", 1.0), ("gpt", "offload_all", 1.0),
             ("gpt", "ilp", 0.6), ("resnet", "ilp", 0.6)]


def test_two_ranks_on_one_gpu_through_gloo_equal_the_averaged_reference(tmp_path):
    """Both ranks on this GPU, all-reducing through gloo (their gradients go through pinned
    host memory), in deterministic mode as the reference; the sum of two ranks' values is the
    same in any order, so the result must be the reference's to the bit."""
    runs, cases = [], []
    for name, strategy, fraction in TWO_RANKS:
        schedule = plan(load_small(name), strategy, fraction, world_size=2, hardware=HARDWARE)
        out = tmp_path / f"{name}-{strategy}"
        out.mkdir()
        (out / "schedule.yaml").write_text(dump_schedule(schedule))
        runs.append({"schedule": str(out / "schedule.yaml"), "out": str(out), "steps": STEPS})
        cases.append((name, schedule, out))
    job = tmp_path / "job.json"
    job.write_text(json.dumps({"runs": runs, "dist_backend": "gloo", "deterministic": True}))
    for rank, (code, _, stderr) in enumerate(
            finish(start_ranks(["-m", "tests.dist_worker", str(job)], 2), timeout_s=240)):
        assert code == 0, f"rank {rank} failed:\n{stderr[-4000:]}"
    for name, schedule, out in cases:
        ref = reference(load_small(name), host_params(schedule), world_size=2)
        saved = load_model_pt(out / "ckpt", STEPS)
        assert_bitwise_equal({k: saved[k] for k in params(ref)}, params(ref))
        for rank in range(2):
            report = json.loads((out / f"rank{rank}.json").read_text())
            assert report["dist_backend"] == "gloo" and report["world_size"] == 2
            assert report["losses"] == ref.rank_losses[rank]
            assert all(0 < t and 0 <= h <= t for t, h in zip(report["allreduce_s"],
                                                            report["allreduce_hidden_s"]))


def test_nccl_is_refused_for_ranks_that_share_a_gpu(tmp_path):
    if torch.cuda.device_count() > 1:
        pytest.skip("each rank has a GPU of its own here")
    path = tmp_path / "schedule.yaml"
    path.write_text(dump_schedule(plan(load_small("gpt"), "keep_all", world_size=2,
                                       hardware=HARDWARE)))
    procs = start_ranks(["-m", "karma.run", str(path), "--steps", "1"], 2)  # default: nccl
    for rank, (code, _, stderr) in enumerate(finish(procs, timeout_s=120)):
        assert code == 2, stderr[-2000:]
        [error] = [line for line in stderr.splitlines() if "error:" in line]
        assert error.startswith(f"karma-run (rank {rank}): error: --dist-backend nccl needs")
        assert "share GPU" in error and "--dist-backend gloo" in error
        assert "Traceback" not in stderr
