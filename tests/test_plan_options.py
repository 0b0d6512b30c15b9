"""PlanOptions: what karma-plan's flags and karma.plan's keyword arguments both make, checked
once, with errors that name the option, its flag and the fix."""

from __future__ import annotations

import dataclasses

import pytest

from karma.api import plan_options
from karma.cli.plan import _parser, options_from
from karma.errors import KarmaError
from karma.planner.hardware import load_hardware
from karma.planner.options import PlanOptions


def test_the_cli_and_the_api_make_the_same_options():
    args = _parser().parse_args([
        "model.py", "--gpu-mem", "6G", "--hardware", "h100-80g", "--batch-size", "4",
        "--world-size", "8", "--nproc-per-node", "4", "--host-mem", "512G",
        "--host-state", "sharded", "--dtype", "bf16", "--accumulate", "2",
        "--clip-grad-norm", "1.0", "--strategy", "greedy", "--seed", "3", "--time-limit", "9",
        "--gap", "0.02", "--blocks", "h\\.\\d+", "--remeasure"])
    from_api = plan_options(gpu_mem="6G", hardware="h100-80g", batch_size=4, world_size=8,
                            nproc_per_node=4, host_mem="512G", host_state="sharded",
                            dtype="bf16", accumulate=2, clip_grad_norm=1.0, strategy="greedy",
                            seed=3, time_limit_s=9.0, gap=0.02, blocks="h\\.\\d+",
                            measure="fresh")
    assert options_from(args) == from_api
    assert from_api.gpu_mem == 6 << 30 and from_api.host_mem == 512 << 30  # parsed once
    assert from_api.profile == load_hardware("h100-80g") and from_api.ranks_per_node == 4


def test_defaults_resolve_from_the_profile():
    o = PlanOptions(gpu_mem=1 << 30, hardware="h100-80g", world_size=16)
    assert o.ranks_per_node == 8  # the profile's devices per node
    assert PlanOptions(hardware="cpu", world_size=3).ranks_per_node == 3  # every rank on one machine
    assert PlanOptions().measure == "cached" and PlanOptions().gpu_mem is None


@pytest.mark.parametrize("options, says", [
    ({"gpu_mem": "16Q"}, "--gpu-mem '16Q' is not a size"),
    ({"gpu_mem": 0}, "the memory budget 0 (gpu_mem, --gpu-mem) must be more than zero"),
    ({"host_mem": "-1G"}, "--host-mem '-1G' is not a size"),
    ({"batch_size": 0}, "batch_size 0 (--batch-size) must be a whole number"),
    ({"batch_size": "most"}, "or max or best"),
    ({"strategy": "fastest"}, "strategy 'fastest' (--strategy) is not a strategy; use one of "
                              "ilp, "),
    ({"time_limit_s": 0}, "--time-limit"),
    ({"gap": 1.0}, "the gap 1.0 (--gap) in [0, 1)"),
    ({"measure": "again"}, "measure 'again' is not a way to measure; use one of cached, "
                           "fresh, estimate"),
    ({"dtype": "fp16"}, "use --dtype bf16"),
    ({"accumulate": 0}, "accumulate 0 (--accumulate)"),
    ({"clip_grad_norm": -1.0}, "clip_grad_norm -1.0 (--clip-grad-norm)"),
    ({"host_state": "shared"}, "host_state 'shared' (--host-state)"),
    ({"world_size": 3, "hardware": "h100-80g", "nproc_per_node": 2},
     "--world-size 3 is not a multiple of --nproc-per-node 2"),
    ({"hardware": "v100-16x"}, "unknown hardware 'v100-16x' (did you mean 'v100-16g'?)"),
])
def test_a_bad_option_is_one_error_that_names_its_flag(options, says):
    with pytest.raises(KarmaError) as info:
        PlanOptions(**options)
    assert says in str(info.value)


def test_an_unknown_option_names_the_known_ones():
    with pytest.raises(KarmaError, match="'batchsize' is not a planning option; the options "
                                         "are gpu_mem, hardware, batch_size, "):
        plan_options(batchsize=8)


def test_a_changed_option_is_checked_again():
    o = PlanOptions(gpu_mem="1G", hardware="h100-80g", world_size=8)
    with pytest.raises(KarmaError, match="--world-size 8 is not a multiple of --nproc-per-node 3"):
        dataclasses.replace(o, nproc_per_node=3)
    assert dataclasses.replace(o, gpu_mem="2G").gpu_mem == 2 << 30


def test_planning_needs_a_budget_and_says_so():
    with pytest.raises(KarmaError, match="--gpu-mem is required to plan"):
        PlanOptions().check_plannable()
