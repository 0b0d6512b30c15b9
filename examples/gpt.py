"""GPT-2 in plain PyTorch (after nanoGPT), as a karma model file.

    karma-plan examples/gpt.py --print-ir
    KARMA_GPT=xl karma-plan examples/gpt.py --print-ir --batch-size 8

Size by environment variable KARMA_GPT = tiny | small | medium | large | xl (default small),
or any shape as LAYERSxWIDTHxHEADS[xVOCAB] (vocabulary 50257 unless given): KARMA_GPT=40x5888x46
is the 17B-parameter GPT of the KARMA paper's largest run. Sequence length by KARMA_SEQ
(default 1024; 32 for tiny). `tiny` is for fast tests on a CPU.
The token embedding and the output head share their weight, as in GPT-2.

It trains on real text that needs no download: the documentation Python ships for `help()`
(`pydoc_data.topics`, about 465 KB), one token per byte. `batches` walks the first 95% of it,
`eval_batches` is the held-out last 5%.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

# name: (n_layer, n_head, n_embd, vocab_size, default sequence length)
# The data are ASCII bytes (token = byte value < 128; see `text`), so `tiny`'s 128 tokens are
# exactly its alphabet. small..xl keep GPT-2's 50257 tokens so that what karma plans and
# benchmarks for them is GPT-2's real size; they see only the first 128 ids, and the first
# steps visibly teach them so (the loss falls from ln 50257 = 10.8).
SIZES = {
    "tiny": (2, 2, 32, 128, 32),
    "small": (12, 12, 768, 50257, 1024),
    "medium": (24, 16, 1024, 50257, 1024),
    "large": (36, 20, 1280, 50257, 1024),
    "xl": (48, 25, 1600, 50257, 1024),
}
SIZE = os.environ.get("KARMA_GPT", "small")


def _shape(size: str) -> tuple[int, int, int, int, int]:
    """SIZES[size], or the shape a LAYERSxWIDTHxHEADS[xVOCAB] spec gives."""
    if size in SIZES:
        return SIZES[size]
    parts = size.lower().split("x")
    if len(parts) in (3, 4) and all(part.isdigit() and int(part) > 0 for part in parts):
        layers, width, heads, vocab = (*map(int, parts), 50257)[:4]
        if width % heads == 0:
            return layers, heads, width, vocab, 1024
    raise ValueError(f"KARMA_GPT={size!r} is not a GPT size; use one of {', '.join(SIZES)}, "
                     "or LAYERSxWIDTHxHEADS[xVOCAB] with WIDTH a multiple of HEADS (40x5888x46)")


N_LAYER, N_HEAD, N_EMBD, VOCAB, _SEQ = _shape(SIZE)
SEQ = int(os.environ.get("KARMA_SEQ", _SEQ))
DROPOUT = 0.1
BATCH_SIZE = 4 if SIZE == "tiny" else 8


class CausalSelfAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_attn = nn.Linear(N_EMBD, 3 * N_EMBD)
        self.c_proj = nn.Linear(N_EMBD, N_EMBD)
        self.resid_dropout = nn.Dropout(DROPOUT)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(N_EMBD, dim=2)
        q, k, v = (t.view(B, T, N_HEAD, C // N_HEAD).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc = nn.Linear(N_EMBD, 4 * N_EMBD)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * N_EMBD, N_EMBD)
        self.dropout = nn.Dropout(DROPOUT)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1 = nn.LayerNorm(N_EMBD)
        self.attn = CausalSelfAttention()
        self.ln_2 = nn.LayerNorm(N_EMBD)
        self.mlp = MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(VOCAB, N_EMBD)
        self.wpe = nn.Embedding(SEQ, N_EMBD)
        self.drop = nn.Dropout(DROPOUT)
        self.h = nn.ModuleList(Block() for _ in range(N_LAYER))
        self.ln_f = nn.LayerNorm(N_EMBD)
        self.lm_head = nn.Linear(N_EMBD, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as in GPT-2
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * N_LAYER))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def build_model() -> nn.Module:
    return GPT()


def example_batch(batch_size: int):
    """A batch of the shape and dtype `batches` yields, from factory functions only (the planner
    calls it on the meta device)."""
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    return tokens[:, :-1], tokens[:, 1:]


# --- Data: Python's own documentation, one token per byte --------------------------------
# The text is split at held_out_start() into a training part and a held-out part, and each
# part is cut into windows of SEQ + 1 bytes that start every SEQ bytes: training window w is
# text[w * SEQ : w * SEQ + SEQ + 1], wholly before the split. A window's first SEQ bytes are
# the inputs, its last SEQ the targets (the inputs shifted by one). The training windows are
# put in one fixed shuffled order (the topics come in name order, and a model trained on them
# in that order learns one topic's style after another); rank r of N owns every N-th window
# of that order from the r-th, and walks them in it, batch_size at a time, wrapping around.
# The shuffle has its own generator: karma-run and the plain loop that it must equal bit for
# bit draw these batches between their own uses of the global RNG, which must stay untouched.
HELD_OUT = 0.05  # the last 5% of the text, never trained on
EVAL_BATCHES = 4


@functools.cache
def text() -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of byte values: every topic of `help()`, in name order,
    as ASCII (the few hundred non-ASCII characters become "?")."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:
        raise RuntimeError(
            "examples/gpt.py trains on the documentation in pydoc_data.topics, which this Python "
            "lacks (some distributions strip it); install the full standard library, or define "
            "your own batches()") from e
    data = "\n\n".join(topics[name] for name in sorted(topics)).encode("ascii", "replace")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def held_out_start() -> int:
    """The offset of the first held-out byte."""
    return len(text()) - int(len(text()) * HELD_OUT)


def _windows(part: torch.Tensor, what: str) -> torch.Tensor:
    """[n, SEQ + 1]: the windows of `part`, a view."""
    if len(part) < SEQ + 1:
        raise ValueError(f"the {what} text ({len(part)} bytes) is shorter than one window of "
                         f"KARMA_SEQ={SEQ} + 1 bytes; use a smaller KARMA_SEQ")
    return part.unfold(0, SEQ + 1, SEQ)


def batches(batch_size: int, rank: int, world_size: int):
    """Training batches for rank `rank` of `world_size`, endlessly (see the layout above)."""
    windows = _windows(text()[:held_out_start()], "training")
    if world_size > len(windows):
        raise ValueError(f"{world_size} ranks are more than the {len(windows)} training windows "
                         f"of KARMA_SEQ={SEQ} bytes; use fewer ranks or a smaller KARMA_SEQ")
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(0))
    return _rows(windows, order[rank::world_size], batch_size, count=None)


def eval_batches(batch_size: int):
    """EVAL_BATCHES batches of held-out windows spread evenly over the held-out text, the same
    on every call (fewer batches when it holds fewer windows; a window repeats only when one
    batch is larger than all of them)."""
    windows = _windows(text()[held_out_start():], "held-out")
    count = max(1, min(EVAL_BATCHES, len(windows) // batch_size))
    spread = torch.arange(count * batch_size) * len(windows) // (count * batch_size)
    return _rows(windows, spread, batch_size, count)


def _rows(windows: torch.Tensor, order: torch.Tensor, batch_size: int, count: int | None):
    """(inputs, targets) of the windows numbered `order`, `batch_size` at a time, wrapping
    around: `count` batches, or endlessly."""
    step = 0
    while count is None or step < count:
        rows = torch.arange(step * batch_size, (step + 1) * batch_size) % len(order)
        tokens = windows[order[rows]]
        yield tokens[:, :-1], tokens[:, 1:]
        step += 1
