"""Each saved storage counted once: the IR's total against autograd's over the whole model.

See [Note: each saved storage counted once] in karma/ir/graph.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from karma.ir.build import build_block_graph
from karma.modelfile import ModelFile, load_model_file
from karma.testing.autograd_saved import whole_model_saved_bytes

MODELS = Path(__file__).parent / "models"


def ir_saved_bytes(mf: ModelFile, batch_size: int) -> int:
    graph = build_block_graph(mf, batch_size=batch_size)
    return graph.saved_bytes + graph.loss_act_bytes


@pytest.mark.parametrize("name, path, env", [
    ("resnet", "examples/resnet.py", {"KARMA_RESNET": "tiny"}),
    ("gpt", "examples/gpt.py", {"KARMA_GPT": "tiny"}),
    ("llama", "tests/models/hf_llama_tiny.py", {}),
])
def test_ir_total_is_autograds_whole_model_total(monkeypatch, name, path, env):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    mf = load_model_file(Path(__file__).parent.parent / path)
    ir = ir_saved_bytes(mf, batch_size=2)
    whole = whole_model_saved_bytes(mf, batch_size=2)
    assert abs(ir - whole) <= 0.02 * whole, (ir, whole)
    assert abs(ir - whole_model_saved_bytes(mf, 2, eager=True)) <= 0.02 * whole


def test_resnet_counts_its_shared_block_outputs_once(monkeypatch):
    """A bottleneck's final relu output is saved by it and by the next bottleneck's conv."""
    monkeypatch.setenv("KARMA_RESNET", "tiny")
    graph = build_block_graph(load_model_file(Path(__file__).parent.parent / "examples/resnet.py"),
                              batch_size=2)
    names = [b.name for b in graph.blocks]
    pairs = {(s.producer, s.readers) for s in graph.shared_saved}
    i = names.index("layer1.0")
    assert (i, (i, i + 1)) in pairs
    assert (-1, (0,)) in pairs  # the image, saved by the head's conv


def test_llama_rotary_tables_are_shared_by_the_layers():
    graph = build_block_graph(load_model_file(MODELS / "hf_llama_tiny.py"), batch_size=2)
    head = [b.name for b in graph.blocks].index("head")
    layers = tuple(b.index for b in graph.blocks if ".layers." in b.name)
    shared = {(s.producer, s.readers): s.bytes for s in graph.shared_saved}
    # cos and sin [1, 1, T, head_dim] fp32; no causal mask: without padding, eager skips it
    # (SDPA's is_causal) and so does the trace (see karma/ir/trace.py)
    t, head_dim = 32, 16
    assert shared[(head, layers)] == 2 * t * head_dim * 4


# --- a hand-made model: block 1 saves what block 0 made --------------------------------

WIDTH = 16


class Producer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return torch.tanh(self.fc(x))  # tanh saves its output


class Reader(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return self.fc(x)  # linear saves its input: block 0's tanh output


class TwoBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([Producer(), Reader()])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _two_blocks_file(tmp_path: Path) -> ModelFile:
    path = tmp_path / "two_blocks.py"
    path.write_text(
        "import torch\n"
        "from tests.test_ir_shared import TwoBlocks, WIDTH\n"
        "def build_model():\n    return TwoBlocks()\n"
        "def example_batch(batch_size):\n"
        "    return torch.randn(batch_size, WIDTH), torch.randn(batch_size, WIDTH)\n"
        "def loss_fn(output, targets):\n    return ((output - targets) ** 2).mean()\n")
    return load_model_file(path)


def test_a_storage_two_blocks_save_is_counted_once_until_the_first_readers_backward(tmp_path):
    mf = _two_blocks_file(tmp_path)
    graph = build_block_graph(mf, batch_size=4, blocks_regex=r"layers\.\d")
    assert [b.name for b in graph.blocks] == ["layers.0", "layers.1"]
    tanh_out = 4 * WIDTH * 4
    # block 0 saves its input x (the model's input) and its tanh output; block 1 saves the
    # tanh output as its linear's input
    assert graph.shared_saved[-1].producer == 0
    assert graph.shared_saved[-1].readers == (0, 1)
    assert graph.shared_saved[-1].bytes == tanh_out
    assert graph.shared_saved[-1].freed_after == 0  # block 0's backward runs after block 1's
    assert graph.blocks[1].act_bytes == 0  # nothing only block 1 saves
    assert graph.block_saved_bytes(1) == tanh_out
    assert graph.saved_bytes + graph.loss_act_bytes == whole_model_saved_bytes(mf, 4)
    # without the dedup the two blocks would count tanh_out twice
    per_block = sum(graph.block_saved_bytes(i) for i in range(len(graph.blocks)))
    assert per_block == graph.saved_bytes + tanh_out
