"""A model object is as good as a model file: karma.model, karma.plan and karma.Runtime on
an nn.Module or the functions that build one, Runtime.save/load in karma-run's format."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import karma
from karma.errors import KarmaError
from karma.model_object import meta_copy
from karma.runtime.checkpoints.export import model_state_dict
from karma.testing.exactness import assert_bitwise_equal
from tests.conftest import ROOT
from tests.models import object_net as net

pytestmark = pytest.mark.usefixtures("restore_environment_and_signals")  # tests/conftest.py
BATCH = 4
BUDGET = "1200K"  # below what keeping everything needs: some blocks move or recompute


def model() -> karma.modelfile.ModelFile:
    return karma.model(net.make_net, net.make_batch, make_optimizer=net.sgd)


def planned(m, tmp_path):
    schedule = karma.plan(m, gpu_mem=BUDGET, hardware="cpu", batch_size=BATCH,
                          measure="estimate", log=lambda note: None)
    path = tmp_path / "object.yaml"
    schedule.save(path)
    return schedule, path


def hand_loop(rt, steps: int, first: int = 0) -> list[float]:
    """A user's own loop: the model's default batches (batch_seed), one step each."""
    data = rt.model_file.batches(BATCH)
    for _ in range(first):
        next(data)
    return [rt.step(*next(data)) for _ in range(steps)]


def cli(name: str, *argv) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"karma.cli.{name}", *map(str, argv)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_a_model_object_plans_trains_saves_exports_and_resumes_under_karma_run(tmp_path):
    m = model()
    schedule, path = planned(m, tmp_path)
    assert schedule.model.entry == (("build_model", "make_net"), ("example_batch", "make_batch"),
                                    ("make_optimizer", "sgd"))
    assert any(b.act != "keep" or b.weights != "resident" or b.optim != "device"
               for b in schedule.blocks), "the budget should need out-of-core execution"

    with karma.Runtime(schedule, model=m, log=lambda line: None) as rt:
        hand_loop(rt, 2)
        saved = rt.save(tmp_path / "ckpt")
        assert saved.name == "step_2"
        after_two = rt.state_dict()["model"]

    exported = tmp_path / "model.pt"
    done = cli("export", tmp_path / "ckpt", "-o", exported)
    assert done.returncode == 0, done.stderr
    assert_bitwise_equal(torch.load(exported, weights_only=True), after_two)

    resumed = cli("run", path, "--steps", 4, "--checkpoint-dir", tmp_path / "ckpt", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "step 3/4" in resumed.stdout + resumed.stderr

    # the same four steps in one hand-written loop: the resumed run continued it exactly
    with karma.Runtime(schedule, model=model(), log=lambda line: None) as rt:
        hand_loop(rt, 4)
        straight = rt.state_dict()["model"]
    assert_bitwise_equal(model_state_dict(tmp_path / "ckpt" / "step_4"), straight)


def test_runtime_load_continues_where_save_stopped(tmp_path):
    m = model()
    schedule, _ = planned(m, tmp_path)
    with karma.Runtime(schedule, model=m, log=lambda line: None) as rt:
        hand_loop(rt, 1)
        rt.save(tmp_path / "ckpt")
        hand_loop(rt, 1, first=1)
        two = rt.state_dict()["model"]
    with karma.Runtime(schedule, model=m, log=lambda line: None) as rt:
        assert rt.load(tmp_path / "ckpt") == 1
        hand_loop(rt, 1, first=1)
        assert rt.save(tmp_path / "ckpt").name == "step_2"
        assert_bitwise_equal(rt.state_dict()["model"], two)


def test_a_module_instance_plans_and_trains_from_its_own_values(tmp_path):
    instance = net.make_net()
    with torch.no_grad():
        instance.head.bias.fill_(0.25)  # a value build_model would not give
    m = karma.model(instance, net.make_batch, make_optimizer=net.sgd)
    schedule = karma.plan(instance, example_batch=net.make_batch, make_optimizer=net.sgd,
                          gpu_mem=BUDGET, hardware="cpu", batch_size=BATCH,
                          measure="estimate", log=lambda note: None)
    assert dict(schedule.model.entry)["build_model"] == ""
    with karma.Runtime(schedule, model=m, log=lambda line: None) as rt:
        first = rt.state_dict()["model"]["head.bias"]
        assert torch.equal(first, torch.full_like(first, 0.25))
        hand_loop(rt, 1)
    path = tmp_path / "instance.yaml"
    schedule.save(path)
    refused = cli("run", path, "--steps", 1)
    assert refused.returncode != 0 and "Traceback" not in refused.stderr
    assert "cannot be imported again" in refused.stderr
    assert "karma.Runtime(schedule, model=karma.model(...))" in refused.stderr


def test_the_meta_copy_of_an_instance_allocates_nothing_and_keeps_ties():
    instance = net.make_net()
    instance.head.weight = instance.embed.weight
    copy = meta_copy(instance)
    assert all(p.is_meta for p in copy.parameters())
    assert copy.head.weight is copy.embed.weight
    assert not instance.head.weight.is_meta
    assert [(n, p.shape) for n, p in copy.named_parameters()] == \
        [(n, p.shape) for n, p in instance.named_parameters()]


@pytest.mark.parametrize(("call", "expected"), [
    (lambda: karma.model(net.make_net), "needs example_batch"),
    (lambda: karma.model(42, net.make_batch), "give an nn.Module"),
    (lambda: karma.model("examples/gpt.py", net.make_batch), "goes to karma.plan"),
    (lambda: karma.model(net.make_net, net.make_batch, batch_size=0), "positive integer"),
    (lambda: karma.plan(net.make_net(), gpu_mem="1G"), "needs example_batch"),
    (lambda: karma.plan("examples/gpt.py", loss_fn=print), "has its own"),
    (lambda: karma.Runtime("nowhere.yaml", model=net.make_net()), "karma.model(...)"),
])
def test_wrong_arguments_name_the_fix(call, expected):
    with pytest.raises(KarmaError, match=expected.replace("(", r"\(").replace(")", r"\)")
                       .replace(".", r"\.")):
        call()


def test_functions_of_other_modules_are_recorded_by_module_and_name():
    from karma.modelfile import default_loss_fn, load_model_file

    m = karma.model(net.make_net, net.make_batch, loss_fn=default_loss_fn,
                    make_optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    entry = dict(m.entry)
    assert entry["loss_fn"] == "karma.modelfile:default_loss_fn"
    assert entry["make_optimizer"] == ""  # a lambda cannot be imported again
    again = load_model_file(m.path, (("build_model", "make_net"),
                                     ("example_batch", "make_batch"),
                                     ("loss_fn", entry["loss_fn"])))
    assert again.loss_fn is default_loss_fn
    assert type(again.build_model()).__name__ == "Net"  # the file imported again


def test_a_runtime_given_another_model_than_planned_says_the_schedule_is_stale(tmp_path):
    schedule, _ = planned(model(), tmp_path)
    wider = karma.model(lambda: net.Net(layers=5), net.make_batch, make_optimizer=net.sgd)
    with pytest.raises(KarmaError, match="stale.*karma.plan"):
        karma.Runtime(schedule, model=wider, log=lambda line: None)
    # the same file, another optimizer: its bytes are the planned model's, its state is not
    adam = karma.model(net.make_net, net.make_batch,
                       make_optimizer=lambda params: torch.optim.Adam(params, lr=1e-3))
    assert adam.sha256 == schedule.model.sha256
    with pytest.raises(KarmaError, match="stale.*optimizer"):
        karma.Runtime(schedule, model=adam, log=lambda line: None)


def test_planning_inside_calibration_s_own_karma_run_is_refused(monkeypatch):
    """A model file that plans at its top level, imported by calibration's karma-run, would
    calibrate again in a karma-run of its own, without end."""
    monkeypatch.setenv("KARMA_CALIBRATING", "1")
    with pytest.raises(KarmaError, match="__name__"):
        karma.plan(model(), gpu_mem=BUDGET, hardware="cpu", batch_size=BATCH,
                   measure="estimate")


def test_functions_of_the_script_python_runs_are_not_imported_again(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import karma, torch\n"
        "def build():\n    return torch.nn.Linear(4, 4)\n"
        "def batch(n):\n    return torch.randn(n, 4), torch.randn(n, 4)\n"
        "m = karma.model(build, batch, loss_fn=torch.nn.functional.mse_loss)\n"
        "print(dict(m.entry))\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert eval(done.stdout) == {"build_model": "", "example_batch": "",
                                 "loss_fn": "torch.nn.functional:mse_loss"}


def test_a_forward_replaced_on_the_instance_is_named():
    instance = net.make_net()
    plain = instance.forward
    instance.forward = lambda tokens: plain(tokens)  # as Accelerate's autocast wrapper does
    with pytest.raises(KarmaError, match="forward is replaced on the instance"):
        karma.plan(instance, example_batch=net.make_batch, gpu_mem=BUDGET, hardware="cpu",
                   batch_size=BATCH, measure="estimate", log=lambda note: None)


def test_the_model_state_dict_is_the_state_dict_s_model(tmp_path):
    schedule, _ = planned(model(), tmp_path)
    with karma.Runtime(schedule, model=model(), log=lambda line: None) as rt:
        hand_loop(rt, 2)
        weights = rt.model_state_dict()
        whole = rt.state_dict()["model"]
    assert weights.keys() == whole.keys()
    assert_bitwise_equal(whole, weights)
