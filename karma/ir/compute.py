"""How the IR runs blocks while measuring them: fp32 on meta tensors, bf16 under autocast.

[Note: measuring under autocast] Mixed precision (`karma-plan --dtype bf16`) runs the
forward and the loss under `torch.autocast(device, dtype=torch.bfloat16)` with fp32 weights;
what autograd saves then is a mix (matmul inputs and the cached bf16 copies of the weights in
bf16, layer norms and residual sums in fp32), so it is measured, never derived from fp32 by
halving. Autocast does nothing for meta tensors (there is no autocast key for the meta
device), so for bf16 the blocks run on fake CPU tensors instead (`FakeTensorMode`: shapes,
dtypes and storages, no data), whose CPU autocast casts as eager CPU autocast does. The
forward runs under autocast and the backward outside it, as in training. A cached weight
copy is a storage the block's forward made and saved, so it counts in the block's act_bytes
(in training it lives from the forward to the backward too).
"""

from __future__ import annotations

import contextlib

import torch
import torch.fx
import torch.utils._pytree as pytree
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from karma.ir.trace import retarget_device

aten = torch.ops.aten
AUTOCAST_DTYPES = {"bf16": torch.bfloat16}


class Compute:
    """How blocks run while measuring (see [Note: measuring under autocast]): on meta tensors
    for fp32; on fake CPU tensors, the forward under CPU autocast, for bf16."""

    def __init__(self, dtype: str = "fp32"):
        if dtype != "fp32" and dtype not in AUTOCAST_DTYPES:
            raise ValueError(f"dtype {dtype!r}; use fp32 or one of {', '.join(AUTOCAST_DTYPES)}")
        self.dtype = dtype
        self.fake = FakeTensorMode() if dtype in AUTOCAST_DTYPES else None
        self.device = torch.device("cpu")

    def tensor(self, t):
        """A meta tensor as this computation's tensor (itself for fp32)."""
        if self.fake is None or not isinstance(t, torch.Tensor) or isinstance(t, FakeTensor):
            return t
        if t.device.type != "meta":  # a constant the trace kept (torch.tensor([...]))
            return self.fake.from_tensor(t)
        converter = self.fake.fake_tensor_converter
        return converter.from_meta_and_device(self.fake, t, self.device)

    def tree(self, value):
        """`tensor` on every tensor in a nested structure (a batch, a ModelOutput, ...)."""
        return pytree.tree_map_only(torch.Tensor, self.tensor, value)

    def module(self, gm: torch.fx.GraphModule) -> None:
        """Move gm's parameters and buffers (shared ones stay shared) and the devices its
        graphs name (`arange(..., device=meta)`) onto this computation's device, in place."""
        if self.fake is None:
            return
        moved: dict[int, torch.Tensor] = {}
        for mod in gm.modules():
            for name, p in mod._parameters.items():  # noqa: SLF001 - replaced in place
                if p is not None and id(p) not in moved:
                    moved[id(p)] = torch.nn.Parameter(self.tensor(p.detach()),
                                                      requires_grad=p.requires_grad)
                if p is not None:
                    mod._parameters[name] = moved[id(p)]  # noqa: SLF001
            for name, b in mod._buffers.items():  # noqa: SLF001
                if b is not None:
                    mod._buffers[name] = moved.setdefault(id(b), self.tensor(b))  # noqa: SLF001
            if isinstance(mod, torch.fx.GraphModule):
                retarget_device(mod, torch.device("meta"), self.device)
                _drop_metadata_asserts(mod)

    def forward(self):
        """The context a forward (or the loss) runs in."""
        if self.fake is None:
            return contextlib.nullcontext()
        stack = contextlib.ExitStack()
        stack.enter_context(self.fake)
        stack.enter_context(_NormStatsInFp32())
        stack.enter_context(torch.autocast(self.device.type, dtype=AUTOCAST_DTYPES[self.dtype]))
        return stack

    def backward(self):
        """The context a backward runs in: outside autocast, as in training."""
        return self.fake if self.fake is not None else contextlib.nullcontext()


def _drop_metadata_asserts(gm: torch.fx.GraphModule) -> None:
    """torch.export asserts the dtype it traced at every `.to(dtype)` (an fp32 input to an
    RMSNorm's `.to(torch.float32)`); under autocast the input may be bf16, as in eager."""
    asserts = [n for n in gm.graph.nodes if n.op == "call_function"
               and n.target is aten._assert_tensor_metadata.default]
    for node in asserts:
        gm.graph.erase_node(node)
    if asserts:
        gm.recompile()


_NORMS = {getattr(aten, name).default for name in (
    "native_layer_norm", "native_group_norm", "native_batch_norm", "_native_batch_norm_legit",
    "_native_batch_norm_legit_functional", "_batch_norm_with_update") if hasattr(aten, name)}


class _NormStatsInFp32(TorchDispatchMode):
    """The mean and inverse deviation a normalization saves for backward are fp32 for a bf16
    input, as the CUDA kernels (and the CPU kernels with fp32 weights, the autocast case)
    make them; the fake (meta) kernels make them bf16. Sizes only: no data to convert."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _NORMS and args[0].dtype in (torch.bfloat16, torch.float16):
            out = (out[0], *(t.float() if t.dtype == args[0].dtype else t for t in out[1:3]),
                   *out[3:])
        return out
