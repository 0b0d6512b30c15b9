"""The runtime replays any schedule and trains bitwise equal to plain PyTorch on the CPU.

Every schedule (baselines and the ILP at several budgets) on three small models with
dropout (gpt), BatchNorm (resnet) and a plain residual stack (mlp) must give, after three
steps, the parameters and buffers of a plain PyTorch loop bit for bit, and the same losses.
Each run is also checked to really do what its schedule says: recompute blocks run their
forward twice, streamed weights are released after use, swapped activations reach the host.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from functools import cache

import pytest
import torch

from karma.runtime.checkpoints.checkpoint import latest_checkpoint
from karma.runtime.checkpoints.dcp_state import consolidated_optimizer
from karma.runtime.checkpoints.dir_lock import LOCK_NAME
from karma.runtime.checkpoints.export import model_state_dict
from karma.runtime.host.tier import ALIGN
from karma.runtime.replay.tables import DivergedError
from karma.schedule import RECOMPUTE_ACTS
from karma.testing.exactness import (
    assert_bitwise_equal,
    block_graph,
    host_stepped,
    load_with_env,
    plan,
    reference_train,
    run,
)
from tests.matrix import MODELS, STRATEGIES, cells, first_fast, strategy_cells
from tests.runtime_helpers import LAYERS_MODEL, load_small

STEPS = 3


@cache
def reference(name: str, steps: int, **host):
    """The plain loop, `host` (host_stepped's) stepped as a schedule's host-stepped blocks."""
    mf = load_small(name)
    return reference_train(mf, block_graph(mf).batch_size, steps, **host)


def load_model_pt(directory, step: int) -> dict[str, torch.Tensor]:
    return model_state_dict(directory / f"step_{step}")


class Probe:
    """Counts forward calls of one parameter-owning module per block and keeps the model.

    The counter replaces the module's `forward` before the engine wraps it, so a recompute
    (which calls the wrapped forward again inside backward) is counted too.
    """

    def __init__(self, mf, schedule):
        self.schedule = schedule
        self.calls: dict[int, int] = {}
        self.model: torch.nn.Module | None = None
        self._build = mf.build_model
        self.mf = replace(mf, build_model=self.build)

    def build(self) -> torch.nn.Module:
        model = self._build()
        modules = dict(model.named_modules())
        owners: dict[str, int] = {}
        for b in self.schedule.blocks:
            for m in b.modules:
                owners[m] = owners.get(m, 0) + 1
        for b in self.schedule.blocks:
            name = next((m for m in b.modules
                         if owners[m] == 1 and any(True for _ in modules[m].parameters())), None)
            if name is not None:
                self.calls[b.index] = 0
                modules[name].forward = self._counted(b.index, modules[name].forward)
        self.model = model
        return model

    def _counted(self, block: int, forward):
        def counted(*args, **kwargs):
            self.calls[block] += 1
            return forward(*args, **kwargs)
        return counted


def host_optimizer_bytes(schedule, model: torch.nn.Module, state_factor: int = 2) -> int:
    """Host-tier bytes that host-optimizer blocks hold for the whole run: per parameter a
    master, a gradient and `state_factor` optimizer state tensors, each slot aligned."""
    named = dict(model.named_parameters())
    total = 0
    for b in schedule.blocks:
        if b.optim == "host":
            for n in b.params:
                nbytes = named[n].numel() * named[n].element_size()
                total += (2 + state_factor) * (-(-nbytes // ALIGN) * ALIGN)
    return total


# --- exactness -----------------------------------------------------------------------------

@pytest.mark.parametrize("name,strategy,fraction", cells(MODELS, STRATEGIES))
def test_training_is_bitwise_equal_to_plain_pytorch(name, strategy, fraction, tmp_path):
    schedule = plan(load_small(name), strategy, fraction)
    assert schedule.strategy == strategy and schedule.status != "fallback"
    ref_sd, ref_losses = reference(name, STEPS, **host_stepped(schedule))
    probe = Probe(load_small(name), schedule)

    report = run(schedule, probe.mf, STEPS, checkpoint_dir=tmp_path)

    assert report.steps == list(range(1, STEPS + 1))
    assert report.losses == ref_losses
    assert_bitwise_equal(load_model_pt(tmp_path, STEPS), ref_sd)

    # the run did what the schedule says
    acts = [b.act for b in schedule.blocks]
    expected = {"keep_all": {"keep"}, "recompute_all": {"recompute"},
                "swap_all": {"swap", "keep"}, "offload_all": {"recompute"}}
    if strategy in expected:
        assert set(acts) == expected[strategy], acts
    if strategy == "swap_all":
        assert acts[:-1] == ["swap"] * (len(acts) - 1)
    if strategy == "offload_all":
        assert all(b.weights == "streamed" and b.optim == "host" for b in schedule.blocks)
    if strategy in ("keep_all", "recompute_all", "swap_all"):
        assert all(b.weights == "resident" and b.optim == "device" for b in schedule.blocks)

    for i, calls in probe.calls.items():  # recompute runs a block's forward a second time
        factor = 2 if schedule.blocks[i].act in RECOMPUTE_ACTS else 1
        assert calls == factor * STEPS, (schedule.blocks[i].name, schedule.blocks[i].act, calls)
    assert set(probe.calls) >= {i for i, a in enumerate(acts) if a in RECOMPUTE_ACTS}

    named = dict(probe.model.named_parameters())
    for b in schedule.blocks:  # streamed weights are released after their last use
        for n in b.params:
            size = named[n].untyped_storage().nbytes()
            if b.weights == "streamed":
                assert size == 0, f"{n} of streamed block {b.name} still holds {size} bytes"
            else:
                assert size == named[n].numel() * named[n].element_size(), n

    held = host_optimizer_bytes(schedule, probe.model)
    # swapped activations, or a selective block's kept outputs, went through the host tier
    if any(b.act == "swap" or b.kept == "host" for b in schedule.blocks):
        assert report.host_tier_peak_bytes > held
    else:
        assert report.host_tier_peak_bytes == held


@pytest.mark.parametrize("strategy,fraction", strategy_cells(
    (("keep_all", 1.0), ("offload_all", 1.0), ("swap_all", 1.0), ("ilp", 0.6))))
def test_parameters_without_gradients_are_skipped_as_in_plain_pytorch(strategy, fraction,
                                                                     tmp_path):
    """An unused parameter and a frozen layer get no gradient: the optimizer must skip them
    (AdamW would otherwise decay them) wherever it runs, on the device or on the host."""
    mf = load_small("unused_frozen")
    schedule = plan(mf, strategy, fraction)
    ref_sd, ref_losses = reference("unused_frozen", STEPS, **host_stepped(schedule))
    report = run(schedule, mf, STEPS, checkpoint_dir=tmp_path)
    assert report.losses == ref_losses
    assert_bitwise_equal(load_model_pt(tmp_path, STEPS), ref_sd)
    if strategy == "offload_all":
        assert all(b.optim == "host" for b in schedule.blocks)


@pytest.mark.parametrize("name,strategy,fraction", cells(
    ("gpt", "resnet"), (("keep_all", 1.0), ("offload_all", 1.0), ("swap_all", 1.0),
                        ("ilp", 0.6))))
def test_a_model_built_in_the_host_tier_trains_exactly(name, strategy, fraction, tmp_path,
                                                       monkeypatch):
    """Every factory tensor of the build goes to the host tier (the threshold is what makes a
    real model's weights go there); the weights then move where the schedule puts them."""
    monkeypatch.setattr("karma.runtime.bringup.TIER_MIN_BYTES", 1)
    schedule = plan(load_small(name), strategy, fraction)
    ref_sd, ref_losses = reference(name, STEPS, **host_stepped(schedule))
    probe = Probe(load_small(name), schedule)
    report = run(schedule, probe.mf, STEPS, checkpoint_dir=tmp_path)
    assert report.losses == ref_losses
    assert_bitwise_equal(load_model_pt(tmp_path, STEPS), ref_sd)
    named = dict(probe.model.named_parameters())
    for b in schedule.blocks:  # resident weights left the tier: storage of their own
        for n in b.params:
            if b.weights == "resident":
                nbytes = named[n].numel() * named[n].element_size()
                assert named[n].untyped_storage().nbytes() == nbytes, n


def test_schedules_under_test_cover_every_decision():
    """The ILP budgets above really mix decisions (else the exactness tests prove little)."""
    seen, kept = set(), set()
    for cell in cells(MODELS, STRATEGIES):
        name, strategy, fraction = cell.values
        s = plan(load_small(name), strategy, fraction)
        seen |= {(b.act, b.weights, b.optim) for b in s.blocks if strategy == "ilp"}
        kept |= {b.kept for b in s.blocks if strategy == "ilp" and b.act == "selective"}
    acts, weights, optims = ({c[k] for c in seen} for k in range(3))
    # (a whole recompute: recompute_all's and offload_all's cells, where the ILP prefers
    # selective)
    assert acts >= {"keep", "swap", "selective"}
    # selective blocks keeping their outputs on the host (on the device: selective_all's
    # cells, and tests/test_selective.py)
    assert "host" in kept
    assert weights == {"resident", "streamed"}
    assert optims == {"device", "host"}
    # resident weights with host master copies
    assert any((w, o) == ("resident", "host") for _, w, o in seen)


# --- checkpoints ---------------------------------------------------------------------------

@pytest.mark.parametrize("name,strategy,fraction",
                         [("gpt", "offload_all", 1.0), ("resnet", "ilp", 0.6),
                          ("mlp", "keep_all", 1.0)])
def test_checkpoint_format(name, strategy, fraction, tmp_path):
    mf = load_small(name)
    schedule = plan(mf, strategy, fraction)
    run(schedule, mf, 2, checkpoint_dir=tmp_path)
    d = tmp_path / "step_2"
    # no temporaries left; the run's lock of the directory (dir_lock.py)
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK_NAME, "step_2"]
    assert sorted(p.name for p in d.iterdir()) == ["extras.pt", "meta.json", "state"]
    assert sorted(p.name for p in (d / "state").iterdir()) == [".metadata", "__0_0.distcp"]

    state = model_state_dict(d)  # what karma-export writes
    fresh = mf.build_model()
    assert list(state) == list(fresh.state_dict())  # exactly its keys, tied ones included
    fresh.load_state_dict(state, strict=True)

    meta = json.loads((d / "meta.json").read_text())
    assert meta["step"] == 2 and meta["complete"] is True and meta["world_size"] == 1
    extras = torch.load(d / "extras.pt", weights_only=True)
    assert len(extras["optimizers"]) == len(schedule.blocks)
    # the optimizer state, whole, by DCP's own reader: AdamW's moments of every parameter
    state = consolidated_optimizer(d / "state")
    assert set(state) == {n for b in schedule.blocks for n in b.params}
    for name, entries in state.items():
        assert entries["exp_avg"].shape == fresh.state_dict()[name].shape
    assert latest_checkpoint(tmp_path) == d


def test_a_checkpoint_of_host_weights_holds_only_the_weights_and_their_state(tmp_path):
    # offload_all keeps every weight and AdamW's moments as views into the host tier's arena
    # (64 MiB or more); the checkpoint must hold their own bytes (three times the weights),
    # not the arena, and not via private clones (see [Note: saving views of the host tier]
    # in karma/runtime/checkpoints/checkpoint.py).
    mf = load_small("gpt")
    run(plan(mf, "offload_all"), mf, 1, checkpoint_dir=tmp_path)
    param_bytes = sum(p.numel() * p.element_size() for p in mf.build_model().parameters())
    size = sum(f.stat().st_size for f in (tmp_path / "step_1" / "state").iterdir())
    assert 3 * param_bytes < size < 3 * param_bytes + (256 << 10), f"state/ is {size} bytes"
    assert not list((tmp_path / "step_1").glob("scratch*"))


RESUME_CASES = [("gpt", "ilp", 0.5), ("resnet", "ilp", 0.6), ("gpt", "keep_all", 1.0)]


@pytest.mark.parametrize("name,strategy,fraction", first_fast(RESUME_CASES))
def test_resume_continues_exactly(name, strategy, fraction, tmp_path):
    mf = load_small(name)
    schedule = plan(mf, strategy, fraction)
    if strategy == "ilp":  # resume must restore streamed masters and host optimizer state
        assert {b.weights for b in schedule.blocks} == {"resident", "streamed"}
        acts = {b.act for b in schedule.blocks}
        assert "keep" in acts and acts & set(RECOMPUTE_ACTS)
    whole, parts = tmp_path / "whole", tmp_path / "parts"

    full = run(schedule, mf, 4, checkpoint_dir=whole, checkpoint_every=2)
    first = run(schedule, mf, 2, checkpoint_dir=parts)
    lines: list[str] = []
    second = run(schedule, mf, 4, checkpoint_dir=parts, resume=True, log=lines.append)

    assert any("resumed from" in line and "step 2" in line for line in lines), lines
    assert second.steps == [3, 4]
    assert first.losses + second.losses == full.losses
    assert_bitwise_equal(load_model_pt(parts, 4), load_model_pt(whole, 4))
    assert_bitwise_equal(load_model_pt(parts, 2), load_model_pt(whole, 2))
    ref_sd, ref_losses = reference(name, 4, **host_stepped(schedule))
    assert full.losses == ref_losses
    assert_bitwise_equal(load_model_pt(whole, 4), ref_sd)


@pytest.mark.slow
@pytest.mark.parametrize("name,before,after", [("gpt", "keep_all", "offload_all"),
                                               ("resnet", "offload_all", "swap_all")])
def test_a_checkpoint_resumes_under_another_schedule(name, before, after, tmp_path):
    """A checkpoint holds the model's values, not the schedule's placement of them (the host
    steps as given, so that every step is the plain loop's whatever the schedule)."""
    mf = load_small(name)
    run(plan(mf, before), mf, 2, checkpoint_dir=tmp_path, host_optimizer="as-given")
    report = run(plan(mf, after), mf, 4, checkpoint_dir=tmp_path, resume=True,
                 host_optimizer="as-given")
    ref_sd, ref_losses = reference(name, 4)
    assert report.losses == ref_losses[2:]
    assert_bitwise_equal(load_model_pt(tmp_path, 4), ref_sd)


def test_half_written_checkpoints_are_ignored(tmp_path):
    mf = load_small("mlp")
    schedule = plan(mf, "keep_all")
    run(schedule, mf, 2, checkpoint_dir=tmp_path)
    good = tmp_path / "step_2"
    torn = tmp_path / "step_5"  # killed before meta.json was written
    shutil.copytree(good / "state", torn / "state")
    hidden = tmp_path / ".step_6.tmp123"  # killed before the rename
    shutil.copytree(good, hidden)
    meta = json.loads((good / "meta.json").read_text())
    (hidden / "meta.json").write_text(json.dumps({**meta, "step": 6}))
    missing = tmp_path / "step_7"  # meta.json but no extras.pt
    shutil.copytree(good / "state", missing / "state")
    (missing / "meta.json").write_text(json.dumps({**meta, "step": 7}))
    partial = tmp_path / "step_8"  # a meta.json that does not say complete
    shutil.copytree(good, partial)
    (partial / "meta.json").write_text(json.dumps({**meta, "step": 8, "complete": False}))

    assert latest_checkpoint(tmp_path) == good
    report = run(schedule, mf, 3, checkpoint_dir=tmp_path, resume=True)
    assert report.steps == [3]
    _, ref_losses = reference("mlp", 3, **host_stepped(schedule))
    assert report.losses == ref_losses[2:]


def test_latest_checkpoint_of_a_missing_or_empty_directory(tmp_path):
    assert latest_checkpoint(tmp_path / "nothing") is None
    assert latest_checkpoint(tmp_path) is None
    assert latest_checkpoint(None) is None


# --- divergence ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def layers_model(tmp_path_factory):
    """The three-layer model file, loaded (and traced, on first plan) once for this module."""
    path = tmp_path_factory.mktemp("divergence") / "layers.py"
    path.write_text(LAYERS_MODEL)
    return load_with_env(path)


@pytest.mark.parametrize("strategy", ["keep_all", "offload_all"])
def test_the_layers_model_trains_exactly_in_its_planned_order(layers_model, strategy, tmp_path):
    schedule = plan(layers_model, strategy)
    assert [b.name for b in schedule.blocks] == ["layers.0", "layers.1", "layers.2"]
    ref_sd, ref_losses = reference_train(layers_model, schedule.config.batch_size, 2,
                                         schedule=schedule)
    report = run(schedule, layers_model, 2, checkpoint_dir=tmp_path)
    assert report.losses == ref_losses
    assert_bitwise_equal(load_model_pt(tmp_path, 2), ref_sd)


@pytest.mark.parametrize("order", first_fast(["2,1,0", "0,2", "0,1", "0,1,2,1"]))
@pytest.mark.parametrize("strategy", first_fast(["offload_all", "keep_all", "swap_all"]))
def test_execution_that_leaves_the_schedule_fails_loudly(layers_model, strategy, order,
                                                         tmp_path, monkeypatch):
    # every tensor these layers save is also saved by a neighbour (x and tanh(x)), so a swap's
    # copies duplicate them: swap_all needs more than keep_all here
    schedule = plan(layers_model, strategy, fraction=1.5 if strategy == "swap_all" else 1.0)
    monkeypatch.setenv("LAYER_ORDER", order)
    with pytest.raises(DivergedError, match="diverged from the schedule: expected"):
        run(schedule, layers_model, 1, checkpoint_dir=tmp_path)
    assert latest_checkpoint(tmp_path) is None  # nothing was saved


@pytest.mark.parametrize("order", ["0,1,1,2", "0,0,1,2"])
def test_a_block_called_twice_in_a_row_fails_loudly(layers_model, order, monkeypatch):
    schedule = plan(layers_model, "keep_all")
    monkeypatch.setenv("LAYER_ORDER", order)
    with pytest.raises(DivergedError):
        run(schedule, layers_model, 1)
