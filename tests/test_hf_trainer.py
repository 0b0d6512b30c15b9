"""KarmaTrainer: the Hugging Face Trainer, out of core, bitwise equal to the Trainer alone.

The runs are the README's KarmaTrainer quick start on a synthetic dataset of fixed-length
token sequences, once with `Trainer` and once with `KarmaTrainer` under a budget that needs
out-of-core execution; the tests compare what the Trainer promises: its logs, evaluation,
trained weights, `save_model`, checkpoints and resume.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments  # noqa: E402

from karma.errors import KarmaError  # noqa: E402
from karma.integrations.hf_parts import BatchShape, DecayRule  # noqa: E402
from karma.integrations.hf_trainer import KarmaTrainer  # noqa: E402
from karma.testing.exactness import assert_bitwise_equal  # noqa: E402

SEQ_LEN, VOCAB = 32, 512
KARMA = {"gpu_mem": "2M", "hardware": "cpu", "measure": "estimate"}  # the quick start's, planned
# from the roofline estimate (no calibration run)
LOGGED = ("loss", "grad_norm", "learning_rate", "eval_loss", "train_loss", "step")


class Tokens(torch.utils.data.Dataset):
    """`n` random sequences of SEQ_LEN tokens, each its own labels (the model shifts them)."""

    def __init__(self, n: int, seed: int):
        self.ids = torch.randint(0, VOCAB, (n, SEQ_LEN),
                                 generator=torch.Generator().manual_seed(seed))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}


def quick_start(trainer_cls, output_dir: Path, train_samples: int = 32, karma: dict | None = None,
                resume: Path | None = None, **overrides) -> Trainer:
    """The README's quick start, `Trainer` or `KarmaTrainer`; `overrides` replace arguments."""
    train, held_out = Tokens(train_samples, seed=0), Tokens(8, seed=1)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, vocab_size=VOCAB,
                                         num_hidden_layers=2, num_attention_heads=4))
    args = TrainingArguments(**{**dict(
        output_dir=str(output_dir), max_steps=4, per_device_train_batch_size=4,
        per_device_eval_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=1e-3, weight_decay=0.1, warmup_steps=1, logging_steps=1,
        eval_strategy="steps", eval_steps=2, save_steps=2, use_cpu=True, disable_tqdm=True),
        **overrides})
    extra = {} if trainer_cls is Trainer else {"karma": karma or KARMA}
    trainer = trainer_cls(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                          **extra)
    trainer.train(resume_from_checkpoint=None if resume is None else str(resume))
    return trainer


def logs(trainer: Trainer) -> list[dict]:
    return [{k: v for k, v in entry.items() if k in LOGGED} for entry in trainer.state.log_history]


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The quick start with the Trainer alone and with karma, and karma's save_model."""
    root = tmp_path_factory.mktemp("hf")
    plain = quick_start(Trainer, root / "plain")
    karma = quick_start(KarmaTrainer, root / "karma")
    karma.save_model(str(root / "karma" / "final"))
    plain.training_logs, karma.training_logs = logs(plain), logs(karma)  # before evaluate()
    return root, plain, karma


def test_the_quick_start_trains_out_of_core_as_the_trainer_does_to_the_bit(runs):
    _, plain, karma = runs
    blocks = karma.karma_schedule.blocks
    assert any(b.act != "keep" or b.weights != "resident" or b.optim != "device"
               for b in blocks), "the budget should need out-of-core execution"
    assert any(b.optim == "host" for b in blocks), "weight decay groups of host copies untested"
    trained = karma.training_logs
    assert [e["step"] for e in trained if "loss" in e] == [1, 2, 3, 4]
    assert sum("eval_loss" in e for e in trained) == 2
    assert all("grad_norm" in e and "learning_rate" in e for e in trained if "loss" in e)
    assert trained == plain.training_logs  # losses, grad norms, learning rates, eval losses
    assert_bitwise_equal(weights(karma.model), weights(plain.model))


def test_save_model_and_checkpoints_load_with_from_pretrained(runs):
    root, plain, _ = runs
    saved = LlamaForCausalLM.from_pretrained(root / "karma" / "final")
    assert_bitwise_equal(weights(saved), weights(plain.model))
    checkpoint = root / "karma" / "checkpoint-2"
    assert (checkpoint / "karma" / "step_2" / "meta.json").is_file()  # karma's own, by step
    assert_bitwise_equal(weights(LlamaForCausalLM.from_pretrained(checkpoint)),
                         weights(LlamaForCausalLM.from_pretrained(root / "plain" / "checkpoint-2")))


def test_evaluate_after_training_runs_in_a_karma_run_of_its_own(runs):
    _, plain, karma = runs
    assert karma.evaluate()["eval_loss"] == plain.evaluate()["eval_loss"]
    assert karma.karma_schedule.config.accumulate == 1  # planned for evaluating, not training


def test_resuming_from_a_checkpoint_continues_to_the_bit(runs, tmp_path):
    root, plain, _ = runs
    resumed = quick_start(KarmaTrainer, tmp_path, resume=root / "karma" / "checkpoint-2")
    def later(entries):  # steps 3 and 4 (train_loss averages the steps of one train() call)
        return [e for e in entries if e["step"] > 2 and "train_loss" not in e]

    assert len(later(logs(resumed))) == 3
    assert later(logs(resumed)) == later(plain.training_logs)
    assert_bitwise_equal(weights(resumed.model), weights(plain.model))


def test_bf16_label_smoothing_three_micro_batches_and_no_clipping_to_the_bit(tmp_path):
    options = dict(bf16=True, label_smoothing_factor=0.1, gradient_accumulation_steps=3,
                   max_grad_norm=0.0, save_strategy="no")
    plain = quick_start(Trainer, tmp_path / "plain", train_samples=36, **options)
    karma = quick_start(KarmaTrainer, tmp_path / "karma", train_samples=36,
                        karma={**KARMA, "gpu_mem": "3M"}, **options)
    assert karma.karma_schedule.config.dtype == "bf16"
    assert karma.karma_schedule.config.accumulate == 3
    assert all("grad_norm" not in e for e in logs(karma)), "karma takes no norm without clipping"
    strip = [{k: v for k, v in e.items() if k != "grad_norm"} for e in logs(plain)]
    assert logs(karma) == strip
    assert_bitwise_equal(weights(karma.model), weights(plain.model))


@pytest.mark.parametrize("change, message", [
    (dict(args={"fp16": True}), "fp16=True"),
    (dict(karma={"batch_size": 8}), "per_device_train_batch_size"),
    (dict(karma={"gpu_memory": "2M"}), "not a planning option"),
    (dict(optimizers="made"), "optimizer_cls_and_kwargs"),
])
def test_what_karma_cannot_carry_is_refused_with_the_fix(change, message, tmp_path):
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, vocab_size=64,
                                         num_hidden_layers=1, num_attention_heads=2))
    args = dict(output_dir=str(tmp_path), use_cpu=True, **change.get("args", {}))
    extra = {}
    if change.get("optimizers"):
        opt = torch.optim.AdamW(model.parameters())
        extra["optimizers"] = (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0))
    with pytest.raises(KarmaError, match=message):
        KarmaTrainer(model=model, args=TrainingArguments(**args),
                     karma={**KARMA, **change.get("karma", {})}, **extra)


def test_a_batch_of_another_shape_is_refused():
    shape = BatchShape.of({"input_ids": torch.zeros(4, 32, dtype=torch.long)}, None, 4)
    assert shape.problem({"input_ids": torch.zeros(2, 32, dtype=torch.long)}, None) is None
    assert "input_ids is [batch, 48]" in shape.problem(
        {"input_ids": torch.zeros(4, 48, dtype=torch.long)}, None)
    assert "5 samples" in shape.problem({"input_ids": torch.zeros(5, 32, dtype=torch.long)}, None)


def test_the_decay_groups_of_host_copies_come_from_their_shapes_or_block_or_are_refused():
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    named = [("a.weight", a.weight), ("a.bias", a.bias), ("b.weight", b.weight),
             ("b.bias", b.bias)]
    blocks = [("a", ["a.weight", "a.bias"]), ("b", ["b.weight", "b.bias"])]
    copies = [torch.nn.Parameter(a.weight.detach().clone()),
              torch.nn.Parameter(a.bias.detach().clone())]  # a host-stepped block's masters

    by_shape = DecayRule(named, {"a.weight", "b.weight"}, weight_decay=0.1)
    by_shape.know_blocks(blocks)
    decayed, kept = by_shape.groups(copies)
    assert decayed["params"] == [copies[0]] and kept["params"] == [copies[1]]
    assert (decayed["weight_decay"], kept["weight_decay"]) == (0.1, 0.0)
    assert by_shape.groups([torch.zeros(5, 3)])[0]["params"][0].shape == (5, 3)  # karma's own

    by_block = DecayRule(named[:2] + [("m.weight", b.weight)], {"a.weight"}, weight_decay=0.1)
    by_block.know_blocks([("a", ["a.weight", "a.bias"]), ("m", ["m.weight"])])
    assert by_block.groups(copies)[0]["params"] == [copies[0]]  # (3, 3) decays in a only

    odd = DecayRule(named, {"a.weight", "b.bias"}, weight_decay=0.1)  # same shapes, other decay
    assert odd.groups(copies)[0]["params"] == copies  # planning's timing: any group will do
    odd.know_blocks(blocks)
    with pytest.raises(KarmaError, match="weight_decay=0"):
        odd.groups(copies)
    assert odd.groups([a.weight, b.bias])[0]["params"] == [a.weight, b.bias]  # by identity


def accuracy(prediction) -> dict[str, float]:
    """compute_metrics: next-token accuracy from the logits and labels the Trainer gathers."""
    logits, labels = prediction.predictions, prediction.label_ids
    hits = (logits[:, :-1].argmax(-1) == labels[:, 1:])
    return {"accuracy": float(hits.mean())}


def measured(metrics: dict) -> dict:
    """The metrics of the model, without the evaluation's speed."""
    return {k: v for k, v in metrics.items() if "runtime" not in k and "per_second" not in k}


def test_compute_metrics_and_predict_get_the_trainer_s_logits(runs):
    _, plain, karma = runs
    for trainer in (plain, karma):
        trainer.compute_metrics = accuracy
    metrics = measured(karma.evaluate())
    assert metrics == measured(plain.evaluate()) and "eval_accuracy" in metrics
    held_out = Tokens(8, seed=1)
    karma_out, plain_out = karma.predict(held_out), plain.predict(held_out)
    assert karma_out.predictions.shape == (8, SEQ_LEN, VOCAB)
    assert (karma_out.predictions == plain_out.predictions).all()
    assert (karma_out.label_ids == plain_out.label_ids).all()
    assert measured(karma_out.metrics) == measured(plain_out.metrics)
    unlabeled = [{"input_ids": held_out[i]["input_ids"]} for i in range(len(held_out))]
    karma_out, plain_out = karma.predict(unlabeled), plain.predict(unlabeled)
    assert karma_out.label_ids is None and karma_out.predictions.shape == (8, SEQ_LEN, VOCAB)
    assert (karma_out.predictions == plain_out.predictions).all()
    for trainer in (plain, karma):
        trainer.compute_metrics = None
