"""Measure each block on the meta device: saved bytes, output bytes, FLOPs, and edges.

The traced graph is split into one sub-module per block (`torch.fx.passes.split_module`).
A forward of the whole split module on meta tensors, with autograd, records what flows
between blocks and takes the census of saved storages: a saved-tensors hook notes, for every
storage autograd saves (parameters and buffers excluded), the blocks whose forward saved it,
and a dispatch mode the block whose forward made it (see [Note: each saved storage counted
once] in karma/ir/graph.py). Then each block runs again on its own, with autograd, on fresh
meta inputs (requiring grad where they did in the whole model): `FlopCounterMode` counts
forward and backward FLOPs, and the live storages give its temporaries.

[Note: fused attention on the meta device] On meta tensors `scaled_dot_product_attention`
takes its math path, which saves the T x T attention matrix; the fused kernels that CPUs and
GPUs run save only the output and a log-sum-exp. Measuring the math path would overstate a
transformer layer's activations several times, so SDPA calls are rerouted to the fused CPU
kernel's meta implementation while measuring (whose saved tensors match the GPU's flash
kernel up to a few bytes of RNG state). Two details follow what SDPA does in eager, on any
device: a boolean mask becomes a new additive float mask at every call (and that is what is
saved), and grouped-query attention (`enable_gqa=True`) goes to the fused kernel with the
key and value unexpanded (saved: query, key, value as given, output, log-sum-exp).

bf16 runs on fake CPU tensors under autocast: see [Note: measuring under autocast] in
karma/ir/compute.py.
"""

from __future__ import annotations

import operator
import weakref
from collections import defaultdict
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor
from torch.fx.passes.split_module import split_module
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import (
    FlopCounterMode,
    register_flop_formula,
    sdpa_backward_flop_count,
    sdpa_flop_count,
)
from torch.utils.weak import WeakIdKeyDictionary

from karma.ir.blocks import BlockSpec
from karma.ir.compute import Compute
from karma.ir.graph import Selective, SharedSaved
from karma.selective_policy import (
    SELECTIVE_POLICY,
    UNBOUNDED,
    flops_per_element,
    parse_policy,
    policy_name,
)

aten = torch.ops.aten


@dataclass(frozen=True)
class BlockFigures:
    act_bytes: int  # saved storages that only this block saves and a block made
    out_bytes: int
    fwd_flops: int
    bwd_flops: int
    fwd_temp_bytes: int  # peak of the forward's temporaries beyond what it saves and returns
    bwd_temp_bytes: int  # peak of the backward's beyond saved, outputs and weight gradients
    selective: tuple[Selective, ...] = ()  # the policies that can run it (_PolicyOps)


@dataclass(frozen=True)
class Measured:
    blocks: tuple[BlockFigures, ...]
    edges: dict[tuple[int, int], int]  # (src, dst) -> bytes
    flat_output: tuple  # the graph's outputs on meta tensors, flat (Traced.output rebuilds)
    shared_saved: tuple[SharedSaved, ...] = ()


def measure_blocks(gm: torch.fx.GraphModule, specs: list[BlockSpec],
                   inputs: tuple[torch.Tensor, ...], compute: Compute | None = None) -> Measured:
    """Measure the blocks of gm (on meta tensors) as `compute` runs them (default: fp32 on
    the meta device). With autocast, gm's parameters become fake CPU tensors."""
    compute = compute or Compute()
    reroute_sdpa(gm)
    _count_grouped_mm()
    block_of = {node: i for i, spec in enumerate(specs) for node in spec.nodes}
    split = split_module(gm, gm, lambda n: block_of[n.name], keep_original_order=True)
    compute.module(split)
    inputs = compute.tree(tuple(inputs))

    skip = {s.untyped_storage()._cdata for s in (*split.parameters(), *split.buffers())}
    census = _Census(split, skip)
    with compute.forward():
        flat_out = census.run_with_autograd(*inputs)
    private, shared = census.attribute(len(specs))

    figures = []
    for i in range(len(specs)):
        args, from_block = census.args[i]
        fig = _measure_one(getattr(split, f"submod_{i}"), args, from_block, skip, compute)
        figures.append(replace(fig, act_bytes=private[i]))
    flat = tuple(flat_out) if isinstance(flat_out, (tuple, list)) else (flat_out,)
    return Measured(tuple(figures), census.edges, flat, shared)


def saved_bytes(fn, *args, skip: set[int] = frozenset()) -> tuple[object, int]:
    """Run fn(*args) with autograd; return its result and the bytes autograd saved for it."""
    result, nbytes, _ = saved_storages(fn, *args, skip=skip)
    return result, nbytes


def saved_storages(fn, *args, skip: set[int] = frozenset()
                   ) -> tuple[object, int, dict[int, int]]:
    """saved_bytes's result and bytes, and the saved storages' bytes by their _cdata."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in skip:
            seen[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        result = fn(*args)
    return result, sum(seen.values()), seen


def _measure_one(submod: torch.nn.Module, args: list, from_block: list[bool],
                 skip: set[int], compute: Compute) -> BlockFigures:
    """The block's figures on its own; act_bytes here counts every storage it saves."""
    # an input requires grad where it did in the whole model: a rotary table or a mask made
    # from buffers does not, and made to, it would make its readers save more
    fresh = [
        a.detach().requires_grad_(a.requires_grad) if fb and isinstance(a, torch.Tensor) else a
        for a, fb in zip(args, from_block)
    ]
    live = LiveBytes(known=[*fresh, *submod.parameters(), *submod.buffers()])
    by_op = _PolicyOps(SELECTIVE_POLICY)
    with compute.forward(), FlopCounterMode(display=False) as fwd_counter, live, by_op:
        out, act_bytes, saved = saved_storages(submod, *fresh, skip=skip)
    selective = by_op.figures(saved)
    fwd_peak, live.peak = live.peak, live.now
    outs = [o for o in _tensors(out)]
    out_bytes = sum({o.untyped_storage()._cdata: o.untyped_storage().nbytes() for o in outs}.values())
    grads_for = [o for o in outs if o.requires_grad]
    # split_module passes the weights in as arguments (get_attr in the parent module)
    params = [p for p in (*submod.parameters(), *args)
              if isinstance(p, torch.nn.Parameter) and p.requires_grad]
    with compute.backward(), FlopCounterMode(display=False) as bwd_counter, live:
        if grads_for:
            torch.autograd.backward(grads_for, [torch.ones_like(o) for o in grads_for])
    param_grad_bytes = sum(p.grad.untyped_storage().nbytes() for p in params if p.grad is not None)
    for p in params:
        p.grad = None
    return BlockFigures(
        act_bytes, out_bytes, fwd_counter.get_total_flops(), bwd_counter.get_total_flops(),
        fwd_temp_bytes=max(0, fwd_peak - act_bytes - out_bytes),
        bwd_temp_bytes=max(0, live.peak - act_bytes - out_bytes - param_grad_bytes),
        selective=selective,
    )


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages created under the mode and still alive, and their peak.

    [Note: counting temporaries on meta tensors] Each new storage is counted when an op
    creates it and uncounted when it is freed (a weak reference to the storage object, as
    torch.distributed._tools.MemTracker does), so the peak includes the temporaries that a
    block's forward or backward makes and drops, which nothing else in the IR sees.
    """

    def __init__(self, known=()):
        super().__init__()
        self.now = 0
        self.peak = 0
        self._seen = WeakIdKeyDictionary()
        for t in known:
            if isinstance(t, torch.Tensor):
                self._seen[t.untyped_storage()] = None  # existed before: not counted

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for storage in _storages(out):
            if storage not in self._seen:
                nbytes = storage.nbytes()
                self._seen[storage] = weakref.ref(storage, partial(self._freed, nbytes))
                self.now += nbytes
                self.peak = max(self.peak, self.now)
        return out

    def _freed(self, nbytes: int, _ref) -> None:
        self.now -= nbytes


class _PolicyOps(TorchDispatchMode):
    """A block's forward, op by op, as selective policies split it: what the ops a policy
    keeps return, what the others read and write (recomputed).

    [Note: a block's saved bytes, op by op] Selective recompute keeps what the ops its
    policy keeps return (the checkpoint's cache holds each output, whether autograd saves it
    or not) and runs every other op again before the backward, which then makes again the
    saved tensors that those ops made. So per policy: the bytes its kept ops return, each
    storage once (kept from the forward to the backward, beside the block's inputs); of the
    storages autograd saves, those its kept ops made (the rest is what the recompute makes
    again); what the other ops read and write against what every op does (the recompute's
    share of the forward's memory traffic for the roofline; views move no bytes), and the
    FLOPs of the matmuls and convolutions it recomputes. The policies: the ops
    SELECTIVE_POLICY names, all of them, or only those of the most FLOPs an element
    (karma/selective_policy.py, [Note: FLOPs an element]), dropping the cheapest kind first,
    up to MAX_THRESHOLDS times. A policy that keeps an output the block changes in place (an
    in-place activation on a matmul's result) cannot run it: the checkpoint refuses a cached
    tensor changed after it was cached.
    """

    MAX_THRESHOLDS = 2  # policies beyond keeping every op the name lists

    def __init__(self, name: str):
        super().__init__()
        self.name = name
        self.names, _ = parse_policy(name)
        # the kept storages while they live (weakly: holding them would hold what the block
        # frees), each with its op's FLOPs an element
        self.kept = WeakIdKeyDictionary()
        self.kept_bytes: dict[float, int] = defaultdict(int)  # by FLOPs an element, made
        self.changed: set[float] = set()  # FLOPs an element of kept storages written in place
        self.traffic_bytes = 0  # every op's
        self.other_traffic_bytes = 0  # of the ops the policy's name does not list
        self.kept_traffic_bytes: dict[float, int] = defaultdict(int)  # of those it lists
        self.kept_flops: dict[float, int] = defaultdict(int)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for v in _written(func, args, kwargs):
            if isinstance(v, torch.Tensor) and v.untyped_storage() in self.kept:
                self.changed.add(self.kept[v.untyped_storage()])
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        listed = name in self.names
        per_element = flops_per_element(name, args) if listed else 0.0
        if listed:
            for storage in _storages(out):
                if storage not in self.kept:
                    self.kept[storage] = per_element
                    self.kept_bytes[per_element] += storage.nbytes()
            if per_element != UNBOUNDED:
                self.kept_flops[per_element] += int(
                    per_element * sum(t.numel() for t in _tensors(out)))
        if not func.is_view:
            nbytes = sum(t.numel() * t.element_size() for t in (*_tensors(args), *_tensors(out)))
            self.traffic_bytes += nbytes
            if listed:
                self.kept_traffic_bytes[per_element] += nbytes
            else:
                self.other_traffic_bytes += nbytes
        return out

    def figures(self, saved: dict[int, int]) -> tuple[Selective, ...]:
        """The block under each policy that can run it, given the storages it saved
        (saved_storages's: alive, so their _cdata are theirs)."""
        saved_by: dict[float, int] = defaultdict(int)
        for storage, per_element in self.kept.items():
            saved_by[per_element] += saved.get(storage._cdata, 0)
        finite = sorted(k for k in self.kept_bytes if k != UNBOUNDED)
        out = []
        for least in [0, *finite[1:1 + self.MAX_THRESHOLDS]]:
            kept = [k for k in self.kept_bytes if k >= least]
            if any(k in kept for k in self.changed) or not kept:
                continue  # cannot run it; or it keeps nothing: a whole recompute
            dropped = [k for k in self.kept_bytes if k < least]
            out.append(Selective(
                policy=policy_name(self.name, int(least)),
                kept_bytes=sum(self.kept_bytes[k] for k in kept),
                kept_saved_bytes=sum(saved_by[k] for k in kept),
                recompute_traffic_bytes=self.other_traffic_bytes + sum(
                    self.kept_traffic_bytes[k] for k in dropped),
                forward_traffic_bytes=self.traffic_bytes,
                recompute_flops=sum(self.kept_flops[k] for k in dropped)))
        return tuple(out)


def _written(func, args, kwargs) -> list:
    """The arguments an op writes in place (its schema's mutable ones, out= included)."""
    schema = func._schema
    written = [a for a, spec in zip(args, schema.arguments)
               if spec.alias_info is not None and spec.alias_info.is_write]
    return written + [kwargs[spec.name] for spec in schema.arguments
                      if spec.name in kwargs and spec.alias_info is not None
                      and spec.alias_info.is_write]


class _Probe(torch.fx.Interpreter):
    """Runs the split module once, recording each block's arguments and the edges."""

    def __init__(self, split: torch.fx.GraphModule):
        super().__init__(split)
        self.args: dict[int, tuple[list, list[bool]]] = {}
        self.edges: dict[tuple[int, int], int] = {}
        self._block_of_node: dict[torch.fx.Node, int] = {}

    def run_node(self, n: torch.fx.Node):
        result = super().run_node(n)
        if n.op == "call_module" and n.target.startswith("submod_"):
            dst = int(n.target.removeprefix("submod_"))
            self._block_of_node[n] = dst
            values, from_block = [], []
            per_src: dict[int, dict[int, int]] = {}
            for arg in n.args:
                value = self.env[arg] if isinstance(arg, torch.fx.Node) else arg
                src = self._source_block(arg)
                values.append(value)
                from_block.append(src is not None)
                if src is not None:
                    for t in _tensors(value):
                        s = t.untyped_storage()
                        per_src.setdefault(src, {})[s._cdata] = s.nbytes()
            self.args[dst] = (values, from_block)
            for src, storages in per_src.items():
                self.edges[(src, dst)] = sum(storages.values())
        elif n.op == "call_function" and n.target is operator.getitem:
            src = self._source_block(n.args[0])
            if src is not None:
                self._block_of_node[n] = src
        return result

    def _source_block(self, arg) -> int | None:
        return self._block_of_node.get(arg) if isinstance(arg, torch.fx.Node) else None


class _Census(_Probe):
    """Runs the split module once with autograd: the probe's records, and for every saved
    storage which block made it and which blocks saved it."""

    def __init__(self, split: torch.fx.GraphModule, skip: set[int]):
        super().__init__(split)
        self._skip = skip  # _cdata of parameter and buffer storages
        self._made = _MadeBy()
        self._saved: dict[int, tuple[torch.Tensor, int, set[int]]] = {}  # _cdata -> (t, maker, savers)

    def run_with_autograd(self, *inputs):
        for t in _tensors(inputs):  # a view of an input is not a storage the view made
            self._made.made_by[t.untyped_storage()] = -1
        with torch.enable_grad(), self._made, \
                torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            return self.run(*inputs)

    def run_node(self, n: torch.fx.Node):
        is_block = n.op == "call_module" and n.target.startswith("submod_")
        self._made.block = int(n.target.removeprefix("submod_")) if is_block else -1
        try:
            return super().run_node(n)
        finally:
            self._made.block = -1

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in self._skip:
            # the tensor is kept so that its storage (and _cdata) stays unique until the end
            entry = self._saved.setdefault(
                storage._cdata, (t, self._made.made_by.get(storage, -1), set()))
            entry[2].add(self._made.block)
        return t

    def attribute(self, n_blocks: int) -> tuple[list[int], tuple[SharedSaved, ...]]:
        """Per block, the bytes only it saves and a block made; the rest as SharedSaved."""
        private = [0] * n_blocks
        groups: dict[tuple[int, tuple[int, ...]], int] = {}
        for t, maker, savers in self._saved.values():
            nbytes = t.untyped_storage().nbytes()
            if len(savers) == 1 and maker >= 0:
                private[next(iter(savers))] += nbytes
            else:
                key = (maker, tuple(sorted(savers)))
                groups[key] = groups.get(key, 0) + nbytes
        self._saved.clear()
        shared = tuple(SharedSaved(maker, readers, nbytes)
                       for (maker, readers), nbytes in sorted(groups.items()))
        return private, shared


class _MadeBy(TorchDispatchMode):
    """Which block's forward made each storage (the first op that returned it)."""

    def __init__(self):
        super().__init__()
        self.block = -1  # the block running now; -1 between blocks
        self.made_by = WeakIdKeyDictionary()  # untyped storage -> block

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for storage in _storages(out):
            if storage not in self.made_by:
                self.made_by[storage] = self.block
        return out


def _storages(value) -> list[torch.UntypedStorage]:
    """The storages of the tensors in an op's output."""
    return [t.untyped_storage() for t in _tensors(value)]


def _tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


# --- fused attention while measuring (see [Note: fused attention on the meta device]) ---

def _fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                scale=None, enable_gqa=False):
    measuring = query.device.type == "meta" or isinstance(query, FakeTensor)
    if not measuring or dropout_p > 0.0:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
            scale=scale, enable_gqa=enable_gqa)
    if isinstance(query, FakeTensor) and torch.is_autocast_enabled(query.device.type):
        # SDPA is on autocast's lower-precision list: eager casts its floating inputs (a
        # float mask too) before any kernel; the kernel called here is not on the list
        low = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(low) if t.is_floating_point() else t
                             for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point():
            attn_mask = attn_mask.to(low)
    # The fused kernels take grouped-query attention (fewer key/value heads) as it is and
    # save the key and value unexpanded; the CPU flash kernel's meta function does the same.
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # What scaled_dot_product_attention does before any kernel (ATen's
        # convert_boolean_attn_mask): a fresh additive mask in the query's dtype, per call,
        # which the kernel saves; the boolean mask itself is not saved.
        attn_mask = torch.where(attn_mask.logical_not(), float("-inf"),
                                torch.scalar_tensor(0.0, dtype=query.dtype,
                                                    device=attn_mask.device))
    return aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


def reroute_sdpa(gm: torch.fx.GraphModule) -> None:
    targets = {aten.scaled_dot_product_attention.default, F.scaled_dot_product_attention}
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in targets:
            node.target = _fused_sdpa
            changed = True
    if changed:
        gm.recompile()


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu, get_raw=True)
def _sdpa_cpu_flop(query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_flop_count(query.shape, key.shape, value.shape)


@register_flop_formula(aten._scaled_dot_product_flash_attention_for_cpu_backward, get_raw=True)
def _sdpa_cpu_backward_flop(grad_out, query, key, value, *args, out_val=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out.shape, query.shape, key.shape, value.shape)


# --- grouped matmuls (mixture-of-experts layers) -----------------------------------------

def _count_grouped_mm() -> None:
    """FLOP formulas for the grouped matmuls of mixture-of-experts layers, which
    FlopCounterMode does not know: `aten._grouped_mm` and the custom op Hugging Face exports
    its experts as (`transformers::grouped_mm_fallback` and its backward). An input [S, K]
    sorted by expert against weights [E, K, N] costs 2*S*K*N whichever expert each row
    goes to; the backward twice that. Registered once, when the op exists."""
    from torch.utils.flop_counter import flop_registry

    ops = [getattr(aten, "_grouped_mm", None)]
    hf = getattr(torch.ops, "transformers", None)
    if hf is not None and hasattr(hf, "grouped_mm_fallback"):
        ops.append(hf.grouped_mm_fallback)
    for op in ops:
        if op is not None and op not in flop_registry:
            register_flop_formula(op, get_raw=True)(_grouped_mm_flop)
    if hf is not None and hasattr(hf, "grouped_mm_fallback_backward") \
            and hf.grouped_mm_fallback_backward not in flop_registry:
        register_flop_formula(hf.grouped_mm_fallback_backward, get_raw=True)(
            _grouped_mm_backward_flop)


def _grouped_mm_flop(input, weight, *args, out_val=None, **kwargs) -> int:
    if input.dim() != 2 or weight.dim() != 3:  # other layouts of aten._grouped_mm
        return 0
    return 2 * input.shape[0] * input.shape[1] * weight.shape[2]


def _grouped_mm_backward_flop(input, weight, *args, out_val=None, **kwargs) -> int:
    return 2 * _grouped_mm_flop(input, weight)
