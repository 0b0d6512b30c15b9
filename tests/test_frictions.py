"""What a new user meets first: a misspelled input key, the budget suggested when nothing
fits, the strategy table's memory, a sweep's plot axis, the library's notes, the batch
search."""

from __future__ import annotations

import dataclasses
import logging
import textwrap

import pytest

import karma.api
from karma import logs
from karma.batch_search import search_batch
from karma.cli.plan import at_least
from karma.cli.plan import main as plan_main
from karma.errors import ModelFileError
from karma.modelfile import ModelInputs, check_signature, load_model_file
from karma.planner.options import PlanOptions
from karma.planner.plan import InfeasiblePlan
from karma.units import format_bytes, parse_size
from tests.conftest import EXAMPLES, MODELS

# --- a misspelled input key -------------------------------------------------------------------

HF_GPT2 = """
import torch
from transformers import GPT2Config, GPT2LMHeadModel

def build_model():
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64,
                                      n_positions=16, bos_token_id=63, eos_token_id=63,
                                      use_cache=False))

def example_batch(batch_size):
    ids = torch.randint(0, 64, (batch_size, 8))
    return {{"{ids}": ids, "{labels}": ids.clone()}}, None
"""


def hf_model_file(tmp_path, ids="input_ids", labels="labels"):
    pytest.importorskip("transformers")
    path = tmp_path / "hf_gpt2_keys.py"
    path.write_text(HF_GPT2.format(ids=ids, labels=labels))
    return load_model_file(path)


@pytest.mark.parametrize("ids,labels,key,meant", [("input_idz", "labels", "input_idz", "input_ids"),
                                                  ("input_ids", "lables", "lables", "labels")])
def test_a_misspelled_hugging_face_key_is_one_line_naming_the_key_and_the_intended_one(
        tmp_path, ids, labels, key, meant):
    from karma.ir.trace import build_meta

    mf = hf_model_file(tmp_path, ids, labels)
    with pytest.raises(ModelFileError) as e:
        build_meta(mf, 2)
    message = str(e.value)
    assert f"key {key!r}" in message and f"misspelling of {meant!r}" in message
    assert "\n" not in message and "GPT2LMHeadModel.forward" in message


def test_keywords_that_hugging_face_takes_through_kwargs_are_accepted(tmp_path):
    from karma.ir.trace import build_meta

    model, inputs, _ = build_meta(hf_model_file(tmp_path), 2)
    # not parameters of GPT2LMHeadModel.forward: its **kwargs take them, and pass them on
    legit = {"output_attentions": False, "output_hidden_states": False}
    failed = ValueError("the forward failed for another reason")
    for failure in (None, failed):
        check_signature(model, ModelInputs(kwargs={**inputs.kwargs, **legit}), "here", failure)
    with pytest.raises(ModelFileError, match="key 'hidden'"):
        check_signature(model, ModelInputs(kwargs={**inputs.kwargs, "hidden": False}), "here",
                        failed)


def test_a_key_the_forward_fails_on_names_the_key_and_the_failure(tmp_path):
    from karma.ir.trace import trace

    mf = hf_model_file(tmp_path, ids="tokens")
    with pytest.raises(ModelFileError) as e:
        trace(mf, 2)
    message = str(e.value)
    assert "key 'tokens'" in message and "forward failed (ValueError" in message
    assert "input_ids" in message and "\n" not in message


def test_a_forward_that_reads_its_kwargs_keeps_its_keys(tmp_path):
    from karma.ir.trace import trace

    path = tmp_path / "kwargs_model.py"
    path.write_text(textwrap.dedent("""
        import torch

        class Net(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = torch.nn.Linear(4, 4)

            def forward(self, x, **extra):
                return self.fc(x) * extra["scale"]

        def build_model():
            return Net()

        def example_batch(batch_size):
            return {"x": torch.randn(batch_size, 4), "scale": torch.ones(1)}, \\
                torch.randint(0, 4, (batch_size,))
    """))
    assert trace(load_model_file(path), 2).tracer == "torch.export"


# --- the budget suggested when nothing fits ---------------------------------------------------

@pytest.mark.parametrize("nbytes,given,suggested", [
    (int(31.3 * 2**20), "20M", "32M"),
    (int(1.44 * 2**20), "1M", "1.5M"),
    (int(23.4 * 2**20), "0.02G", "0.023G"),
    (int(21.4 * 2**30), "16G", "22G"),
    (int(5.55 * 2**30), "4GiB", "5.6G"),
    (int(131.5 * 2**20), "64m", "140M"),
    (12345, "1000", "12345"),
])
def test_the_suggested_budget_is_in_the_unit_given_and_rounded_up_to_two_digits(
        nbytes, given, suggested):
    assert at_least(nbytes, given) == suggested
    assert parse_size(suggested) >= nbytes


def test_no_plan_fits_suggests_the_smallest_budget_that_does(capsys, monkeypatch):
    monkeypatch.setenv("KARMA_GPT", "tiny")
    gpt = EXAMPLES / "gpt.py"
    with pytest.raises(InfeasiblePlan) as e:
        karma.api.plan_report(gpt, PlanOptions(gpu_mem="100K", hardware="v100-16g",
                                               measure="estimate"))
    need = e.value.min_capacity_bytes
    flags = [str(gpt), "--hardware", "v100-16g", "--no-measure"]
    assert plan_main([*flags, "--gpu-mem", "100K"]) == 3
    suggested = capsys.readouterr().err.split("Try --gpu-mem ")[1].split()[0]
    assert suggested.endswith("K")  # the unit given
    assert need <= parse_size(suggested) < 1.1 * need
    assert plan_main([*flags, "--gpu-mem", suggested]) == 0  # and it fits


# --- the strategy table shows what the budget is checked against ------------------------------

def test_the_strategy_table_shows_the_bound_the_budget_is_checked_against():
    options = PlanOptions(gpu_mem="1G", hardware="cpu", batch_size=64, measure="estimate")
    report = karma.api.plan_report(EXAMPLES / "mlp.py", options)
    name, ev = max(report.baselines.items(),
                   key=lambda kv: kv[1].stage_peak_bytes - kv[1].peak_device_bytes)
    assert ev.peak_device_bytes < ev.stage_peak_bytes  # offload_all's, by some MiB
    between = (ev.peak_device_bytes + ev.stage_peak_bytes) // 2
    tight = dataclasses.replace(
        report, chosen=dataclasses.replace(report.chosen, capacity_bytes=between),
        baselines={n: dataclasses.replace(e, capacity_bytes=between)
                   for n, e in report.baselines.items()})
    rows = {line.split()[0]: line.split() for line in tight.strategy_table()[1:]}
    row = rows[name]
    assert row[1] == "no"  # its simulated peak is under the budget, its bound over it
    assert " ".join(row[4:6]) == format_bytes(ev.stage_peak_bytes)
    assert " ".join(row[6:8]) == format_bytes(ev.peak_device_bytes)
    assert report.to_json()["baselines"][name]["stage_peak_bytes"] == ev.stage_peak_bytes
    assert "stage bound" in report.text()


# --- a sweep's plot axis ----------------------------------------------------------------------

def test_a_sweep_is_plotted_in_the_unit_that_suits_its_budgets():
    from karma.plot import sweep_axis

    mib = [{"gpu_mem_bytes": m << 20, "batch_size": 8} for m in (20, 30, 40)]
    assert sweep_axis(mib, "gpu-mem") == ([20, 30, 40], "device memory budget (MiB)")
    gib = [{"gpu_mem_bytes": g << 29, "batch_size": 8} for g in (1, 4, 52)]
    assert sweep_axis(gib, "gpu-mem") == ([0.5, 2, 26], "device memory budget (GiB)")
    assert sweep_axis(mib, "batch-size") == ([8, 8, 8], "batch size per rank")


# --- the library's notes go through logging ---------------------------------------------------

def test_the_library_logs_its_notes_and_prints_nothing(caplog, capsys):
    with caplog.at_level(logging.INFO, logger="karma"):
        karma.api._note_to_stderr("measuring this machine")  # the library's default log
        logs.note("could not cache the measurement in /x (disk full)")
        logs.note("timing a keep_all step failed (OSError: no); timing block by block")
    assert [(r.name, r.levelno) for r in caplog.records] == [
        ("karma", logging.INFO), ("karma", logging.WARNING), ("karma", logging.WARNING)]
    assert capsys.readouterr().err == ""


def test_the_commands_print_the_notes_as_before(capsys):
    pytest.importorskip("transformers")
    level, handlers = logs.LOGGER.level, list(logs.LOGGER.handlers)
    assert plan_main([str(MODELS / "hf_default_config.py"), "--print-ir"]) == 0
    err = capsys.readouterr().err
    assert err.count("karma-plan: note: turned off the Hugging Face model's KV cache") == 1
    assert (logs.LOGGER.level, logs.LOGGER.handlers) == (level, handlers)  # restored


def test_a_note_said_at_every_point_is_said_once():
    said = []
    once = logs.OncePerKind(said.append)
    for batch in (1, 2, 4):
        once(f"timing the blocks of m.py (cpu, batch {batch}; cached in "
             f"/c/blocks-{batch:020x}.json)")
        once("turned off the KV cache")
    once("could not time the blocks")
    once.finish("batches")
    assert said == ["timing the blocks of m.py (cpu, batch 1; cached in "
                    "/c/blocks-00000000000000000001.json)", "turned off the KV cache",
                    "could not time the blocks",
                    "4 more note(s) like those above, for the other batches planned, left out"]


# --- the batch search -------------------------------------------------------------------------

def counted(fits_up_to: int, speed):
    """fits and samples_per_s for search_batch, and the batches planned (1: by its caller)."""
    tried = {1}

    def fits(b):
        tried.add(b)
        return b <= fits_up_to

    def samples_per_s(b):
        assert b in tried and b <= fits_up_to  # only a batch known to fit is compared
        return speed(b)

    return fits, samples_per_s, tried


def test_max_is_the_largest_batch_that_fits():
    fits, speed, tried = counted(1000, float)
    assert search_batch("max", fits, speed, 1 << 16) == 1000
    assert len(tried) <= 21  # doubled, then halved


def test_best_refines_around_the_fastest_doubled_batch_without_seeking_the_largest():
    fits, speed, tried = counted(1000, lambda b: -(b - 300) ** 2)
    assert search_batch("best", fits, speed, 1 << 16) == 300
    assert not [b for b in tried if 512 < b < 1024]  # nothing near the largest that fits


def test_best_reaches_the_largest_batch_when_it_is_the_fastest():
    fits, speed, _ = counted(1000, float)
    assert search_batch("best", fits, speed, 1 << 16) == 1000
    fits, speed, _ = counted(5, float)
    assert search_batch("best", fits, speed, 4) == 4  # the ceiling


def test_a_batch_search_plans_each_batch_once_and_says_a_note_once(monkeypatch):
    planned, said = [], []

    def sweep(model_file, quantity, values, options, log):
        (batch,) = values
        planned.append(batch)
        log(f"timing the blocks (cpu, batch {batch})")
        return [{"batch_size": batch, "feasible": batch <= 40,
                 "samples_per_s": batch if batch <= 24 else 48 - batch}]

    monkeypatch.setattr(karma.api, "sweep", sweep)
    options = PlanOptions(gpu_mem="1G", hardware="cpu")
    batch, points = karma.api.choose_batch("m.py", "best", options, said.append)
    assert batch == 24 and len(planned) == len(set(planned)) == len(points)
    assert said == ["timing the blocks (cpu, batch 1)",
                    f"{len(planned) - 1} more note(s) like those above, for the other batches "
                    "planned, left out"]
