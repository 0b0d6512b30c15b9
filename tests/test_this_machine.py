"""Planning without --hardware: this machine's profile, chosen and said in one line
(karma/calibrate/machine.py, this_machine; PlanOptions(hardware=None))."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from karma.calibrate.machine import gpu_profile, local_device, local_profile, this_machine
from karma.cli.plan import main as plan_main
from karma.planner.hardware import load_hardware
from karma.planner.options import PlanOptions
from tests.conftest import MODELS

MODEL = str(MODELS / "mlp_schedule.py")
GIB = 1 << 30


@pytest.fixture
def no_gpu(monkeypatch):
    """This machine without a GPU, whatever it has."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_without_a_gpu_the_default_is_the_cpu_profile(no_gpu):
    options = PlanOptions(gpu_mem="100M")
    assert options.hardware == "cpu" and options.profile == load_hardware("cpu")
    assert options.machine_notes == ("planning for this machine: cpu (no GPU found); give "
                                     "--hardware NAME to plan for another",)
    assert PlanOptions(gpu_mem="100M", hardware="v100-16g").machine_notes == ()


@pytest.mark.parametrize("gpu, profile", [
    (("NVIDIA H200", 150_011_000_000), "h200-141g"),
    (("NVIDIA H100 80GB HBM3", 85_045_000_000), "h100-80g"),
    (("NVIDIA A100-SXM4-40GB", 42_298_000_000), "a100-40g"),
    (("NVIDIA A100-SXM4-80GB", 85_090_000_000), "a100-80g"),
    (("Tesla V100-PCIE-16GB", 16_945_000_000), "v100-16g"),
    (("Tesla V100-SXM2-32GB", 34_089_000_000), None),  # a V100, but not of 16 GB
    (("NVIDIA L4", 23_580_000_000), None),  # no built-in profile of its family
])
def test_a_gpu_is_the_built_in_profile_of_its_family_and_memory(gpu, profile):
    assert gpu_profile(*gpu) == profile


def test_a_gpu_with_a_built_in_profile_plans_on_it():
    machine = this_machine(gpu=("NVIDIA H200", 150_011_000_000),
                           measure=lambda: pytest.fail("a known GPU is not measured here"))
    assert machine.hardware == "h200-141g" and machine.guess is None
    assert machine.chosen == "h200-141g (the NVIDIA H200)"


def test_a_gpu_without_one_is_measured_and_its_node_a_guess():
    measured = dataclasses.replace(load_hardware("h100-80g"), name="local-nvidia-l4",
                                   device_mem_bytes=23_580_000_000, devices_per_node=1)
    machine = this_machine(gpu=("NVIDIA L4", 23_580_000_000), measure=lambda: measured)
    assert machine.hardware is measured
    assert machine.chosen.startswith("local-nvidia-l4, the NVIDIA L4 measured (no built-in "
                                     "profile is a GPU of its name and 22.0 GiB)")
    assert machine.guess.startswith("the sizes of local-nvidia-l4's node are a guess: one GPU")
    assert "karma-profile -o FILE" in machine.guess


def test_this_machines_measured_profile_is_this_machine(no_gpu):
    assert local_device(load_hardware("cpu")) is None  # built-in numbers: anyone's machine
    measured = local_profile("cpu", lambda line: None)  # karma-profile --quick, cached for the test run
    assert local_device(measured) == "cpu"
    assert local_device(load_hardware("v100-16g")) is None


def test_karma_plan_without_hardware_plans_for_this_cpu(no_gpu, capsys):
    assert plan_main([MODEL, "--gpu-mem", "100M", "--no-measure", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["feasible"] is True
    assert err.splitlines()[0] == ("karma-plan: planning for this machine: cpu (no GPU found); "
                                   "give --hardware NAME to plan for another")
    assert plan_main([MODEL, "--gpu-mem", "100M", "--no-measure"]) == 0
    out, err = capsys.readouterr()
    assert "1 rank(s) on cpu, budget 100 MiB" in out
    # named, the hardware is as asked and nothing is said about it
    assert plan_main([MODEL, "--gpu-mem", "100M", "--no-measure", "--hardware", "v100-16g"]) == 0
    out, err = capsys.readouterr()
    assert "on v100-16g" in out and "planning for this machine" not in err


@pytest.mark.slow
def test_karma_plan_without_hardware_measures_this_cpu(no_gpu, capsys):
    assert plan_main([MODEL, "--gpu-mem", "100M", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["block_times"] == "measured", err
    assert "planning for this machine: cpu (no GPU found)" in err
