"""The schedule YAML: round trips, stable text, and every validation error on load."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest
import yaml

from karma.errors import KarmaError
from karma.schedule import (
    OP_KINDS,
    Schedule,
    ScheduleFileError,
    dump_schedule,
    round_seconds,
    schedule_sha256,
)
from karma.schedule_load import load_schedule
from tests.schedule_fixtures import rounded, tiny_schedule

TOP_KEYS = ["karma_schedule", "model", "config", "hardware", "strategy", "status", "solve_s",
            "predicted", "blocks", "ops", "buffers"]

# Together these use every op kind (checked below), so the round trips cover them all.
VARIANTS = [
    {},
    {"strategy": "swap_all", "capacity_bytes": 1 << 30, "world_size": 2},
    {"strategy": "offload_all", "capacity_bytes": 1 << 30, "world_size": 2},
    {"strategy": "offload_all", "capacity_bytes": 1 << 30, "world_size": 2,
     "host_state": "sharded"},
]


@pytest.fixture(scope="module")
def sched() -> Schedule:
    """The ILP's schedule of the tiny GPT, times as the file holds them."""
    return rounded(tiny_schedule())


@pytest.fixture(scope="module")
def data(sched) -> dict:
    return yaml.safe_load(dump_schedule(sched))


def _load_data(d: dict, source: str = "schedule.yaml") -> Schedule:
    return load_schedule(yaml.safe_dump(d, sort_keys=False), source)


def _plain(x) -> bool:
    if isinstance(x, dict):
        return all(isinstance(k, str) and _plain(v) for k, v in x.items())
    if isinstance(x, list):
        return all(map(_plain, x))
    return x is None or isinstance(x, (str, int, float, bool))


# --- round trips and text -------------------------------------------------------------------


def test_variants_cover_every_op_kind():
    kinds = {op.kind for kw in VARIANTS for op in tiny_schedule(**kw).ops}
    assert kinds == set(OP_KINDS)


@pytest.mark.parametrize("kw", VARIANTS, ids=lambda kw: kw.get("strategy", "ilp"))
def test_round_trip_is_exact(kw):
    s = rounded(tiny_schedule(**kw))
    assert load_schedule(dump_schedule(s)) == s
    # A schedule straight from the planner: dumping rounds its times once, then it is stable.
    raw = tiny_schedule(**kw)
    assert rounded(rounded(raw)) == rounded(raw)
    assert rounded(raw).ops == raw.ops  # the planner's durations are already rounded


def test_safe_load_gives_plain_data_in_the_fixed_key_order(sched, data):
    assert list(data) == TOP_KEYS
    assert data["karma_schedule"] == 2
    assert _plain(data)
    assert list(data["blocks"][0]) == ["index", "name", "act", "weights", "optim",
                                       "param_bytes", "act_bytes", "modules", "params",
                                       "shared_params"]
    assert list(data["ops"][0]) == ["id", "kind", "block", "stage", "stream", "dur_s", "bytes",
                                    "deps", "uses"]
    assert data["buffers"][0]["alloc"] is None  # null: allocated before the replay
    assert isinstance(data["predicted"]["peak_device_bytes"], int)
    assert data["model"]["env"] == {"KARMA_GPT": "tiny"}
    assert data["hardware"]["flops_per_s"] == {"fp32": 1.2e13, "bf16": 6.0e12}


def test_text_is_stable_and_readable(sched):
    text = dump_schedule(sched)
    assert dump_schedule(sched) == text
    assert dump_schedule(load_schedule(text)) == text
    lines = text.splitlines()
    assert lines[0].startswith("# karma schedule")
    assert any("karma-inspect FILE" in line for line in lines if line.startswith("#"))
    assert next(line for line in lines if not line.startswith("#")) == "karma_schedule: 2"
    for op in sched.ops:  # one line per op and per buffer
        assert sum(line.startswith(f"  - {{id: {op.id}, ") for line in lines) == 1
    for b in sched.buffers:
        assert sum(line.startswith(f"  - {{name: {b.name}, ") for line in lines) == 1
    assert max(len(line) for line in lines if "params:" in line) <= 100  # wrapped lists


def test_times_are_rounded_to_six_significant_digits(sched):
    s = replace(sched, solve_s=1 / 3, ops=(replace(sched.ops[0], dur_s=2 / 3e7),) + sched.ops[1:])
    text = dump_schedule(s)
    assert "solve_s: 0.333333 " in text
    assert "dur_s: 6.66667e-08," in text
    assert load_schedule(text).ops[0].dur_s == round_seconds(2 / 3e7) == 6.66667e-08


@pytest.mark.parametrize("x", [1e-5, 1e7, 123456.0, 0.0, 5e-300, 2.5e-3, 1.0])
def test_floats_read_back_as_floats(sched, x):
    # PyYAML reads "1e-05" as a string: the writer must add the dot
    s = replace(sched, solve_s=x)
    back = load_schedule(dump_schedule(s)).solve_s
    assert isinstance(back, float) and back == x


@pytest.mark.parametrize("name", ["true", "null", "1.5", "0x1F", "a: b", "#x", "x #y", "[a]",
                                  "", "h.0@f", "-lead", "2001-01-01", "ünï", 'q"uote', "~"])
def test_awkward_strings_round_trip(sched, name):
    block = replace(sched.blocks[0], name=name, modules=(name,))
    s = replace(sched, blocks=(block,) + sched.blocks[1:], strategy=name,
                model=replace(sched.model, env=(("KARMA_X", name),)))
    assert load_schedule(dump_schedule(s)) == s


def test_sha256_is_of_the_text_and_sees_decisions(sched):
    assert schedule_sha256(sched) == hashlib.sha256(dump_schedule(sched).encode()).hexdigest()
    other = replace(sched, blocks=(replace(sched.blocks[0], act="keep"),) + sched.blocks[1:])
    assert schedule_sha256(other) != schedule_sha256(sched)


def test_non_finite_times_are_refused_when_writing(sched):
    with pytest.raises(ValueError, match="finite"):
        dump_schedule(replace(sched, solve_s=float("inf")))


# --- reading files ----------------------------------------------------------------------------


def test_load_from_a_path_or_a_str_path(sched, tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text(dump_schedule(sched))
    assert load_schedule(path) == sched
    assert load_schedule(str(path)) == sched
    yml = tmp_path / "s.yml"
    yml.write_text(dump_schedule(sched))
    assert load_schedule(str(yml)) == sched


def test_missing_file(tmp_path):
    with pytest.raises(ScheduleFileError, match=r"schedule file '.*x\.yaml' does not exist"):
        load_schedule(str(tmp_path / "x.yaml"))
    with pytest.raises(ScheduleFileError, match="is not a file"):
        load_schedule(tmp_path)


def test_errors_name_the_file(data, tmp_path):
    data = {**data, "status": "done"}
    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(ScheduleFileError, match=r"^.*plan\.yaml: status: 'done' is not"):
        load_schedule(path)


def test_errors_are_karma_errors_with_exit_code_2(data):
    with pytest.raises(KarmaError) as info:
        _load_data({**data, "karma_schedule": 99})
    assert info.value.exit_code == 2


# --- validation -------------------------------------------------------------------------------


def _edit(d: dict, path: str, value=None, delete: bool = False) -> dict:
    """A deep copy of `d` with the key at `path` ("ops.3.stream") set or deleted."""
    d = yaml.safe_load(yaml.safe_dump(d))
    *head, last = path.split(".")
    target = d
    for key in head:
        target = target[int(key)] if isinstance(target, list) else target[key]
    last = int(last) if isinstance(target, list) else last
    if delete:
        del target[last]
    else:
        target[last] = value
    return d


INVALID = [
    # (key path, new value, what the message must say)
    ("ops.12.stream", "gpu",
     "schedule.yaml: ops[12].stream: 'gpu' is not a stream; use one of compute, h2d, d2h, "
     "net, host"),
    ("ops.0.kind", "jump", "ops[0].kind: 'jump' is not an op kind; use one of forward,"),
    ("blocks.1.act", "swapped", "blocks[1].act: 'swapped' is not an act choice; use one of "
                                "keep, swap, recompute"),
    ("blocks.1.weights", "offloaded", "blocks[1].weights: 'offloaded' is not a weights choice"),
    ("blocks.1.optim", "cpu", "blocks[1].optim: 'cpu' is not an optim choice; use one of "
                              "device, host"),
    ("config.dtype", "fp16", "config.dtype: 'fp16' is not a dtype; use one of fp32, bf16"),
    ("status", "done", "status: 'done' is not a solver status"),
    ("ops.3.bytes", "12", "ops[3].bytes: '12' is not a whole number"),
    ("ops.3.bytes", 1.5, "ops[3].bytes: 1.5 is not a whole number"),
    ("blocks.0.param_bytes", True, "blocks[0].param_bytes: true is not a whole number"),
    ("ops.3.bytes", -1, "ops[3].bytes: -1 is below 0"),
    ("config.batch_size", 0, "config.batch_size: 0 is below 1"),
    ("ops.3.dur_s", "fast", "ops[3].dur_s: 'fast' is not a number of seconds"),
    ("ops.3.dur_s", -0.5, "ops[3].dur_s: -0.5 is not a number of seconds"),
    ("ops.3.dur_s", True, "ops[3].dur_s: true is not a number of seconds"),
    ("ops.3.deps", 2, "ops[3].deps: expected a list, got 2"),
    ("ops.3.deps", [0, "x"], "ops[3].deps[1]: 'x' is not a whole number"),
    ("ops.3.uses", [1], "ops[3].uses[0]: 1 is not a string"),
    ("blocks.2.modules", "h.1", "blocks[2].modules: expected a list, got 'h.1'"),
    ("model.env", ["KARMA_GPT"], "model.env: expected a mapping, got a list"),
    ("model.env", {"KARMA_GPT": 3}, "model.env.KARMA_GPT: 3 is not a string"),
    ("predicted.busy_s", {"gpu": 1.0}, "predicted.busy_s key: 'gpu' is not a stream"),
    ("ops.4.id", 7, "ops[4].id: 7 is not its position in the list (4)"),
    ("blocks.2.index", 0, "blocks[2].index: 0 is not its position in the list (2)"),
    ("ops.2.deps", [5], "ops[2].deps: 5 is not an earlier op; an op waits only for ops listed "
                        "before it (ids 0..1): list the op it waits for before it, or re-plan "
                        "with karma-plan"),
    ("ops.0.deps", [0], "ops[0].deps: 0 is not an earlier op"),
    ("ops.3.block", 99, "ops[3].block: 99 is not a block; blocks are numbered 0..3"),
    ("buffers.7.block", 4, "buffers[7].block: 4 is not a block"),
    ("buffers.7.alloc", 999, "buffers[7].alloc: 999 is not an op; use an op id 0..22, or null"),
    ("buffers.7.free", 23, "buffers[7].free: 23 is not an op"),
    ("buffers.7.name", "w.0", "buffers[7].name: 'w.0' is also buffers["),
    ("blocks", [], "blocks: the list is empty"),
    ("ops", {"id": 0}, "ops: expected a list, got a mapping"),
    ("ops.1", [1, 2], "ops[1]: an op is a mapping, got a list"),
    ("model", "gpt.py", "model: model is a mapping, got 'gpt.py'"),
]


@pytest.mark.parametrize("path, value, message", INVALID, ids=[c[0] for c in INVALID])
def test_invalid_values_name_the_key_and_the_fix(data, path, value, message):
    with pytest.raises(ScheduleFileError) as info:
        _load_data(_edit(data, path, value))
    assert message in str(info.value)
    assert str(info.value).startswith("schedule.yaml: ")


@pytest.mark.parametrize("path, message", [
    ("predicted.step_s", "schedule.yaml: missing key predicted.step_s"),
    ("ops.12.stream", "schedule.yaml: missing key ops[12].stream"),
    ("buffers.0.free", "missing key buffers[0].free"),
    ("hardware", "missing key hardware"),
])
def test_missing_keys(data, path, message):
    with pytest.raises(ScheduleFileError, match="re-plan with karma-plan") as info:
        _load_data(_edit(data, path, delete=True))
    assert message in str(info.value)


def test_unknown_keys_are_named(data):
    with pytest.raises(ScheduleFileError) as info:
        _load_data({**data, "comment": "x", "owner": "me"})
    assert "the schedule: unknown keys 'comment', 'owner'; a schedule has the keys " \
           "karma_schedule, model," in str(info.value)
    with pytest.raises(ScheduleFileError, match=r"ops\[3\]: unknown key 'color'; an op has "
                                                r"the keys id, kind, block"):
        _load_data(_edit(data, "ops.3.color", "red"))


def test_uses_may_name_absent_buffers(data):
    # the planner omits zero-byte buffers, so an op may use a buffer that is not listed
    s = _load_data(_edit(data, "ops.3.uses", ["act.99", "nothing"]))
    assert s.ops[3].uses == ("act.99", "nothing")


def test_null_alloc_and_free_are_allowed(data):
    # a buffer live through every replay (the runtime releases only fetched weights)
    k = next(k for k, b in enumerate(data["buffers"]) if b["name"] == "grad.3")
    d = _edit(_edit(data, f"buffers.{k}.alloc", None), f"buffers.{k}.free", None)
    s = _load_data(d)
    assert (s.buffers[k].alloc, s.buffers[k].free) == (None, None)


def test_ints_are_accepted_for_seconds(data):
    assert _load_data(_edit(data, "solve_s", 2)).solve_s == 2.0


def test_hardware_values_must_be_plain(data):
    d = _edit(data, "hardware.name", None)
    assert dict(_load_data(d).hardware)["name"] is None  # plain, if odd
    text = dump_schedule(_load_data(data)).replace("  name: v100-16g", "  name: !!set {a}")
    with pytest.raises(ScheduleFileError, match=r"hardware\.name: \{'a'\} is not a plain value"):
        load_schedule(text)


def test_version_mismatch(data):
    with pytest.raises(ScheduleFileError) as info:
        _load_data({**data, "karma_schedule": 3})
    assert str(info.value) == (
        "schedule.yaml: karma_schedule: 3 is not supported by this karma (reads versions 1, 2); "
        "re-plan it with this karma's karma-plan, with the flags it was planned with")
    with pytest.raises(ScheduleFileError, match="karma_schedule: '1' is not supported"):
        _load_data({**data, "karma_schedule": "1"})
    with pytest.raises(ScheduleFileError, match="karma_schedule: true is not supported"):
        _load_data({**data, "karma_schedule": True})
    d = dict(data)
    del d["karma_schedule"]
    with pytest.raises(ScheduleFileError, match="missing key karma_schedule .*is this a karma "
                                                "schedule"):
        _load_data(d)


def test_a_version_1_schedule_loads_as_this_version(sched):
    """Version 1 named the predicted step time iteration_s: such a file loads as the same
    schedule, written back in this version's words."""
    text = dump_schedule(sched)
    old = text.replace("karma_schedule: 2\n", "karma_schedule: 1\n").replace(
        "\n  step_s: ", "\n  iteration_s: ")
    assert old != text and "iteration_s" in old
    assert load_schedule(old) == load_schedule(text)
    assert dump_schedule(load_schedule(old)) == text


@pytest.mark.parametrize("text, shown", [
    ("- a\n- b\n", "got a list"),
    ("just words\n", "got 'just words'"),
    ("", "got null"),
    ("42\n", "got 42"),
])
def test_not_a_mapping(text, shown):
    with pytest.raises(ScheduleFileError) as info:
        load_schedule(text, "s.yaml")
    assert str(info.value).startswith("s.yaml: a schedule is a YAML mapping that starts with "
                                      "'karma_schedule: 2', " + shown)


def test_malformed_yaml_gives_the_line(sched):
    lines = dump_schedule(sched).splitlines()
    k = next(i for i, line in enumerate(lines) if line.startswith("  - {id: 5,"))
    lines[k] = lines[k].rstrip("}")  # an unclosed flow mapping
    with pytest.raises(ScheduleFileError) as info:
        load_schedule("\n".join(lines), "s.yaml")
    message = str(info.value)
    assert message.startswith("s.yaml is not valid YAML: ")
    assert f"(line {k + 1})" in message or f"(line {k + 2})" in message  # where it shows
    assert "\n" not in message
    with pytest.raises(ScheduleFileError, match=r"is not valid YAML: .* \(line 2\); re-plan"):
        load_schedule("karma_schedule: 1\nmodel: {a: 1}}\nops: []\n", "s.yaml")


def test_duplicate_keys_are_refused(sched):
    text = dump_schedule(sched).replace("strategy: ilp\n", "strategy: ilp\nstrategy: greedy\n")
    with pytest.raises(ScheduleFileError, match=r"is not valid YAML: key 'strategy' is given "
                                                r"twice \(line \d+\)"):
        load_schedule(text)



def test_karmas_own_settings_are_not_recorded_as_the_models(monkeypatch):
    """A schedule planned under KARMA_TIER_DIR (or KARMA_CHAOS, KARMA_CPU_CACHE) must not make
    every karma-run of it use that setting: the model's environment leaves them out."""
    from karma.schedule import KARMA_SETTINGS, ModelRef

    monkeypatch.setenv("KARMA_GPT", "small")
    for name in KARMA_SETTINGS:
        monkeypatch.setenv(name, "x")
    env = dict(ModelRef.now("m.py", "0" * 64, "{}").env)
    assert env.get("KARMA_GPT") == "small"
    assert not set(KARMA_SETTINGS) & set(env)


def test_the_models_fingerprint_and_command_are_optional_keys(sched):
    assert list(yaml.safe_load(dump_schedule(sched))["model"]) == [
        "path", "sha256", "ir_sha256", "env"]  # a schedule that records neither loads
    s = replace(sched, model=replace(sched.model, graph_sha256="ab" * 32,
                                     plan_command="karma-plan 'my model.py' --hardware cpu"))
    assert list(yaml.safe_load(dump_schedule(s))["model"]) == [
        "path", "sha256", "ir_sha256", "graph_sha256", "env", "plan_command"]
    assert load_schedule(dump_schedule(s)) == s
