"""Time each block's forward and backward on the local device (`karma-plan --profile-blocks`).

The traced graph is split per block as for measuring; the split module gets real, randomly
initialised weights on the device, one forward of the whole model records each block's real
inputs, and then each block runs on its own: the median of a few timed repeats of its
forward, and of its backward from gradients of ones.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch.fx.passes.split_module import split_module

from karma.errors import IRError
from karma.ir.blocks import find_units, group_nodes
from karma.ir.measure import _differentiable, _Probe, _tensors
from karma.ir.trace import _flat_inputs as _flatten
from karma.ir.trace import retarget_device, trace
from karma.modelfile import ModelFile


def profile_blocks(mf: ModelFile, batch_size: int, blocks_regex: str | None = None,
                   device: str = "cpu", repeats: int = 3) -> list[tuple[float, float]]:
    """(forward seconds, backward seconds) of every block, in block order."""
    traced = trace(mf, batch_size)
    # tensors the forward makes itself (`arange(T, device=x.device)`) land on the device, not
    # on meta; with its index (cuda:0), as the graph's dtype and device asserts compare it
    retarget_device(traced.gm, torch.device("meta"), torch.empty(0, device=device).device)
    specs = group_nodes(traced.gm, find_units(traced.model, blocks_regex))
    block_of = {node: i for i, spec in enumerate(specs) for node in spec.nodes}
    split = split_module(traced.gm, traced.gm, lambda n: block_of[n.name],
                         keep_original_order=True)
    _materialize(split, torch.device(device))
    with torch.device(device), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        inputs, _ = mf.checked_example_batch(batch_size)
    probe = _Probe(split)
    try:
        with torch.no_grad():
            probe.run(*_flat_inputs(inputs, traced))
        return [_time_block(getattr(split, f"submod_{i}"), *probe.args[i], device, repeats)
                for i in range(len(specs))]
    except torch.OutOfMemoryError as e:
        raise IRError(f"--profile-blocks ran out of memory on {device} at batch {batch_size}; "
                      "profile with a smaller --batch-size or without --profile-blocks") from e


def _flat_inputs(inputs, traced) -> tuple[torch.Tensor, ...]:
    """Real inputs in the order of the graph's placeholders (as Traced.flat_inputs)."""
    if traced.out_spec is None:
        return inputs.args
    return _flatten(inputs, traced.gm.graph._codegen.pytree_info.in_spec)  # noqa: SLF001


def _materialize(split: torch.nn.Module, device: torch.device) -> None:
    split.to_empty(device=device)
    with torch.no_grad():
        for p in split.parameters():
            p.normal_(0.0, 0.02)
        for name, b in split.named_buffers():
            if b.is_floating_point():
                b.fill_(1.0 if name.endswith("var") else 0.0)
            else:
                b.zero_()


def _time_block(submod, args, from_block, device: str, repeats: int) -> tuple[float, float]:
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    fwd, bwd = [], []
    for _ in range(repeats + 1):  # the first run warms up
        fresh = [a.detach().requires_grad_(True) if fb and _differentiable(a) else a
                 for a, fb in zip(args, from_block)]
        sync()
        t0 = time.perf_counter()
        outs = [o for o in _tensors(submod(*fresh)) if o.requires_grad]
        sync()
        t1 = time.perf_counter()
        if outs:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        sync()
        t2 = time.perf_counter()
        fwd.append(t1 - t0)
        bwd.append(t2 - t1)
    return statistics.median(fwd[1:]), statistics.median(bwd[1:])
