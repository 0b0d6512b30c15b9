"""The model-file protocol's defaults."""

from __future__ import annotations

import torch

from karma.modelfile import default_loss_fn, load_model_file


def test_defaults_fill_in(example):
    mf = example("mlp")
    assert mf.loss_fn is default_loss_fn
    assert mf.default_batch_size == 64
    opt = mf.make_optimizer(torch.nn.Linear(2, 2).parameters())
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["lr"] == 1e-3
    assert len(mf.sha256) == 64


def test_default_batches_are_reproducible_and_leave_the_global_rng_alone(example):
    mf = example("mlp")
    torch.manual_seed(123)
    state = torch.get_rng_state()
    a = [next(it) for it in [mf.batches(4, rank=0, world_size=2)] for _ in range(3)]
    assert torch.equal(torch.get_rng_state(), state)
    it = mf.batches(4, rank=0, world_size=2)
    b = [next(it) for _ in range(3)]
    for (xa, ya), (xb, yb) in zip(a, b):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a[0][0], a[1][0])  # steps differ
    other_rank = next(mf.batches(4, rank=1, world_size=2))
    assert not torch.equal(a[0][0], other_rank[0])  # ranks differ


def test_default_loss_flattens_leading_dimensions():
    logits = torch.randn(2, 3, 5)
    targets = torch.randint(0, 5, (2, 3))
    expected = torch.nn.functional.cross_entropy(logits.view(6, 5), targets.view(6))
    assert torch.equal(default_loss_fn(logits, targets), expected)


def test_user_batches_are_used(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        "import torch\n"
        "def build_model(): return torch.nn.Linear(2, 2)\n"
        "def example_batch(b): return torch.zeros(b, 2), torch.zeros(b, dtype=torch.long)\n"
        "def batches(b, rank, world):\n"
        "    while True: yield torch.full((b, 2), float(rank)), torch.zeros(b, dtype=torch.long)\n"
    )
    mf = load_model_file(path)
    x, _ = next(mf.batches(3, rank=1, world_size=2))
    assert torch.equal(x, torch.ones(3, 2))
