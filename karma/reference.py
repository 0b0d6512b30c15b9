"""The plain PyTorch training loop that karma must equal, as a command.

    python -m karma.reference examples/gpt.py --batch-size 2 --steps 5 [--seed 0]

Prints one JSON line: the losses, and the peak private memory above the process's baseline
before the model was built. Used under `prlimit --data` to show that ordinary training cannot
live where karma-run does (bench/out_of_core.py).
"""

from __future__ import annotations

import argparse
import json

import torch

from karma.modelfile import load_model_file
from karma.runtime.host import data_bytes, private_bytes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    mf = load_model_file(args.model)
    mf.make_optimizer([torch.nn.Parameter(torch.zeros(1))])  # import-time costs, as karma-run
    baseline, baseline_data = private_bytes(), data_bytes()

    torch.manual_seed(args.seed)
    model = mf.build_model()
    model.train()
    opt = mf.make_optimizer(model.parameters())
    data = mf.batches(args.batch_size, 0, 1)
    losses, peak = [], 0
    for _ in range(args.steps):
        x, y = next(data)
        x = x if isinstance(x, (tuple, list)) else (x,)
        loss = mf.loss_fn(model(*x), y)
        loss.backward()
        peak = max(peak, private_bytes() - baseline)
        opt.step()
        opt.zero_grad()
        peak = max(peak, private_bytes() - baseline)
        losses.append(loss.item())
    print(json.dumps({"losses": losses, "peak_private_bytes": peak,
                      "baseline_private_bytes": baseline, "baseline_data_bytes": baseline_data}))


if __name__ == "__main__":
    main()
