"""Semantic validation (karma/schedule_check.py): every schedule the planner writes passes,
and each rule refuses an edit that breaks it alone, naming the op or block and the rule."""

from __future__ import annotations

import itertools
import time
from dataclasses import replace

import pytest

from karma.schedule import Op, Schedule, ScheduleFileError, dump_schedule
from karma.schedule_check import check_model_names, validate
from karma.schedule_load import load_schedule
from karma.schedule_replay import walk_peak_bytes
from tests.conftest import ROOT
from tests.schedule_fixtures import MIXED, rounded, tiny_graph, tiny_schedule

GOLDEN = sorted((ROOT / "schedules").glob("*.yaml"))


@pytest.fixture(scope="module")
def sched() -> Schedule:
    """The tiny GPT's ILP schedule (the MIXED choices: block 0 swaps, block 1 recomputes and
    streams, block 2 keeps on the device, block 3 keeps and streams)."""
    return rounded(tiny_schedule())


def op_of(s: Schedule, kind: str, block: int, k: int = 0) -> Op:
    return [op for op in s.ops if (op.kind, op.block) == (kind, block)][k]


def with_op(s: Schedule, op: Op, **fields) -> Schedule:
    ops = list(s.ops)
    ops[op.id] = replace(op, **fields)
    return replace(s, ops=tuple(ops))


def with_block(s: Schedule, i: int, **fields) -> Schedule:
    blocks = list(s.blocks)
    blocks[i] = replace(blocks[i], **fields)
    return replace(s, blocks=tuple(blocks))


def with_buffer(s: Schedule, name: str, **fields) -> Schedule:
    return replace(s, buffers=tuple(replace(b, **fields) if b.name == name else b
                                    for b in s.buffers))


def without_op(s: Schedule, gone: Op) -> Schedule:
    """`s` without op `gone` and the buffers it allocates; ids renumbered."""
    def new(k: int | None) -> int | None:
        return None if k is None else k - (k > gone.id)

    assert all(b.free != gone.id for b in s.buffers if b.alloc != gone.id)
    ops = tuple(replace(op, id=new(op.id), deps=tuple(new(d) for d in op.deps if d != gone.id))
                for op in s.ops if op.id != gone.id)
    buffers = tuple(replace(b, alloc=new(b.alloc), free=new(b.free))
                    for b in s.buffers if b.alloc != gone.id)
    return replace(s, ops=ops, buffers=buffers)


def refused(s: Schedule, *fragments: str) -> str:
    """The refusal of `s`, checked to be one line holding every fragment."""
    with pytest.raises(ScheduleFileError) as info:
        validate(s, "s.yaml")
    message = str(info.value)
    assert message.startswith("s.yaml: ") and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message
    assert "(rule: " in message and "karma-plan" in message  # the rule, then the fix
    return message


# --- what passes ------------------------------------------------------------------------------


@pytest.mark.parametrize("path", GOLDEN, ids=lambda p: p.name)
def test_golden_schedules_pass(path):
    s = load_schedule(path)  # validates
    peak, _ = walk_peak_bytes(s)
    # [Note: the peak walked over stages]: the planner's own bound, within the budget
    assert s.predicted.peak_device_bytes <= peak <= s.predicted.stage_peak_bytes
    assert peak <= s.config.capacity_bytes


def test_validating_the_largest_golden_takes_well_under_a_second():
    s = load_schedule(max(GOLDEN, key=lambda p: len(load_schedule(p).ops)))
    assert len(s.ops) > 300
    start = time.perf_counter()
    validate(s)
    assert time.perf_counter() - start < 0.5  # about 5 ms on a 2-core machine


# the planner's schedules of the tiny GPT with every training option, on a GPU profile and on
# the CPU backend's (host step temporaries on the device): (hardware, strategy, world_size,
# accumulate, clip_grad_norm)
PLANNED = [
    *itertools.product(["v100-16g", "cpu"], ["ilp", "greedy", "swap_all", "offload_all"],
                       [1], [1], [None]),
    *itertools.product(["v100-16g", "cpu"], ["ilp", "swap_all", "offload_all"],
                       [1, 2], [3], [None, 1.0]),
    *itertools.product(["v100-16g"], ["ilp", "offload_all"], [2], [1], [None]),
]


@pytest.mark.parametrize("hardware, strategy, world_size, accumulate, clip", PLANNED,
                         ids=["-".join(map(str, case)) for case in PLANNED])
def test_planned_schedules_pass(hardware, strategy, world_size, accumulate, clip):
    from karma.planner.hardware import load_hardware
    from karma.planner.options import PlanOptions
    from karma.planner.pipeline import make_schedule
    from tests.schedule_fixtures import tiny_graph

    _, graph = tiny_graph()
    capacity = 400 * 1024 if strategy == "ilp" else 1 << 30  # the ILP mixes its choices
    options = PlanOptions(gpu_mem=capacity, hardware=load_hardware(hardware),
                          batch_size=graph.batch_size, world_size=world_size,
                          strategy=strategy, accumulate=accumulate, clip_grad_norm=clip,
                          time_limit_s=10)
    s = make_schedule(graph, tiny_schedule().model, options).schedule  # every case fits
    validate(s)
    assert load_schedule(dump_schedule(s)).blocks == s.blocks


@pytest.mark.parametrize("kw", [{}, {"strategy": "swap_all", "capacity_bytes": 1 << 30,
                                     "world_size": 2},
                                {"strategy": "offload_all", "capacity_bytes": 1 << 30,
                                 "world_size": 2}], ids=["ilp", "swap_all", "offload_all"])
def test_fixture_schedules_pass(kw):
    validate(tiny_schedule(**kw))


def test_the_fixture_has_every_choice(sched):
    assert [(b.act, b.weights, b.optim) for b in sched.blocks] == [
        (c.act, c.weights, c.optim) for c in MIXED]


# --- one rule broken at a time ----------------------------------------------------------------


def test_the_original_failure_a_keep_block_whose_ops_swap_it(sched):
    # a failure once met: block 3's act said keep while its ops still swapped it (KeyError: 3
    # at run time)
    refused(with_block(sched, 0, act="keep"),
            f"op {op_of(sched, 'swap_out', 0).id} (swap_out of block 0 (head)) is one swap_out "
            "too many for block 0 (head)",
            "(rule: ops match decisions: blocks[0].act is keep, and a block is swapped out and "
            "in once if its act is swap or it is selective with kept: host, never otherwise)")


def test_a_swap_block_without_its_swap_ops(sched):
    s = with_block(sched, 2, act="swap")
    refused(s, "block 2 (h.1) has no swap_out op (rule: ops match decisions: blocks[2].act is "
               "swap")


def test_a_recompute_decision_without_its_recompute(sched):
    refused(with_block(sched, 2, act="recompute"),
            "block 2 (h.1) has no recompute op (rule: ops match decisions")


def test_a_streamed_block_without_a_fetch(sched):
    fetch = next(op for op in sched.ops if op.kind == "fetch" and op.uses == ("w.1@b",))
    refused(without_op(sched, fetch),
            "block 1 (h.0) has no fetch of w.1@b (rule: ops match decisions: blocks[1].weights "
            "is streamed, so its weights are fetched before each forward and backward")


def test_a_fetch_of_resident_weights(sched):
    fetch = op_of(sched, "fetch", 3)  # the tail's own weights; it also reads the head's
    refused(with_op(sched, fetch, uses=("w.0@f3",)),
            f"op {fetch.id} (fetch of block 3 (tail)) fetches the weights of block 0 (head), "
            "but blocks[0].weights is resident (rule: ops match decisions: only streamed "
            "weights are fetched)")


def test_a_resident_host_block_without_its_upload(sched):
    refused(with_block(sched, 3, weights="resident"),
            "block 3 (tail) has no upload op (rule: ops match decisions: blocks[3] has weights: "
            "resident and optim: host")


def test_a_host_block_without_its_host_step(sched):
    refused(without_op(sched, op_of(sched, "host_step", 3)),
            "block 3 (tail) has no host_step op (rule: ops match decisions: blocks[3].optim is "
            "host")


def test_a_device_step_of_a_host_block(sched):
    refused(with_block(sched, 2, optim="host"),
            "(device_step of block 2 (h.1)) is one device_step too many for block 2",
            "blocks[2].optim is host")


def test_all_reduces_follow_the_number_of_ranks(sched):
    refused(replace(sched, config=replace(sched.config, world_size=2)),
            "block 0 (head) has no allreduce op (rule: ops match decisions: "
            "config.world_size is 2")


def test_streamed_weights_are_stepped_on_the_host(sched):
    refused(with_block(sched, 1, optim="device"),
            "block 1 (h.0) has weights: streamed and optim: device (rule: decisions: streamed "
            "weights are stepped on the host")


def test_parameters_are_named_once(sched):
    refused(with_block(sched, 3, params=sched.blocks[3].params + ("h.1.ln_1.weight",)),
            "blocks[3].params: 'h.1.ln_1.weight' is also a parameter of block 2 (h.1) (rule: "
            "parameters named once")
    refused(with_block(sched, 3, shared_params=("wte.weight", "wte.weight")),
            "blocks[3].shared_params: 'wte.weight' is listed twice")
    refused(with_block(sched, 3, shared_params=("lm_head.extra",)),
            "blocks[3].shared_params: 'lm_head.extra' is owned by no block")


def test_each_kind_on_its_stream(sched):
    op = op_of(sched, "fetch", 3)
    refused(with_op(sched, op, stream="d2h"),
            f"op {op.id} (fetch of block 3 (tail)) is on stream d2h (rule: streams: a fetch runs "
            "on h2d)")


def test_stages_never_decrease(sched):
    op = op_of(sched, "fetch", 3)
    refused(with_op(sched, op, stage=op.stage - 1),
            f"op {op.id} (fetch of block 3 (tail)) is in stage {op.stage - 1}, after op "
            f"{op.id - 1} in stage {op.stage} (rule: stages ordered")


def test_compute_ops_follow_the_model(sched):
    a, b = op_of(sched, "forward", 1), op_of(sched, "forward", 2)
    s = with_op(with_op(sched, a, block=2), b, block=1)  # the two forwards swapped
    refused(s, f"op {a.id} (forward of block 2 (h.1)) runs where the model runs the forward of "
               "block 1 (h.0) (rule: compute order")


def test_an_upload_waits_for_its_host_step(sched):
    up, step = op_of(sched, "upload", 0), op_of(sched, "host_step", 0)
    refused(with_op(sched, up, deps=tuple(d for d in up.deps if d != step.id)),
            f"op {up.id} (upload of block 0 (head)) may start before op {step.id} (host_step "
            "of block 0 (head)) ends", "(rule: dependencies: weights are uploaded after the "
                                        f"host step); add {step.id} to ops[{up.id}].deps")


def test_dependencies_hold_in_micro_batches_that_do_not_step(sched):
    """[Note: happens-before]: an op waiting only through a host step waits for nothing in a
    micro-batch that skips the step."""
    to_host, step = op_of(sched, "grads_to_host", 0), op_of(sched, "host_step", 1)
    backward = op_of(sched, "backward", 0)
    assert backward.id < step.id < to_host.id
    s = with_op(sched, step, deps=(*step.deps, backward.id))
    s = with_op(s, op_of(s, "grads_to_host", 0), deps=(step.id,))
    validate(s)  # one micro-batch per step: the host step orders it after block 0's backward
    accumulating = replace(s, config=replace(s.config, accumulate=2))
    refused(accumulating, f"op {to_host.id} (grads_to_host of block 0 (head)) may start before "
                          f"op {op_of(sched, 'backward', 0).id} (backward of block 0 (head)) "
                          "ends", "(rule: dependencies: a block's gradients go to the host "
                                  "after its backward)")


def test_clipping_steps_after_every_gradient(sched):
    refused(replace(sched, config=replace(sched.config, clip_grad_norm=1.0)),
            "(device_step of block 2 (h.1)) comes before op",
            "(rule: dependencies: with config.clip_grad_norm every optimizer step follows every "
            "gradient)")


def test_a_buffer_is_used_only_while_allocated(sched):
    fwd = op_of(sched, "forward", 1)
    fetch = op_of(sched, "fetch", 1)
    refused(with_buffer(sched, "w.1@f", free=fetch.id),
            f"op {fwd.id} (forward of block 1 (h.0)) uses buffer w.1@f, which op {fetch.id} "
            f"(fetch of block 1 (h.0)) frees, and may run after it (rule: buffer lifetime")
    later = op_of(sched, "backward", 0)
    refused(with_buffer(sched, "act.3", alloc=later.id),
            "buffer act.3 (buffers[", f"is freed by op {op_of(sched, 'backward', 3).id} "
            f"(backward of block 3 (tail)), which may end before op {later.id}")
    refused(with_buffer(sched, "act.0", free=None),
            "buffer act.0 (buffers[", "is allocated by op 0 (forward of block 0 (head)) and "
                                       "never freed")


def test_fetched_weights_are_released_after_their_last_reader(sched):
    """Whatever `uses` says: the runtime releases fetched weights at the buffer's free op."""
    fwd, bwd = op_of(sched, "forward", 3), op_of(sched, "backward", 3)
    s = with_buffer(sched, "w.3@f", free=fwd.id)
    s = with_op(s, s.ops[bwd.id], uses=tuple(u for u in bwd.uses if u != "w.3@f"))
    refused(s, f"buffer w.3@f is freed by op {fwd.id} (forward of block 3 (tail)), but op "
               f"{bwd.id} (backward of block 3 (tail)) reads it and may run after",
            "(rule: buffer lifetime: fetched weights are released after the last op that "
            f"reads them); set its free to {bwd.id}")


def test_with_clipping_fetched_weights_are_not_freed_by_a_deferred_op():
    """Found by fuzzing (tests/test_fuzz.py): with clipping, block 0's backward weights
    freed by its host step, which runs on into the next step, were still held when
    that step fetched them and were not filled again: two runs in three trained other
    weights than plain PyTorch."""
    from karma.planner.hardware import load_hardware
    from karma.planner.options import PlanOptions
    from karma.planner.pipeline import make_schedule
    from tests.schedule_fixtures import tiny_graph

    _, graph = tiny_graph()
    options = PlanOptions(gpu_mem=1 << 30, hardware=load_hardware("cpu"),
                          batch_size=graph.batch_size, strategy="offload_all",
                          clip_grad_norm=1.0)
    s = rounded(make_schedule(graph, tiny_schedule().model, options).schedule)
    validate(s)
    reader = next(b.free for b in s.buffers if b.name == "w.0@b")
    step = op_of(s, "host_step", 0)
    late = with_buffer(s, "w.0@b", free=step.id)
    refused(late, "buffer w.0@b (buffers[", f"is freed by op {step.id} (host_step of block 0 "
                  "(head)), which may run on into the next step (rule: buffer lifetime: "
                  "with config.clip_grad_norm fetched weights are freed by the op that reads "
                  f"them last, never by a host_step or an upload", f"set its free to {reader}")
    # without clipping every op of a replay ends within it: later, but allowed
    validate(replace(late, config=replace(late.config, clip_grad_norm=None)))


def test_the_peak_fits_the_capacity(sched):
    peak, stage = walk_peak_bytes(sched)
    assert peak <= sched.config.capacity_bytes
    validate(replace(sched, config=replace(sched.config, capacity_bytes=peak)))
    refused(replace(sched, config=replace(sched.config, capacity_bytes=peak - 1)),
            f"the buffers live in stage {stage} add up to {peak} bytes",
            f"over config.capacity_bytes {peak - 1}", "(rule: peak within capacity")


@pytest.mark.parametrize("value", [".nan", ".inf", "-.inf"])
def test_a_hardware_number_that_is_not_finite_is_refused(sched, value):
    """Found by fuzzing (tests/test_fuzz.py): a hardware rate edited to .nan loaded, and
    karma-run ended in "internal error: ValueError: nan cannot be written in a schedule"
    when it took the schedule's fingerprint (schedule_sha256 writes the schedule)."""
    text = dump_schedule(sched)
    line = next(line for line in text.splitlines() if line.startswith("  h2d_bytes_per_s: "))
    edited = text.replace(line, f"  h2d_bytes_per_s: {value}")
    with pytest.raises(ScheduleFileError, match=r"^edited\.yaml: hardware\.h2d_bytes_per_s: "
                                                r"-?(nan|inf) is not a finite number; "):
        load_schedule(edited, "edited.yaml")


def test_a_huge_stage_number_is_walked_in_no_time(sched):
    """Found by fuzzing (tests/test_fuzz.py): the last op's stage edited to 2**62 (stages
    still in order) made the peak walk allocate a list as long as that number, and
    karma-run ended in "internal error: MemoryError"."""
    last = sched.ops[-1]
    s = with_op(sched, last, stage=2 ** 62)
    start = time.perf_counter()
    assert walk_peak_bytes(s)[0] == walk_peak_bytes(sched)[0]
    validate(s)  # the same buffers over the same stages but the last: the same peak
    assert time.perf_counter() - start < 0.5


def test_refusals_on_load_name_the_file(sched):
    text = dump_schedule(sched).replace("name: head, act: swap", "name: head, act: keep")
    with pytest.raises(ScheduleFileError, match=r"^edited\.yaml: op \d+ \(swap_out of block 0 "):
        load_schedule(text, "edited.yaml")


# --- once the model is built ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    """The tiny GPT the fixture schedule was planned for (its lm_head tied to wte)."""
    return tiny_graph()[0].build()


def model_refused(s: Schedule, model, *fragments: str) -> None:
    with pytest.raises(ScheduleFileError) as info:
        check_model_names(s, dict(model.named_parameters(remove_duplicate=False)),
                          {name for name, _ in model.named_modules()}, "s.yaml")
    message = str(info.value)
    assert message.startswith("s.yaml: ") and "\n" not in message
    for fragment in (*fragments, "(rule: ", "karma-plan"):
        assert fragment in message, message


def test_the_fixture_names_the_model_exactly(sched, tiny_model):
    check_model_names(sched, dict(tiny_model.named_parameters(remove_duplicate=False)),
                      {name for name, _ in tiny_model.named_modules()})


def test_every_parameter_of_the_model_is_owned_by_a_block(sched, tiny_model):
    """Found by fuzzing (tests/test_fuzz.py): a line of a block's params list deleted left
    those parameters to no block; the run trained without them, then failed writing its
    checkpoint with "internal error: KeyError: 'layer4.1.bn2.weight'"."""
    params = sched.blocks[2].params
    model_refused(with_block(sched, 2, params=params[:1] + params[2:]), tiny_model,
                  f"the model's parameter {params[1]!r} is owned by no block",
                  "(rule: parameters named once")


def test_a_tied_parameter_is_owned_once(sched, tiny_model):
    """lm_head.weight is wte.weight: owned by the head already (the tail lists it in its
    shared_params), it must not be owned again under its other name."""
    assert "wte.weight" in sched.blocks[0].params and "lm_head.weight" not in {
        n for b in sched.blocks for n in b.params}
    model_refused(with_block(sched, 3, params=sched.blocks[3].params + ("lm_head.weight",)),
                  tiny_model, "blocks[3].params: 'lm_head.weight' is the parameter "
                              "'wte.weight' of block 0 under another name (tied)",
                  "(rule: parameters named once")


def test_a_name_the_model_lacks(sched, tiny_model):
    model_refused(with_block(sched, 1, modules=("h.9",)), tiny_model,
                  "blocks[1].modules: 'h.9' is not in the model (rule: parameters named once")


def test_the_model_built_is_the_one_planned(sched, tiny_model):
    """Found while fuzzing (a mutant aimed by hand): model.env edited (KARMA_MLP_WIDTH 64
    to 65) made the model file build a wider model than planned, with the same names, and
    karma-run trained it under the schedule's figures; the bytes of each block's parameters
    tell."""
    b = sched.blocks[2]
    model_refused(with_block(sched, 2, param_bytes=b.param_bytes + 4), tiny_model,
                  f"blocks[2].param_bytes: {b.param_bytes + 4} (",
                  f"but its parameters in the model take {b.param_bytes} (",
                  "(rule: the model as planned: each block's param_bytes are the bytes of its "
                  "parameters in the model built)")
