"""What autograd really saves, measured by running the model: the ground truth the IR's saved
bytes are held against (the IR's tests; bench/ir_accuracy.py).

Each counts the storages a saved-tensors hook sees, parameters and buffers excluded, each
storage once: per block, attributed by module calls on real CPU tensors
(`real_saved_bytes_per_block`), or over the whole model's forward and loss
(`whole_model_saved_bytes`).
"""

from __future__ import annotations

import torch

from karma.ir.graph import BlockGraph
from karma.ir.measure import reroute_sdpa
from karma.ir.trace import trace
from karma.modelfile import ModelFile


def real_saved_bytes_per_block(model: torch.nn.Module, graph: BlockGraph,
                               inputs) -> list[int]:
    """What autograd saves per block in a real CPU forward, attributed by module calls.

    Independent of the IR's graph splitting: a global forward pre-hook switches the current
    block whenever a module of that block starts; a saved-tensors hook sums the storages
    saved meanwhile (parameters and buffers excluded, each storage once per block).
    """
    block_of_module = {m: b.index for b in graph.blocks for m in b.modules}
    name_of = {id(m): n for n, m in model.named_modules()}
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}
    current = [0]
    saved: list[dict[int, int]] = [{} for _ in graph.blocks]

    def pre_hook(module, args):
        name = name_of.get(id(module))
        if name in block_of_module:
            current[0] = block_of_module[name]

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in skip:
            saved[current[0]][s.data_ptr()] = s.nbytes()
        return t

    handle = torch.nn.modules.module.register_module_forward_pre_hook(pre_hook)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            inputs.call(model)
    finally:
        handle.remove()
    return [sum(s.values()) for s in saved]


def whole_model_saved_bytes(mf: ModelFile, batch_size: int, eager: bool = False) -> int:
    """Bytes autograd saves for the whole model's forward and loss, each storage once,
    parameters and buffers excluded.

    Default: the traced graph, unsplit, on meta tensors with the IR's fused-attention
    rerouting (karma/ir/measure.py). eager=True: the model file's own model on real CPU
    tensors (no tracing: Hugging Face models take their eager attention path, and CPU
    attention picks its own kernel), for small models only.
    """
    if eager:
        torch.manual_seed(0)
        model = mf.build_model().train()
        inputs, targets = mf.checked_example_batch(batch_size)
    else:
        traced = trace(mf, batch_size)
        model, inputs, targets = traced.gm, traced.inputs, traced.targets
        reroute_sdpa(model)
    skip = {t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers())}
    seen: dict[int, torch.Tensor] = {}  # the tensor keeps its storage's _cdata unique

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage()._cdata not in skip:
            seen[t.untyped_storage()._cdata] = t
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mf.loss_fn(inputs.call(model), targets)
    return sum(t.untyped_storage().nbytes() for t in seen.values())
