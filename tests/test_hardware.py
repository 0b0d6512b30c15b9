"""Hardware profiles: built-ins, YAML round trips, input errors, and measuring this machine."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import yaml

from karma.errors import KarmaError
from karma.planner.hardware import (
    DTYPES,
    Hardware,
    builtin_names,
    dump_hardware,
    hardware_from_yaml,
    load_hardware,
)
from karma.units import format_bytes, format_number, format_seconds, parse_size

GiB = 1024**3


def make_hardware(**overrides) -> Hardware:
    values = dict(
        name="test-gpu",
        device_kind="cuda",
        device_mem_bytes=16 * GiB,
        flops_per_s={"fp32": 1.2e13, "bf16": 9.0e13},
        mem_bytes_per_s=8.0e11,
        h2d_bytes_per_s=1.2e10,
        d2h_bytes_per_s=1.3e10,
        host_mem_bytes=512 * GiB,
        pinned_mem_bytes=256 * GiB,
        host_optim_bytes_per_s=3.0e9,
        net_bytes_per_s=1.25e10,
        net_latency_s=5e-6,
    )
    values.update(overrides)
    return Hardware(**values)


# ---------------------------------------------------------------------------------------------
# Built-in profiles


def test_builtins_are_the_documented_set():
    assert builtin_names() == ["a100-40g", "a100-80g", "cpu", "h100-80g", "h200-141g", "v100-16g"]


@pytest.mark.parametrize("name", builtin_names())
def test_builtin_loads_and_round_trips_exactly(name, tmp_path):
    hw = load_hardware(name)
    assert hw.name == name
    text = dump_hardware(hw)
    again = hardware_from_yaml(text)
    assert again == hw
    assert dump_hardware(again) == text
    path = tmp_path / f"{name}.yaml"
    path.write_text(text)
    assert load_hardware(str(path)) == hw
    # Plain types only, in the fixed key order.
    data = yaml.safe_load(text)
    # (the contention fractions only where not 0: independent streams need none)
    # and devices_per_node only where not 1, as in profiles from before it
    assert list(data) == ["version", *(
        f.name for f in dataclasses.fields(Hardware)
        if getattr(hw, f.name) != f.default or f.default is dataclasses.MISSING)]
    assert list(data["flops_per_s"]) == list(DTYPES)
    assert all(type(data[k]) is int for k in ("device_mem_bytes", "host_mem_bytes"))
    assert all(type(v) is float for v in data["flops_per_s"].values())


def test_builtin_numbers_are_the_documented_ones():
    a100 = load_hardware("a100-80g")
    assert a100.device_kind == "cuda"
    assert a100.flops_per_s["bf16"] == 2.5e14
    assert a100.h2d_bytes_per_s == 2.4e10
    assert a100.net_bytes_per_s == 2.5e10 and a100.net_latency_s == 5e-6
    # each profile is a real node: its GPUs, and the host memory they share
    nodes = {"v100-16g": (4, 384), "a100-40g": (8, 1024), "a100-80g": (8, 2048),
             "h100-80g": (8, 2048), "h200-141g": (8, 2048), "cpu": (1, 64)}
    for name, (devices, host_gib) in nodes.items():
        hw = load_hardware(name)
        assert (hw.devices_per_node, hw.host_mem_bytes) == (devices, host_gib << 30), name
    h200 = load_hardware("h200-141g")
    assert h200.flops_per_s["bf16"] == 7.0e14 and h200.h2d_bytes_per_s == 5.0e10
    assert h200.device_mem_bytes > load_hardware("h100-80g").device_mem_bytes
    v100 = load_hardware("v100-16g")
    assert v100.flops_per_s["fp32"] == 1.2e13 and v100.h2d_bytes_per_s == 1.2e10
    cpu = load_hardware("cpu")
    assert cpu.device_kind == "cpu" and cpu.flops_per_s["fp32"] == 5.0e10
    # a CPU's copies and host steps share its cores; a GPU's streams are independent
    assert (cpu.compute_slowdown_copy, cpu.copy_slowdown_compute, cpu.compute_slowdown_host,
            cpu.host_slowdown_compute) == (0.5, 0.5, 0.4, 0.6)  # each pair adds up to 1
    assert cpu.h2d_bytes_per_s == cpu.d2h_bytes_per_s == 4.0e9
    for name in builtin_names():
        hw = load_hardware(name)
        assert hw.pinned_mem_bytes <= hw.host_mem_bytes
        if hw.device_kind == "cuda":
            assert hw.compute_slowdown_copy == hw.compute_slowdown_host == 0


def test_hardware_is_hashable_immutable_and_copyable():
    hw = make_hardware()
    assert hash(hw) == hash(make_hardware())
    assert {hw: 1}[make_hardware()] == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        hw.name = "other"
    with pytest.raises(TypeError):
        hw.flops_per_s["fp32"] = 1.0
    assert pickle.loads(pickle.dumps(hw)) == hw
    assert copy.deepcopy(hw) == hw
    assert dataclasses.replace(hw, name="other").flops_per_s == hw.flops_per_s
    assert dataclasses.asdict(hw)["flops_per_s"]["bf16"] == 9.0e13
    with pytest.raises(KeyError, match="fp16"):
        hw.flops_per_s["fp16"]


# ---------------------------------------------------------------------------------------------
# Validation


@pytest.mark.parametrize(
    "override, words",
    [
        ({"device_kind": "tpu"}, ["device_kind", "'tpu'", "'cuda' or 'cpu'"]),
        ({"h2d_bytes_per_s": -1.0}, ["h2d_bytes_per_s", "-1.0", "positive", "karma-profile"]),
        ({"net_latency_s": 0}, ["net_latency_s", "positive"]),
        ({"mem_bytes_per_s": float("nan")}, ["mem_bytes_per_s", "nan"]),
        ({"device_mem_bytes": 16.5e9}, ["device_mem_bytes", "whole number of bytes"]),
        ({"host_mem_bytes": True}, ["host_mem_bytes"]),
        ({"flops_per_s": {"fp32": 1e13}}, ["flops_per_s", "bf16"]),
        ({"flops_per_s": {"fp32": 1e13, "bf16": 1e14, "fp8": 1e15}}, ["fp8", "fp32, bf16"]),
        ({"flops_per_s": {"fp32": 1e13, "bf16": "fast"}}, ["flops_per_s.bf16", "'fast'"]),
        ({"pinned_mem_bytes": 600 * GiB}, ["pinned_mem_bytes", "host_mem_bytes", "lower"]),
        ({"name": ""}, ["name", "non-empty"]),
    ],
)
def test_bad_field_is_named_with_value_and_fix(override, words):
    with pytest.raises(KarmaError) as excinfo:
        make_hardware(**override)
    for word in words:
        assert word in str(excinfo.value)


def test_int_rates_become_floats():
    hw = make_hardware(mem_bytes_per_s=800_000_000_000, flops_per_s={"fp32": 12, "bf16": 90})
    assert type(hw.mem_bytes_per_s) is float and hw.mem_bytes_per_s == 8e11
    assert type(hw.flops_per_s["fp32"]) is float


# ---------------------------------------------------------------------------------------------
# Loading errors


def test_unknown_name_lists_the_builtins_and_the_file_option():
    with pytest.raises(KarmaError) as excinfo:
        load_hardware("v200")
    message = str(excinfo.value)
    assert message.startswith("unknown hardware 'v200'")
    for name in builtin_names():
        assert name in message
    assert "karma-profile -o FILE" in message


def test_near_miss_name_gets_a_suggestion():
    with pytest.raises(KarmaError, match="did you mean 'a100-80g'"):
        load_hardware("a100-80")


def test_missing_file_is_named(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(KarmaError, match="nope.yaml' does not exist"):
        load_hardware(str(missing))


def test_file_missing_a_key_names_it(tmp_path):
    data = yaml.safe_load(dump_hardware(make_hardware()))
    del data["h2d_bytes_per_s"]
    path = tmp_path / "hw.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(KarmaError) as excinfo:
        load_hardware(str(path))
    message = str(excinfo.value)
    assert str(path) in message
    assert "missing key 'h2d_bytes_per_s'" in message


def test_file_with_an_unknown_key_names_it():
    text = dump_hardware(make_hardware()) + "h2d_bytes_per_sec: 1.0e+10\n"
    with pytest.raises(KarmaError, match="unknown key 'h2d_bytes_per_sec'"):
        hardware_from_yaml(text, "hw.yaml")


def test_file_errors_name_the_file_and_field():
    text = dump_hardware(make_hardware()).replace("device_kind: cuda", "device_kind: gpu")
    with pytest.raises(KarmaError, match=r"^hw.yaml: hardware 'test-gpu': device_kind 'gpu'"):
        hardware_from_yaml(text, "hw.yaml")
    with pytest.raises(KarmaError, match="not valid YAML"):
        hardware_from_yaml("name: [unclosed", "hw.yaml")
    with pytest.raises(KarmaError, match="is a mapping"):
        hardware_from_yaml("- a\n- b\n", "hw.yaml")
    text = dump_hardware(make_hardware()).replace("version: 1", "version: 7")
    with pytest.raises(KarmaError, match="version 7 is not supported"):
        hardware_from_yaml(text, "hw.yaml")


def test_hand_written_sizes_and_exponents_are_accepted():
    text = dump_hardware(make_hardware())
    text = text.replace(f"device_mem_bytes: {16 * GiB}", "device_mem_bytes: 16G")
    text = text.replace("bf16: 9.0e+13", "bf16: 9e13")  # a string to PyYAML
    hw = hardware_from_yaml(text)
    assert hw == make_hardware()
    bad = text.replace("bf16: 9e13", "bf16: fast")
    with pytest.raises(KarmaError, match="flops_per_s.bf16 'fast' is not a number"):
        hardware_from_yaml(bad, "hw.yaml")
    bad = text.replace("device_mem_bytes: 16G", "device_mem_bytes: 16Q")
    with pytest.raises(KarmaError, match="device_mem_bytes '16Q' is not a size"):
        hardware_from_yaml(bad, "hw.yaml")


@pytest.mark.parametrize("value", [5e-06, 0.5, 123.0, 1e300, 2.5e14, 1 / 3, 12345678.9])
def test_floats_round_trip_exactly(value):
    hw = make_hardware(net_latency_s=value, mem_bytes_per_s=value)
    assert hardware_from_yaml(dump_hardware(hw)) == hw


def test_odd_names_round_trip():
    for name in ["NVIDIA H200 #2", "true", "123", "a: b"]:
        hw = make_hardware(name=name)
        assert hardware_from_yaml(dump_hardware(hw)).name == name


# ---------------------------------------------------------------------------------------------
# Units


@pytest.mark.parametrize(
    "text, expected",
    [
        ("16G", 16 * GiB),
        ("16GiB", 16 * GiB),
        ("16GB", 16 * GiB),
        ("16g", 16 * GiB),
        ("16Gi", 16 * GiB),
        ("512M", 512 * 1024**2),
        ("1.5T", 3 * 1024**4 // 2),
        ("4K", 4096),
        ("0.1K", 102),
        ("1048576", 1048576),
        ("1024B", 1024),
        (" 2 G ", 2 * GiB),
        ("0", 0),
    ],
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["16Q", "", "G", "-1G", "1.5", "1e9", "16 GB GB", "16GiBs"])
def test_parse_size_errors_say_how_to_fix(text):
    with pytest.raises(KarmaError) as excinfo:
        parse_size(text, what="--gpu-mem")
    assert str(excinfo.value) == (
        f"--gpu-mem {text!r} is not a size; use a number with K, M, G or T, e.g. 16G"
    )


def test_parse_size_without_a_flag_name():
    with pytest.raises(KarmaError, match=r"^'16Q' is not a size; use a number"):
        parse_size("16Q")


@pytest.mark.parametrize(
    "n, expected",
    [
        (0, "0 B"),
        (512, "512 B"),
        (1536, "1.50 KiB"),
        (int(15.9 * GiB), "15.9 GiB"),
        (512 * GiB, "512 GiB"),
        (3 * 1024**4, "3.00 TiB"),
    ],
)
def test_format_bytes(n, expected):
    assert format_bytes(n) == expected


@pytest.mark.parametrize(
    "s, expected",
    [(0.312, "312 ms"), (1.24, "1.24 s"), (45e-6, "45.0 us"), (8e-7, "800 ns"), (0, "0 s")],
)
def test_format_seconds(s, expected):
    assert format_seconds(s) == expected


# ---------------------------------------------------------------------------------------------
# Measuring this machine


@pytest.mark.slow
def test_measure_local_quick_on_cpu_gives_plausible_numbers():
    from karma.calibrate.measure_hw import measure_local

    hw = measure_local("cpu", quick=True)
    assert hw.device_kind == "cpu" and hw.name == "local-cpu"
    # Loose bounds that any machine running the tests meets, and that catch unit mistakes
    # (bytes vs GB, seconds vs ms) by orders of magnitude.
    assert 1e8 < hw.flops_per_s["fp32"] < 1e14
    assert 1e6 < hw.flops_per_s["bf16"] < 1e14
    assert 1e8 < hw.mem_bytes_per_s < 1e13
    assert 1e7 < hw.h2d_bytes_per_s < 1e12 and 1e7 < hw.d2h_bytes_per_s < 1e12
    assert 1e6 < hw.host_optim_bytes_per_s < 1e12
    assert hw.device_mem_bytes > 256 * 1024**2
    assert hw.pinned_mem_bytes == hw.host_mem_bytes
    assert (hw.net_bytes_per_s, hw.net_latency_s) == (1e9, 50e-6)
    slowdowns = (hw.compute_slowdown_copy, hw.copy_slowdown_compute, hw.compute_slowdown_host,
                 hw.host_slowdown_compute)
    assert all(0 <= x <= 0.95 for x in slowdowns)
    assert hardware_from_yaml(dump_hardware(hw)) == hw


def test_measure_local_rejects_a_missing_cuda_device():
    import torch

    from karma.calibrate.measure_hw import measure_local

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(KarmaError, match="no CUDA device"):
        measure_local("cuda", quick=True)
    with pytest.raises(KarmaError, match="'tpu' is not supported"):
        measure_local("tpu", quick=True)


def test_cli_writes_a_loadable_profile(tmp_path, monkeypatch, capsys):
    from karma.cli.profile import main

    monkeypatch.chdir(tmp_path)
    assert main(["--quick", "-o", "me.yaml"]) == 0
    out = capsys.readouterr().out
    assert "TFLOP/s" in out and "GB/s" in out and "wrote me.yaml" in out
    assert "speed lost beside a copy" in out  # the CPU's contention, measured
    hw = load_hardware(str(tmp_path / "me.yaml"))
    assert hw.flops_per_s["fp32"] > 0
    assert f"{format_number(hw.flops_per_s['fp32'] / 1e12)} TFLOP/s" in out
    assert [p.name for p in tmp_path.iterdir()] == ["me.yaml"]  # no temporary file left


def test_cli_error_is_one_line_and_exit_2(tmp_path, capsys):
    from karma.cli.profile import main

    assert main(["-o", str(tmp_path / "no" / "such" / "dir.yaml")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("karma-profile: error: -o ")
    assert "does not exist; create it or choose another path" in err
    assert "Traceback" not in err
    with pytest.raises(KarmaError, match="is a directory"):
        main(["--debug", "-o", str(tmp_path)])  # --debug lets the traceback through
