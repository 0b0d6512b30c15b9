"""Time each block's forward and backward on a real device (calibrated planning, karma.calibrate).

    times = time_blocks(load_model_file("examples/gpt.py"), batch_size=1)
    times.fwd_bwd_s[3]      # (forward s, backward s) of block 3
    times.selective_s[3]    # its selective recompute's seconds by policy (those that ran it)
    times.distinct          # how many blocks were actually run (same-shaped ones share)

The model is traced on the meta device and split per block as for measuring; a forward of
the split module on meta tensors (nothing computed) records every block's arguments. Blocks
with the same signature (see `_signature`) share one timing, so GPT-2's twelve layers are
timed once. Each distinct block runs on its own, on real tensors on the device: only its own
weights are materialised (random), its inputs come from the real example batch where they are
the model's inputs, and are made up, with the recorded shapes, dtypes and strides, where they
come from another block (see [Note: made-up block inputs]). The time is the median of a few
timed runs after a warm-up (see [Note: how often a block runs]), forward and backward (from
gradients of ones) separately, its selective recompute (see [Note: timing the selective
recompute]), then the model file's optimizer stepping the block's weights (see [Note: timing
the optimizer step]).

[Note: timing the selective recompute] A selective block (karma/selective_policy.py, [Note:
selective recompute]) runs its forward under torch.utils.checkpoint's selective contexts with
its policy (the policies timed are those the block graph offers the block, else
SELECTIVE_POLICY's every matmul): one dispatch mode caches what the policy keeps, the other,
in the recompute before the backward, hands that back and runs every other op again. Each
timed run does as the runtime does, with PyTorch's own contexts: a forward under the caching
context fills a fresh cache (untimed), then the same forward on fresh inputs that require grad
as the forward's did, with grad enabled (the recompute builds the autograd graph the backward
uses), is timed under the recompute context. Warm-up, repeats and median are the forward's
([Note: how often a block runs]). The time includes the dispatch modes' own Python per op,
which the runtime pays too; it leaves out what checkpoint adds around them (its saved-tensor
hooks, an early stop once the backward has all it saves, which skips trailing ops such as a
last residual add), so it errs slow. Where the recompute fails (an op changed a cached output
in place, or the recompute met other ops than the forward), the policy has no time: it cannot
run the block.

[Note: timing the optimizer step] The optimizer step is timed per block, with the model file's
own optimizer (`make_optimizer` over the block's weights, as the runtime makes one per block),
once to create its state and then up to `repeats` timed steps. An estimate from memory
bandwidth missed by 25x on the CPU: PyTorch's AdamW on CPU tensors runs its single-tensor loop,
about ten full passes over each weight, and pays per tensor (ResNet-50's 161 small tensors).
On a GPU the same weights are stepped again on the CPU, as the host optimizer would.

[Note: how often a block runs] A block runs once to warm up (first-call costs: kernel
selection, allocator growth), then up to `repeats` timed runs, fewer once the timed runs add
up to _BLOCK_BUDGET_S: the median of three short runs smooths the noise of a shared machine,
and one run of seconds has little to smooth. A warm-up of _LONG_RUN_S or more counts as a
timed run (first-call costs are lost in it), so a block that takes seconds runs once.

[Note: made-up block inputs] Running the whole model to get each block's real inputs would
cost a full forward and need every weight in memory at once (32 GB for an 8B model). A
block's time depends on its inputs' shapes, not their values, so the inputs another block
makes are uniform random numbers in [0, 1) (non-negative, so that a square root or a sampling
op sees valid values), integers are zeros (a valid index into anything) and booleans true
(attend everywhere). Data-dependent work (a mixture of experts routing every token to one
expert) may then be timed off its average; that is the price of never running the model
whole.
"""

from __future__ import annotations

import hashlib
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.utils._pytree as pytree
from torch.fx.passes.split_module import split_module
from torch.utils.checkpoint import create_selective_checkpoint_contexts

from karma.errors import IRError
from karma.ir.blocks import find_units, group_nodes
from karma.ir.compute import _drop_metadata_asserts
from karma.ir.measure import _Probe, _tensors
from karma.ir.trace import retarget_device, trace
from karma.modelfile import ModelFile
from karma.selective_policy import SELECTIVE_POLICY, checkpoint_policy

_AUTOCAST = {"bf16": torch.bfloat16}
_LONG_RUN_S = 0.5  # a run this long needs no warm-up of its own
_BLOCK_BUDGET_S = 2.0  # timed seconds per distinct block, after which it stops repeating


@dataclass(frozen=True)
class BlockTimes:
    """Measured block times at one batch size."""

    fwd_bwd_s: tuple[tuple[float, float], ...]  # (forward s, backward s) per block, in order
    # per block, its selective recompute's seconds by policy, those that can run it ([Note:
    # timing the selective recompute])
    selective_s: tuple[dict[str, float], ...]
    step_s: tuple[tuple[float, float], ...]  # (device s, host s) of the optimizer step of the
    # weights each block was timed with ([Note: timing the optimizer step])
    stepped_bytes: tuple[int, ...]  # those weights' bytes (a tied weight in each of its blocks)
    batch_size: int  # the batch they were timed at
    distinct: int  # blocks actually run; the others share a same-shaped block's times
    names: tuple[str, ...]  # block names, in order (to check against the block graph)


def time_blocks(mf: ModelFile, batch_size: int, blocks_regex: str | None = None,
                device: str = "cpu", dtype: str = "fp32", repeats: int = 3,
                log: Callable[[str], None] | None = None,
                forward_only: bool = False,
                policies: Sequence[Sequence[str]] | None = None) -> BlockTimes:
    """Time every block of the model at `batch_size` on `device`, in `dtype` (bf16: the
    forward under autocast, as training runs it). `forward_only`: only the forward and the
    selective recompute (backward and optimizer step 0). `policies`: per block, the selective
    policies to time (default: SELECTIVE_POLICY for every block)."""
    dev = torch.empty(0, device=device).device  # with its index (cuda:0), as graphs compare it
    traced = trace(mf, batch_size)
    specs = group_nodes(traced.gm, find_units(traced.model, blocks_regex))
    block_of = {node: i for i, spec in enumerate(specs) for node in spec.nodes}
    split = split_module(traced.gm, traced.gm, lambda n: block_of[n.name],
                         keep_original_order=True)
    probe = _Probe(split)
    with torch.enable_grad():  # on meta: records which inputs require grad, computes nothing
        probe.run(*traced.flat_inputs)
    with torch.device(dev), torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        real_inputs, _ = mf.checked_example_batch(batch_size)
    real_of = dict(zip(map(id, traced.flat_inputs), _flat_real(real_inputs, traced)))
    names = {id(t): n for n, t in (*split.named_parameters(), *split.named_buffers())}

    submods = [getattr(split, f"submod_{i}") for i in range(len(specs))]
    sigs = [_signature(submod, *probe.args[i]) for i, submod in enumerate(submods)]
    first_of: dict[str, int] = {}  # signature -> the first block that has it
    times: list[_Times] = []
    for i, spec in enumerate(specs):
        if sigs[i] in first_of:
            times.append(times[first_of[sigs[i]]])
            continue
        first_of[sigs[i]] = i
        alike = sigs.count(sigs[i]) - 1
        if log:
            log(f"timing block {spec.name}" + (f" (and {alike} alike)" if alike else ""))
        try:
            times.append(_time_block(submods[i], probe.args[i][0], real_of, names, dev,
                                     dtype, repeats, mf.make_optimizer, forward_only,
                                     policies[i] if policies else (SELECTIVE_POLICY,)))
        except torch.OutOfMemoryError as e:
            raise IRError(f"timing block {spec.name} ran out of memory on {dev} at batch "
                          f"{batch_size}; plan with --no-measure or a smaller --batch-size") from e
        except Exception as e:  # noqa: BLE001 - user code; name the block
            raise IRError(f"timing block {spec.name} on {dev} failed: {type(e).__name__}: "
                          f"{str(e)[:300]}") from e
    return BlockTimes(tuple((t.fwd_s, t.bwd_s) for t in times),
                      tuple(t.selective_s for t in times),
                      tuple((t.device_step_s, t.host_step_s) for t in times),
                      tuple(t.stepped_bytes for t in times), batch_size, len(first_of),
                      tuple(s.name for s in specs))


class _Times(NamedTuple):
    """One block's times (_time_block's)."""

    fwd_s: float
    bwd_s: float
    selective_s: dict[str, float]  # by policy, those that can run it
    device_step_s: float
    host_step_s: float
    stepped_bytes: int


def _flat_real(inputs, traced) -> tuple[torch.Tensor, ...]:
    """Real inputs in the order of the graph's placeholders (as Traced.flat_inputs)."""
    from karma.ir.trace import _flat_inputs

    if traced.out_spec is None:
        return inputs.args
    return _flat_inputs(inputs, traced.gm.graph._codegen.pytree_info.in_spec)  # noqa: SLF001


def _signature(submod: torch.fx.GraphModule, args: list, from_block: list[bool]) -> str:
    """What a block's time depends on: its graph with nodes numbered in order (not named:
    h.0's and h.1's differ only in names), the modules it calls, and its arguments' shapes,
    strides, dtypes, and whether they require grad or come from another block."""
    number: dict[torch.fx.Node, str] = {}
    lines = []
    for node in submod.graph.nodes:
        number[node] = f"%{len(number)}"
        target = node.target
        if node.op == "call_module":
            mod = submod.get_submodule(node.target)
            target = f"{type(mod).__qualname__}({mod.extra_repr()}) " + str(
                [(tuple(p.shape), p.dtype) for p in mod.parameters()])
        elif node.op == "get_attr":
            value = getattr(submod, node.target)
            target = _describe(value)
        elif node.op == "placeholder":
            target = ""
        operands = torch.fx.node.map_aggregate(
            (node.args, node.kwargs), lambda a: number[a] if isinstance(a, torch.fx.Node) else a)
        lines.append(f"{node.op} {target} {operands}")
    lines += [f"{_describe(a)} {fb}" for a, fb in zip(args, from_block)]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def _describe(value) -> str:
    if isinstance(value, torch.Tensor):
        return (f"tensor{tuple(value.shape)}{value.stride()}{value.dtype}"
                f"{value.requires_grad}{isinstance(value, torch.nn.Parameter)}")
    if isinstance(value, (tuple, list)):
        return f"[{', '.join(map(_describe, value))}]"
    return repr(value)


def _as_on_device(gm: torch.fx.GraphModule, dev: torch.device) -> None:
    """[Note: device branches taken on meta] A model may branch on its device while traced
    on meta; where the branch for meta (taken as for a GPU) uses an op this device lacks, the
    op is rewritten as the model writes it for this device: on the CPU, `histc` of integers
    (CUDA only) gets floats, as transformers' grouped mixture of experts does on the CPU."""
    if dev.type != "cpu":
        return
    changed = False
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.aten.histc.default:
            source = node.args[0]
            val = source.meta.get("val") if isinstance(source, torch.fx.Node) else None
            if val is not None and not val.is_floating_point():
                with gm.graph.inserting_before(node):
                    as_float = gm.graph.call_function(
                        torch.ops.aten._to_copy.default, (source,), {"dtype": torch.float32})
                node.replace_input_with(source, as_float)
                changed = True
    if changed:
        gm.recompile()


def _real_args(args: list, real_of: dict[int, torch.Tensor], names: dict[int, str],
               dev: torch.device) -> tuple[list, list[torch.Tensor]]:
    """The block's arguments on `dev`: the model's inputs as the example batch has them,
    weights random, buffers as `_fill` sets them, the rest made up (see [Note: made-up block
    inputs]); and which of them are the weights."""
    weights = []

    def real(t: torch.Tensor):
        if id(t) in real_of:
            return real_of[id(t)]
        if t.device.type != "meta":  # a constant the trace kept
            return t.to(dev)
        x = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=dev)
        weight = isinstance(t, torch.nn.Parameter)
        with torch.no_grad():
            _fill(x, names.get(id(t), ""), weight=weight)
        if weight:
            weights.append(x)
        return x.requires_grad_(t.requires_grad)

    return [pytree.tree_map_only(torch.Tensor, real, a) for a in args], weights


def _fill(x: torch.Tensor, name: str, weight: bool) -> None:
    if x.is_floating_point() or x.is_complex():
        if weight:
            x.normal_(0.0, 0.02)
        elif name.endswith("var"):  # a norm's running variance
            x.fill_(1.0)
        else:
            x.uniform_(0.0, 1.0)
    elif x.dtype == torch.bool:
        x.fill_(True)
    else:
        x.zero_()


def _time_block(submod: torch.fx.GraphModule, args: list, real_of: dict, names: dict,
                dev: torch.device, dtype: str, repeats: int, make_optimizer: Callable,
                forward_only: bool = False,
                policies: Sequence[str] = (SELECTIVE_POLICY,)) -> _Times:
    """Median forward, backward and selective recompute seconds of `submod` over up to
    `repeats` runs after a warm-up (see [Note: how often a block runs], [Note: timing the
    selective recompute]), then its optimizer step's on the device and on the host, and the
    bytes stepped ([Note: timing the optimizer step]). `forward_only`: no backward, no step."""
    retarget_device(submod, torch.device("meta"), dev)  # arange(T, device=x.device) in forward
    _as_on_device(submod, dev)
    if dtype in _AUTOCAST:
        _drop_metadata_asserts(submod)  # the fp32 the trace saw may be bf16 under autocast
    submod.to_empty(device=dev)  # weights split_module left inside the block, if any
    with torch.no_grad():
        for name, t in (*submod.named_parameters(), *submod.named_buffers()):
            _fill(t, name, weight=isinstance(t, torch.nn.Parameter))
    real, weights = _real_args(args, real_of, names, dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def fresh() -> list:
        """The arguments as fresh leaves: the gradients land on them and go with them."""
        return [a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor)
                else a for a in real]

    def forward(fresh_args: list):
        if dtype not in _AUTOCAST:
            return submod(*fresh_args)
        with torch.autocast(dev.type, dtype=_AUTOCAST[dtype]):
            return submod(*fresh_args)

    fwd, bwd = [], []
    sel: dict[str, list[float]] = {p: [] for p in policies}  # a policy that fails: dropped
    while len(fwd) < repeats + 1:
        spent_s = sum(fwd[1:]) + sum(bwd[1:]) + sum(sum(s[1:]) for s in sel.values())
        if len(fwd) >= 2 and spent_s >= _BLOCK_BUDGET_S:
            break  # enough seconds of samples (see [Note: how often a block runs])
        args = fresh()
        sync()
        t0 = time.perf_counter()
        out = forward(args)
        outs = [o for o in _tensors(out) if o.requires_grad]
        sync()
        t1 = time.perf_counter()
        if outs and not forward_only:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        sync()
        t2 = time.perf_counter()
        del out, outs, args
        sel_s = {}
        for policy in list(sel):
            try:
                sel_s[policy] = _selective_recompute_s(forward, fresh, sync, policy)
            except torch.OutOfMemoryError:
                raise
            except Exception:  # noqa: BLE001 - the forward ran: the policy cannot run it
                del sel[policy]  # (a cached output changed in place, another op met)
        # fwd[0], bwd[0], sel[..][0]: the warm-up; a long one is a timed run too
        copies = 2 if not fwd and t2 - t0 + sum(sel_s.values()) >= _LONG_RUN_S else 1
        fwd += [t1 - t0] * copies
        bwd += [t2 - t1] * copies
        for policy in sel:
            sel[policy] += [sel_s[policy]] * copies
    selective_s = {policy: statistics.median(s[1:]) for policy, s in sel.items()}
    if forward_only:
        return _Times(statistics.median(fwd[1:]), 0.0, selective_s, 0.0, 0.0, 0)
    params = [torch.nn.Parameter(w.detach()) for w in weights if w.requires_grad]
    params += [p for p in submod.parameters() if p.requires_grad]
    device_step_s = _time_step(params, make_optimizer, sync, repeats)
    if dev.type == "cpu":
        host_step_s = device_step_s
    else:
        on_host = [torch.nn.Parameter(p.detach().cpu()) for p in params]
        for p, h in zip(params, on_host):
            h.grad = None if p.grad is None else p.grad.cpu()
        host_step_s = _time_step(on_host, make_optimizer, lambda: None, repeats)
    stepped = sum(p.numel() * p.element_size() for p in params)
    return _Times(statistics.median(fwd[1:]), statistics.median(bwd[1:]), selective_s,
                  device_step_s, host_step_s, stepped)


def _selective_recompute_s(forward: Callable, fresh: Callable[[], list],
                           sync: Callable[[], None], policy: str) -> float:
    """Seconds of one selective recompute of `forward` under `policy`, as the runtime runs
    it ([Note: timing the selective recompute]); an error where the policy cannot run it."""
    cache, recompute = create_selective_checkpoint_contexts(checkpoint_policy(policy))
    with torch.enable_grad(), cache:
        forward(fresh())  # fills the cache; what it returns goes at once
    args = fresh()
    sync()
    t0 = time.perf_counter()
    with torch.enable_grad(), recompute:
        out = forward(args)
    sync()
    seconds = time.perf_counter() - t0
    del out
    return seconds


def _time_step(params: list[torch.nn.Parameter], make_optimizer: Callable,
               sync: Callable[[], None], repeats: int) -> float:
    """Median seconds of the model file's optimizer stepping `params`, after a first step
    that makes its state ([Note: timing the optimizer step])."""
    if not params:
        return 0.0
    for p in params:
        if p.grad is None:  # a gradient's values do not change the step's time
            p.grad = torch.full_like(p, 1e-3)
    optimizer = make_optimizer(params)
    optimizer.step()
    seconds = []
    for _ in range(max(repeats, 1)):
        sync()
        t0 = time.perf_counter()
        optimizer.step()
        sync()
        seconds.append(time.perf_counter() - t0)
        if sum(seconds) >= _BLOCK_BUDGET_S:
            break
    return statistics.median(seconds)
