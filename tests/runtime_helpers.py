"""The runtime tests' model files: the examples at their test sizes, loaded once
(`load_small`), and a model that calls its layers in an order chosen at run time
(`LAYERS_MODEL`). What the tests check them with is karma.testing.exactness."""

from __future__ import annotations

import textwrap
from functools import cache
from pathlib import Path

from karma.modelfile import ModelFile
from karma.testing.exactness import SMALL_ENV, load_with_env
from tests.conftest import EXAMPLES

# A model file of three layers whose forward calls them in the order LAYER_ORDER gives at
# call time (default 0,1,2): planned in order, then run in another, it leaves its schedule.
LAYERS_MODEL = textwrap.dedent('''
    """Three layers, called in the order LAYER_ORDER gives when forward runs (default 0,1,2)."""
    import os

    import torch
    import torch.nn as nn

    BATCH_SIZE = 4


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))

        def forward(self, x):
            for i in os.environ.get("LAYER_ORDER", "0,1,2").split(","):
                x = torch.tanh(self.layers[int(i)](x))
            return x


    def build_model():
        return Net()


    def example_batch(batch_size):
        return torch.randn(batch_size, 16), torch.randint(0, 16, (batch_size,))
''')


@cache
def load_small(name: str) -> ModelFile:
    """examples/NAME.py at its small test size (karma.testing.exactness.SMALL_ENV), or
    tests/models/NAME.py, loaded once."""
    path = EXAMPLES / f"{name}.py"
    if not path.exists():
        path = Path(__file__).resolve().parent / "models" / f"{name}.py"
    return load_with_env(path, SMALL_ENV.get(name, {}))
