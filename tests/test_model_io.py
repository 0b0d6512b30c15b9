"""Any output, any input: models called with keyword arguments, outputs that are dicts,
tuples, dataclasses or Hugging Face ModelOutputs, losses the model computes itself.

tests/models/dict_io.py stands for a Hugging Face model without needing transformers:
`model(**inputs)` with `labels`, a dict with `loss`, `logits` and a hidden state out.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import OrderedDict

import pytest
import torch

from karma.cli.plan import main as plan_main
from karma.cli.run import main as run_main
from karma.errors import ModelFileError
from karma.modelfile import (
    ModelInputs,
    check_batch,
    default_loss_fn,
    load_model_file,
    output_tensors,
)
from karma.runtime.checkpoints.export import model_state_dict
from karma.testing.exactness import (
    assert_bitwise_equal,
    block_graph,
    host_stepped,
    load_with_env,
    plan,
    reference_train,
    run,
)
from tests.conftest import MODELS, environment
from tests.matrix import ONE_BUDGET, strategy_cells
from tests.runtime_helpers import load_small

# --- the protocol's pieces ---------------------------------------------------------------

def test_inputs_may_be_a_tensor_a_tuple_or_a_dict():
    x, y = torch.ones(2, 3), torch.zeros(2)
    assert check_batch((x, y), "w")[0] == ModelInputs((x,))
    assert check_batch(((x, y), None), "w")[0] == ModelInputs((x, y))
    inputs, targets = check_batch(({"input_ids": x, "labels": y}, None), "w")
    assert inputs == ModelInputs((), {"input_ids": x, "labels": y}) and targets is None
    assert inputs.call(lambda **kw: sorted(kw)) == ["input_ids", "labels"]


@pytest.mark.parametrize("batch,expected", [
    (([1, 2], None), "inputs of type list of 2 (int, int)"),
    (({"x": [1.0]}, None), "inputs dict whose entry 'x' is list"),
    (({}, None), "inputs of type dict"),
    ((torch.ones(1), "labels"), "targets of type str"),
    (torch.ones(1), "returned Tensor"),
])
def test_a_batch_of_an_unsupported_type_is_named(batch, expected):
    with pytest.raises(ModelFileError, match="example_batch") as e:
        check_batch(batch, "model.py: example_batch(2)")
    assert expected in str(e.value)


@dataclasses.dataclass
class _Out:
    logits: torch.Tensor
    aux: tuple


def test_output_tensors_finds_every_tensor_wherever_it_sits():
    a, b, c = torch.ones(1), torch.ones(2), torch.ones(3)
    assert output_tensors(a) == [a]
    assert output_tensors((a, [b, None], {"c": c})) == [a, b, c]
    assert output_tensors(OrderedDict(loss=a, logits=b)) == [a, b]
    assert output_tensors(_Out(a, (b, 3))) == [a, b]


def test_output_tensors_of_a_hugging_face_model_output():
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")
    out = modeling_outputs.CausalLMOutputWithPast(loss=torch.ones(()), logits=torch.ones(2, 3))
    assert [t.shape for t in output_tensors(out)] == [torch.Size([]), torch.Size([2, 3])]
    # iterating a ModelOutput yields its keys: the trap the runtime used to fall into
    assert list(out) == ["loss", "logits"]


def test_default_loss_is_the_outputs_own_loss_else_cross_entropy():
    loss = torch.tensor(1.5)
    assert default_loss_fn({"loss": loss, "logits": torch.ones(2, 4)}, None) is loss
    logits = torch.randn(2, 3, 4)
    targets = torch.randint(0, 4, (2, 3))
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 4), targets.reshape(-1))
    assert torch.equal(default_loss_fn({"logits": logits}, targets), expected)
    assert torch.equal(default_loss_fn(logits, targets), expected)
    with pytest.raises(ModelFileError, match="no `loss`.*labels"):
        default_loss_fn({"logits": logits}, None)


# --- planning and training ---------------------------------------------------------------

def test_the_ir_hands_loss_fn_the_output_in_its_real_structure(tmp_path):
    seen = []
    path = tmp_path / "model.py"
    path.write_text((MODELS / "dict_io.py").read_text() + "\n\n" + (
        "SEEN = []\n\n\n"
        "def loss_fn(output, targets):\n"
        "    SEEN.append(sorted(output))\n"
        "    return output['loss'] + 0.0 * output['hidden'].sum()\n"))
    mf = load_model_file(path)
    graph = block_graph(mf)
    seen = mf.module.SEEN
    assert seen == [["hidden", "logits", "loss"]]
    assert [b.name for b in graph.blocks][1:4] == ["layers.0", "layers.1", "layers.2"]
    assert graph.input_bytes == 4 * (16 + 1) * 4 + 4 * 8  # features, scale, int64 labels


@pytest.mark.parametrize("strategy,fraction", strategy_cells(ONE_BUDGET))
@pytest.mark.parametrize("own_loss", [True, False], ids=["own_loss", "targets"])
def test_keyword_inputs_and_dict_outputs_train_bitwise(strategy, fraction, own_loss, tmp_path):
    mf = load_small("dict_io") if own_loss else _with_targets()
    schedule = plan(mf, strategy, fraction)
    ref_sd, ref_losses = reference_train(mf, 4, 3, schedule=schedule)
    report = run(schedule, mf, 3, checkpoint_dir=tmp_path)
    assert report.losses == ref_losses
    assert_bitwise_equal(model_state_dict(tmp_path / "step_3"), ref_sd)


@functools.cache
def _with_targets():
    """dict_io without labels in its inputs: logits out, separate targets, default loss."""
    return load_with_env(MODELS / "dict_io.py", {"DICT_IO_TARGETS": "1"})


def test_eval_every_equals_a_plain_no_grad_forward(tmp_path):
    mf = load_small("dict_io")
    from karma.reference import train_reference

    for strategy, fraction in [("offload_all", 1.0), ("swap_all", 1.0)]:
        schedule = plan(mf, strategy, fraction)
        ref = train_reference(mf, 4, 4, eval_every=2, **host_stepped(schedule))
        report = run(schedule, mf, 4, eval_every=2)
        assert [e["step"] for e in report.evals] == [2, 4]
        assert [{"step": e["step"], "loss": e["loss"]} for e in report.evals] == ref.evals
        assert report.losses == ref.losses  # evaluating did not disturb training


# --- bad input: one line, exit 2 -----------------------------------------------------------

def _model_file(tmp_path, body: str):
    path = tmp_path / "model.py"
    path.write_text((MODELS / "dict_io.py").read_text() + "\n\n" + body)
    return path


def test_dict_keys_the_forward_does_not_accept(tmp_path, capsys):
    path = _model_file(tmp_path, (
        "def example_batch(batch_size):\n"
        "    return {'feature': torch.randn(batch_size, 16), 'scale': torch.ones(batch_size, 1),\n"
        "            'labels': torch.zeros(batch_size, dtype=torch.long)}, None\n"))
    code = plan_main([str(path), "--print-ir"])
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1
    assert "example_batch(4)" in err and "forward(features, scale, labels)" in err
    assert "takes no argument 'feature'" in err and "argument names" in err


@pytest.mark.slow
def test_a_forward_that_returns_nothing_requiring_grad(tmp_path, capsys):
    path = _model_file(tmp_path, (
        "class Detached(Net):\n"
        "    def forward(self, features, scale, labels=None):\n"
        "        out = super().forward(features, scale, labels)\n"
        "        return {k: v.detach() for k, v in out.items()}\n\n\n"
        "def build_model():\n"
        "    return Detached()\n\n\n"
        "def loss_fn(output, targets):\n"
        "    return output['loss']\n"))
    schedule = tmp_path / "s.yaml"
    plan_code = plan_main([str(path), "--hardware", "cpu", "--gpu-mem", "64M",
                           "--strategy", "keep_all", "-o", str(schedule)])
    capsys.readouterr()
    assert plan_code == 0  # on meta tensors the planner cannot tell; the first step can
    code = run_main([str(schedule), "--steps", "1"])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert "build_model()" in err and "no tensor that requires grad" in err
    assert "step 1/" not in out


@pytest.mark.slow
def test_a_batch_of_an_unsupported_type_at_run_time(tmp_path, capsys):
    path = _model_file(tmp_path, (
        "def batches(batch_size, rank, world_size):\n"
        "    while True:\n"
        "        yield [1, 2, 3], None\n"))
    schedule = tmp_path / "s.yaml"
    assert plan_main([str(path), "--hardware", "cpu", "--gpu-mem", "64M", "--strategy",
                      "keep_all", "-o", str(schedule)]) == 0
    capsys.readouterr()
    code = run_main([str(schedule), "--steps", "1"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert "batches(4, 0, 1) returned inputs of type list" in err


@pytest.mark.slow
def test_eval_every_without_eval_batches(tmp_path, capsys):
    path = tmp_path / "model.py"
    text = (MODELS / "dict_io.py").read_text()
    path.write_text(text[:text.index("def eval_batches")])
    schedule = tmp_path / "s.yaml"
    assert plan_main([str(path), "--hardware", "cpu", "--gpu-mem", "64M", "--strategy",
                      "keep_all", "-o", str(schedule)]) == 0
    capsys.readouterr()
    code = run_main([str(schedule), "--steps", "2", "--eval-every", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "defines no eval_batches(batch_size)" in err and err.count("\n") == 1


@pytest.mark.slow
def test_report_lists_the_evals(tmp_path, capsys):
    schedule, report = tmp_path / "s.yaml", tmp_path / "r.json"
    with environment({"DICT_IO_TARGETS": "0"}):
        assert plan_main([str(MODELS / "dict_io.py"), "--hardware", "cpu", "--gpu-mem", "64M",
                          "-o", str(schedule)]) == 0
        assert run_main([str(schedule), "--steps", "2", "--eval-every", "2",
                         "--report", str(report)]) == 0
    out = capsys.readouterr().out
    assert "eval at step 2: loss" in out
    evals = json.loads(report.read_text())["evals"]
    assert [e["step"] for e in evals] == [2] and evals[0]["loss"] > 0


@pytest.mark.slow
def test_a_hugging_face_model_with_its_default_config(tmp_path, capsys):
    """use_cache=True by default: karma turns it off (and says so) for planning and
    training, and loss_fn gets the ModelOutput both times."""
    pytest.importorskip("transformers")
    schedule = tmp_path / "s.yaml"
    model = str(MODELS / "hf_default_config.py")
    assert plan_main([model, "--hardware", "cpu", "--gpu-mem", "64M", "-o", str(schedule)]) == 0
    err = capsys.readouterr().err
    assert err.count("note: turned off the Hugging Face model's KV cache") == 1
    assert run_main([str(schedule), "--steps", "2"]) == 0
    out = capsys.readouterr().out
    assert "turned off the Hugging Face model's KV cache" in out and "step 2/2" in out


def test_eval_batches_that_draw_from_the_global_rng_leave_training_exact(tmp_path):
    """eval_batches is called under a seed of its own, by karma-run and the reference alike:
    a torch.randn in it does not shift dropout's masks."""
    path = _model_file(tmp_path, (
        "def eval_batches(batch_size):\n"
        "    return [({'features': torch.randn(batch_size, 16), 'scale': torch.rand(batch_size, 1),\n"
        "              'labels': torch.randint(0, 8, (batch_size,))}, None)]\n"))
    mf = load_model_file(path)
    from karma.reference import train_reference

    ref = train_reference(mf, 4, 4, eval_every=2)
    assert ref.losses == reference_train(mf, 4, 4)[1]  # evaluating changed nothing
    report = run(plan(mf, "swap_all"), mf, 4, eval_every=2)
    assert report.losses == ref.losses
    assert [e["loss"] for e in report.evals] == [e["loss"] for e in ref.evals]


@pytest.mark.parametrize("strategy", ["keep_all", "swap_all", "recompute_all"])
def test_backward_is_found_whatever_the_order_of_keyword_arguments(strategy, tmp_path):
    """Each layer is called as layer(bias=bias, h=h), the bias made once and read by all: the
    previous block's output is the input made last, not the first one named."""
    mf = load_small("kw_order")
    schedule = plan(mf, strategy, 1.5)  # recompute: > 1
    ref_sd, ref_losses = reference_train(mf, 4, 3, schedule=schedule)
    report = run(schedule, mf, 3, checkpoint_dir=tmp_path)
    assert report.losses == ref_losses
    assert_bitwise_equal(model_state_dict(tmp_path / "step_3"), ref_sd)


@pytest.mark.slow
def test_a_block_karma_cannot_hook_is_not_blamed_on_control_flow(tmp_path, capsys):
    path = tmp_path / "model.py"
    path.write_text(
        "import torch\nimport torch.nn as nn\n\nBATCH_SIZE = 4\n\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.pos = nn.Parameter(torch.randn(16))\n"
        "        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))\n"
        "        self.head = nn.Linear(16, 8)\n\n"
        "    def forward(self, x):\n"
        "        x = x + self.pos\n"
        "        for layer in self.layers:\n"
        "            x = torch.tanh(layer(x))\n"
        "        return self.head(x)\n\n\n"
        "def build_model():\n    return Net()\n\n\n"
        "def example_batch(b):\n    return torch.randn(b, 16), torch.randint(0, 8, (b,))\n")
    schedule = tmp_path / "s.yaml"
    assert plan_main([str(path), "--hardware", "cpu", "--gpu-mem", "64M", "--strategy",
                      "keep_all", "-o", str(schedule)]) == 0
    capsys.readouterr()
    assert run_main([str(schedule), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "no module of its own that karma can hook" in err and "control flow" not in err
