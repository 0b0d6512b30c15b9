"""examples/gpt.py's data: Python's documentation, byte by byte, walked per rank.

The layout (the comment above `text` in examples/gpt.py): training window w is
text[w * SEQ : w * SEQ + SEQ + 1], wholly before held_out_start(); the ranks walk disjoint
shares of one fixed shuffled order of them. These tests check it from the outside: the rows
one epoch yields are, as a multiset, exactly the training windows, split between the ranks.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture
def gpt(example):
    return example("gpt").module  # KARMA_GPT=tiny: SEQ 32, VOCAB 128


def training_windows(gpt) -> Counter:
    """Every window of SEQ + 1 bytes that starts at a multiple of SEQ and ends before the
    held-out text, as bytes, counted (the text repeats itself here and there)."""
    text, seq = gpt.text(), gpt.SEQ
    offsets = range(0, gpt.held_out_start() - seq, seq)
    assert max(offsets) + seq < gpt.held_out_start()  # the last target byte is not held out
    return Counter(bytes(text[o:o + seq + 1].tolist()) for o in offsets)


def rows(it, n_batches: int) -> tuple[torch.Tensor, torch.Tensor]:
    xs, ys = zip(*itertools.islice(it, n_batches))
    return torch.cat(xs), torch.cat(ys)


def as_windows(x: torch.Tensor, y: torch.Tensor) -> list[bytes]:
    """Each row's window: its inputs and the last target."""
    return [bytes(r.tolist()) for r in torch.cat([x, y[:, -1:]], dim=1)]


def test_the_text_is_python_documentation_as_ascii_bytes(gpt):
    text = gpt.text()
    assert text.dtype == torch.int64 and text.dim() == 1 and len(text) > 400_000
    assert 0 <= int(text.min()) and int(text.max()) < 128 <= gpt.VOCAB
    assert b'The "assert" statement' in bytes(text[:100].tolist())


@pytest.mark.parametrize("world_size", [1, 3])
def test_the_ranks_share_out_the_training_windows_and_wrap_around(gpt, world_size):
    B = 64
    everything = training_windows(gpt)
    total = sum(everything.values())
    union: Counter = Counter()
    for rank in range(world_size):
        own = total // world_size + (rank < total % world_size)  # rank r's share, as strided
        x, y = rows(gpt.batches(B, rank, world_size), own // B + 2)  # an epoch, then more
        walked = as_windows(x, y)
        assert walked[own:] == walked[:len(walked) - own]  # the next epoch repeats this one
        epoch = Counter(walked[:own])
        assert len(walked[:own]) == own and epoch <= everything
        assert union + epoch <= everything  # no window on two ranks
        union += epoch
    assert union == everything  # together the ranks walk every training window, once


def test_a_rank_walks_the_text_out_of_order(gpt):
    x, _ = next(gpt.batches(8, 0, 1))
    text = bytes(gpt.text().tolist())
    starts = sorted(text.find(bytes(r.tolist())) for r in x)
    assert starts[-1] - starts[0] > len(text) // 4  # not eight neighbouring windows


def test_targets_are_the_inputs_shifted_by_one(gpt):
    x, y = next(gpt.batches(4, 0, 1))
    assert torch.equal(x[:, 1:], y[:, :-1])
    assert not torch.equal(x, y)


def test_batches_are_deterministic(gpt, example):
    a = rows(gpt.batches(4, 1, 2), 5)
    b = rows(gpt.batches(4, 1, 2), 5)
    c = rows(example("gpt").module.batches(4, 1, 2), 5)  # a fresh import: the text re-read
    assert all(torch.equal(p, q) for p, q in zip(a + a, b + c))
    assert not torch.equal(a[0], rows(gpt.batches(4, 0, 2), 5)[0])  # ranks differ


def test_the_held_out_text_is_never_trained_on(gpt):
    split = gpt.held_out_start()
    assert split == len(gpt.text()) - int(0.05 * len(gpt.text()))
    # (training rows are training windows, all before the split: the test above)
    evals = list(gpt.eval_batches(4))
    assert len(evals) == gpt.EVAL_BATCHES
    x = torch.cat([x for x, _ in evals])
    y = torch.cat([y for _, y in evals])
    held_out = gpt.text()[split:]
    windows = held_out.unfold(0, gpt.SEQ + 1, gpt.SEQ)
    offsets = [-1]
    for row in torch.cat([x, y[:, -1:]], dim=1):  # each row: a held-out window after the last
        at = [int(i) * gpt.SEQ for i in windows.eq(row).all(dim=1).nonzero()]
        assert any(o > offsets[-1] for o in at)
        offsets.append(min(o for o in at if o > offsets[-1]))
    assert offsets[-1] - offsets[1] > len(held_out) // 2  # spread over the held-out text
    again = list(gpt.eval_batches(4))  # the same batches on every call
    assert all(torch.equal(a, b) for (a, _), (b, _) in zip(evals, again))


def test_eval_batches_shrink_to_the_held_out_text(example):
    gpt = example("gpt", KARMA_SEQ="1024").module
    held_out_windows = (len(gpt.text()) - gpt.held_out_start() - 1) // 1024
    evals = list(gpt.eval_batches(8))
    assert len(evals) == held_out_windows // 8 < gpt.EVAL_BATCHES
    one = list(gpt.eval_batches(held_out_windows + 1))  # larger than the held-out text: repeats
    assert len(one) == 1 and len(set(as_windows(*one[0]))) == held_out_windows


def test_a_window_longer_than_the_text_is_refused_with_the_fix(example):
    gpt = example("gpt", KARMA_SEQ="100000").module
    with pytest.raises(ValueError, match="held-out text .* shorter than one window.*KARMA_SEQ"):
        gpt.eval_batches(1)


def test_the_global_rng_is_untouched(gpt):
    gpt.text.cache_clear()  # include reading the text
    torch.manual_seed(123)
    state = torch.get_rng_state()
    rows(gpt.batches(4, 1, 2), 3)
    list(gpt.eval_batches(4))
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("size", ["tiny", "small"])
def test_batches_look_like_example_batch(example, size):
    gpt = example("gpt", KARMA_GPT=size, KARMA_SEQ="48").module
    want = gpt.example_batch(3)
    for got in (next(gpt.batches(3, 0, 1)), next(gpt.eval_batches(3))):
        for g, w in zip(got, want):
            assert (g.shape, g.dtype, g.device) == (w.shape, w.dtype, w.device)
            assert int(g.max()) < gpt.VOCAB


@pytest.fixture
def one_thread():
    """A model this small runs fastest on one thread (and 10x slower on a busy machine's two)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_tiny_gpt_learns_the_text(gpt, one_thread):
    """The held-out loss falls from about a uniform guess among the 128 ASCII bytes (4.85) to
    below what knowing only how often each byte occurs scores (3.25): it uses the context."""
    torch.manual_seed(0)
    model = gpt.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

    def held_out_loss() -> float:
        model.eval()
        with torch.no_grad():
            losses = [F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                      for x, y in gpt.eval_batches(8)]
        model.train()
        return sum(losses).item() / len(losses)

    before = held_out_loss()
    for x, y in itertools.islice(gpt.batches(8, 0, 1), 200):
        F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        opt.step()
        opt.zero_grad()
    after = held_out_loss()
    assert before > 4.5 and after < 3.0, (before, after)
