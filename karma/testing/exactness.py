"""A model file planned in process and trained by the runtime, beside plain PyTorch.

    mf = load_with_env("examples/gpt.py", SMALL_ENV["gpt"])
    ref_sd, ref_losses = reference_train(mf, batch_size=4, steps=3)
    schedule = plan(mf, "ilp", 0.6)              # 60% of what keep_all needs
    report = run(schedule, mf, 3, checkpoint_dir=tmp_path)
    assert_bitwise_equal(model_state_dict(tmp_path / "step_3"), ref_sd)

karma's exactness promise, checked: the parameters a schedule trains are bitwise those of the
plain loop (karma.reference) with the same optimizer kernel. Block graphs and schedules are
cached per loaded model file: tracing costs a second or two.
"""

from __future__ import annotations

import dataclasses
import os
from unittest import mock

import torch

from karma.fingerprint import model_ref
from karma.ir.build import build_block_graph
from karma.ir.graph import BlockGraph
from karma.ir.optimizer import optimizer_profile
from karma.modelfile import ModelFile, load_model_file
from karma.planner.baselines import BASELINES
from karma.planner.hardware import load_hardware
from karma.planner.lowering import PLAIN, Choice, Training
from karma.planner.options import PlanOptions
from karma.planner.pairs import can_pair
from karma.planner.pipeline import make_schedule
from karma.planner.plan import evaluate
from karma.planner.problem import build_problem
from karma.reference import host_stepped, train_reference
from karma.runtime.loop import RunOptions, RunReport, train
from karma.schedule import Schedule
from karma.schedule import model_env as schedule_model_env

# the examples at their test sizes: the environment that makes examples/NAME.py small
SMALL_ENV = {
    "mlp": {"KARMA_MLP_WIDTH": "64", "KARMA_MLP_DEPTH": "4", "KARMA_MLP_IN": "32"},
    "gpt": {"KARMA_GPT": "tiny"},
    "resnet": {"KARMA_RESNET": "tiny"},
    "hf_gpt2": {"KARMA_HF_GPT2": "tiny"},
}

HARDWARE = "cpu"


def mixing(hw):
    """`hw` with independent streams: what the ILP plans of the exactness tests are made for.
    On shared cores every copy costs its whole time ([Note: every stream on shared cores
    conserves work]), and on these small models recomputing is then always cheaper than
    swapping: the ILP would never mix in a swap, and the exactness tests would prove less.
    The decisions, not the rates, are what those tests are about."""
    return hw.independent_streams()

# id(ModelFile) -> (the ModelFile, kept alive so that its id stays unique; its KARMA_* env)
_LOADED: dict[int, tuple[ModelFile, tuple[tuple[str, str], ...]]] = {}
# (id(ModelFile), dtype) -> its BlockGraph
_GRAPHS: dict[tuple[int, str], BlockGraph] = {}
# (id(mf), id(graph), strategy, fraction, seed, world_size, hardware) -> Schedule; graphs
# given are kept alive
_SCHEDULES: dict[tuple, Schedule] = {}
_KEEP_ALIVE: list[BlockGraph] = []


def load_with_env(path, env: dict[str, str] | None = None) -> ModelFile:
    """Load a model file with `env` set while it imports (model files read sizes then)."""
    env = dict(env or {})
    with mock.patch.dict(os.environ, env):
        mf = load_model_file(path)
    _LOADED[id(mf)] = (mf, tuple(sorted(env.items())))
    return mf


def model_env(mf: ModelFile) -> tuple[tuple[str, str], ...]:
    """The KARMA_* variables `mf` was loaded with (or those set now, for other loads)."""
    if id(mf) in _LOADED:
        return _LOADED[id(mf)][1]
    return schedule_model_env()


def block_graph(mf: ModelFile, dtype: str = "fp32") -> BlockGraph:
    """The model's block graph at its default batch size, traced once per loaded model file
    and compute dtype."""
    if (id(mf), dtype) not in _GRAPHS:
        _LOADED.setdefault(id(mf), (mf, model_env(mf)))
        _GRAPHS[id(mf), dtype] = build_block_graph(mf, None, model_name=str(mf.path),
                                                   dtype=dtype)
    return _GRAPHS[id(mf), dtype]


def reference_train(mf: ModelFile, batch_size: int, steps: int, seed: int = 0,
                    world_size: int = 1, schedule: Schedule | None = None, **training):
    """Plain PyTorch training on the CPU (karma.reference): (final state_dict, the loss of
    each step; rank 0's with world_size > 1). `training`: dtype, accumulate, clip_grad_norm.
    `schedule`: the parameters its blocks step on the host are stepped with its host kernel
    (host_stepped), as karma steps them."""
    ref = train_reference(mf, batch_size, steps, seed, world_size,
                          **host_stepped(schedule), **training)
    return {k: v.detach().clone() for k, v in ref.model.state_dict().items()}, ref.losses


def keep_all_peak_bytes(mf: ModelFile, graph: BlockGraph | None = None,
                        world_size: int = 1, hardware: str = HARDWARE,
                        training: Training = PLAIN) -> int:
    """The planner's stage peak of keep_all (in the graph's dtype, with `training`): the
    budget at which everything fits."""
    graph = graph or block_graph(mf)
    problem = build_problem(graph, load_hardware(hardware), dtype=graph.dtype,
                            world_size=world_size)
    plan = BASELINES["keep_all"](problem, 1 << 60, training)
    return evaluate(problem, plan, 1 << 60, training).stage_peak_bytes


def plan(mf: ModelFile, strategy: str, fraction: float = 1.0,
         graph: BlockGraph | None = None, seed: int = 0, world_size: int = 1,
         hardware: str = HARDWARE, dtype: str = "fp32", accumulate: int = 1,
         clip_grad_norm: float | None = None, host_state: str = "auto",
         nproc_per_node: int | None = None, kept_on_host: bool = False,
         paired: bool = False) -> Schedule:
    """Plan `mf` in-process at `fraction` of keep_all's stage peak (with the same training
    options), for the CPU backend (or the hardware profile named), its host state as asked
    (karma-plan's --host-state). `kept_on_host`: a baseline's recompute blocks made
    selective, all but the last keeping their policy's outputs on the host (kept: host).
    `paired`: a baseline's recomputing blocks recomputed two under one checkpoint wherever
    the blocks allow it (Choice.with_next).

    Raises InfeasiblePlan when the strategy does not fit that budget.
    """
    graph = graph or block_graph(mf, dtype)
    training = (dtype, accumulate, clip_grad_norm)
    key = (id(mf), id(graph), strategy, fraction, seed, world_size, hardware, training,
           host_state, nproc_per_node, kept_on_host, paired)
    if key not in _SCHEDULES:
        _LOADED.setdefault(id(mf), (mf, model_env(mf)))
        _KEEP_ALIVE.append(graph)
        baselines = {strategy: _kept_on_host(BASELINES[strategy])} if kept_on_host else {}
        if paired:
            baselines = {strategy: _paired(baselines.get(strategy, BASELINES[strategy]))}
        with mock.patch.dict(BASELINES, baselines):
            _SCHEDULES[key] = _plan(mf, graph, strategy, fraction, seed, world_size, hardware,
                                    training, host_state, nproc_per_node)
    return _SCHEDULES[key]


def _kept_on_host(baseline):
    """`baseline` with its recompute blocks selective (the IR's first policy), what they
    keep on the host but in the last block, whose backward comes next (those of several
    module calls, which cannot keep on the host, left as they are)."""
    def kept_on_host(problem, capacity_bytes, training=PLAIN):
        plan = baseline(problem, capacity_bytes, training)
        n = len(problem.blocks)
        choices = tuple(
            Choice("selective", c.weights, c.optim, 1, b.selective[0].policy,
                   kept="host" if i < n - 1 else "device")
            if c.act == "recompute" and b.selective and b.selective[0].leaves else c
            for i, (b, c) in enumerate(zip(problem.blocks, plan.choices)))
        return dataclasses.replace(plan, choices=choices)
    return kept_on_host


def _paired(baseline):
    """`baseline` with its recomputing blocks paired, from the first block up, wherever the
    blocks allow it (BlockCost.joins_next, the first's weights resident, the second
    can_pair), whether or not the planner would offer it (pairs.offers_pair)."""
    def paired(problem, capacity_bytes, training=PLAIN):
        plan = baseline(problem, capacity_bytes, training)
        choices = list(plan.choices)
        for i in range(len(choices) - 1):
            c, d = choices[i], choices[i + 1]
            if not c.with_prev and problem.blocks[i].joins_next and can_pair(c) \
                    and c.weights == "resident" and can_pair(d):
                choices[i] = dataclasses.replace(c, with_next=True)
                choices[i + 1] = dataclasses.replace(d, with_prev=True)
        return dataclasses.replace(plan, choices=tuple(choices))
    return paired


def _plan(mf: ModelFile, graph: BlockGraph, strategy: str, fraction: float,
          seed: int, world_size: int, hardware: str,
          training: tuple[str, int, float | None] = ("fp32", 1, None),
          host_state: str = "auto", nproc_per_node: int | None = None) -> Schedule:
    dtype, accumulate, clip = training
    capacity = int(keep_all_peak_bytes(mf, graph, world_size, hardware,
                                       Training(accumulate, clip is not None)) * fraction)
    model = model_ref(str(mf.path), mf, graph.to_json(), model_env(mf))
    hw = load_hardware(hardware)
    if strategy == "ilp" and hardware == HARDWARE:
        hw = mixing(hw)
    options = PlanOptions(gpu_mem=capacity, hardware=hw, batch_size=graph.batch_size,
                          seed=seed, strategy=strategy, time_limit_s=30.0,
                          world_size=world_size, dtype=dtype, accumulate=accumulate,
                          clip_grad_norm=clip, host_state=host_state,
                          nproc_per_node=nproc_per_node or world_size)
    return make_schedule(graph, model, options, optimizer=optimizer_profile(mf)).schedule


def run(schedule: Schedule, mf: ModelFile, steps: int, **options) -> RunReport:
    """Train `mf` for `steps` steps by replaying `schedule` (options: RunOptions fields)."""
    options.setdefault("log", lambda line: None)
    return train(schedule, mf, RunOptions(steps=steps, **options))


def assert_bitwise_equal(sd_a: dict[str, torch.Tensor], sd_b: dict[str, torch.Tensor]) -> None:
    """Same keys, and torch.equal (same shape, dtype and every bit of value) for each."""
    missing, extra = sorted(sd_b.keys() - sd_a.keys()), sorted(sd_a.keys() - sd_b.keys())
    if missing or extra:
        raise AssertionError(f"keys differ: missing {missing}, unexpected {extra}")
    differ = []
    for k in sd_a:
        a, b = sd_a[k], sd_b[k]
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            if a.shape == b.shape and a.is_floating_point() and b.is_floating_point():
                gap = (a.double() - b.double()).abs().max().item()
                differ.append(f"{k} (max |diff| {gap:.3g})")
            else:
                differ.append(f"{k} ({a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)})")
    if differ:
        raise AssertionError(f"{len(differ)} of {len(sd_a)} tensors differ: "
                             f"{', '.join(differ)}")
