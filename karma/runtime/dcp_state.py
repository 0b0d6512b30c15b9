"""A checkpoint's optimizer state, each rank writing its own part, with torch.distributed.checkpoint.

[Note: the optimizer state through DCP] The optimizer state is the largest part of a
checkpoint (AdamW: twice the weights) and, with sharded host state, no rank holds all of it.
So each rank hands torch.distributed.checkpoint (DCP) what it holds, under one key per
parameter and state entry ("h.0.attn.c_attn.weight.exp_avg"):
- a sharded block's per-element entries as DTensors, Shard(0) over the ranks: a rank's rows
  are DTensor's own cut of dim 0 (shard.py cuts as torch.chunk does), so DCP writes each
  rank's rows from that rank, in parallel, and records the whole shape;
- everything else (replicated state, a device optimizer's, AdamW's `step`) as plain tensors,
  the same on every rank, which DCP writes once.
Loading builds the targets from the checkpoint's metadata, cut as this run's ranks hold
them, and DCP's load planner reads into each the parts of the saved shards it overlaps: a
checkpoint of N ranks loads into M, sharded or not. A 0-dim parameter's entries are kept
whole on every rank (DTensor cannot cut them).

The tensors handed to DCP own their storage (checkpoint._standalone: file-backed copies of
the host tier's views), so that DCP does not clone them into private memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from karma.runtime.distributed import Ranks
from karma.runtime.shard import ShardedWeights, rows_of
from karma.runtime.weights import BlockWeights

OPTIMIZER_DIR = "optimizer"  # the DCP checkpoint's directory inside step_N


def save(engine, ranks: Ranks, directory: Path,
         standalone: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Write this rank's part of every optimizer's state into `directory` (every rank calls
    it, after engine.settle())."""
    mesh = _mesh(ranks)
    state: dict[str, torch.Tensor] = {}
    for name, w, k in _entries(engine):
        p = w.params[k]
        shaped = _per_element(w)
        for key, v in w.optimizer.state.get(_holder(w, k), {}).items():
            if not isinstance(v, torch.Tensor):
                continue
            if isinstance(w, ShardedWeights) and shaped(key, v, w.masters[k].shape):
                v = _whole_scalar(v, ranks) if p.dim() == 0 else DTensor.from_local(
                    standalone(v), mesh, [Shard(0)], run_check=False, shape=p.shape,
                    stride=_contiguous(p.shape))
            else:
                v = standalone(v)
            state[f"{name}.{key}"] = v
    dcp.save(state, storage_writer=FileSystemWriter(directory), no_dist=ranks.world_size == 1)


def load(engine, ranks: Ranks, directory: Path) -> None:
    """Load every optimizer's state from `directory`, written by any number of ranks, into
    what this rank holds; the optimizers' states are replaced."""
    reader = FileSystemReader(directory)
    saved = reader.read_metadata().state_dict_metadata
    mesh = _mesh(ranks)
    targets: dict[str, torch.Tensor] = {}
    loaded: list[tuple[object, int, str, torch.Tensor]] = []
    by_param: dict[str, list[str]] = {}
    for fqn in saved:
        name, key = fqn.rsplit(".", 1)
        by_param.setdefault(name, []).append(key)
    for name, w, k in _entries(engine):
        p = w.params[k]
        shaped = _per_element(w)
        for key in by_param.get(name, ()):
            md = saved[f"{name}.{key}"]
            size, dtype = tuple(md.size), md.properties.dtype
            if isinstance(w, ShardedWeights) and p.dim() > 0 and size == tuple(p.shape):
                c = w.cuts[k]
                local = torch.zeros((c.stop - c.start, *size[1:]), dtype=dtype)
                targets[f"{name}.{key}"] = DTensor.from_local(
                    local, mesh, [Shard(0)], run_check=False, shape=torch.Size(size),
                    stride=_contiguous(size))
            else:
                local = torch.zeros(size, dtype=dtype)
                targets[f"{name}.{key}"] = local
                if isinstance(w, ShardedWeights) and p.dim() == 0 \
                        and shaped(key, local, w.masters[k].shape):
                    local = rows_of(local, w.cuts[k])  # this rank's row of a 0-dim one
            loaded.append((w, k, key, local))
    dcp.load(targets, storage_reader=reader, no_dist=ranks.world_size == 1)
    # each optimizer loads its part as a state_dict: load_state_dict puts every entry where
    # its parameter's optimizer keeps it (the device's, or AdamW's step on the CPU)
    states: dict[int, dict[int, dict]] = {}
    for w, k, key, value in loaded:
        index = _index(w.optimizer)[id(_holder(w, k))]
        states.setdefault(id(w), {}).setdefault(index, {})[key] = value.clone() \
            if value.untyped_storage().nbytes() != value.nbytes else value
    for w in engine.weights:
        if w.optimizer is not None:
            sd = w.optimizer.state_dict()
            BlockWeights.load_optimizer_state(w, {"state": states.get(id(w), {}),
                                                  "param_groups": sd["param_groups"]})


def consolidated(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The whole optimizer state of a checkpoint, {parameter name: {entry: tensor}}, read in
    this process with DCP's own loader (karma-export --optimizer)."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    flat = _load_state_dict_from_keys(checkpoint_id=str(directory))
    out: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, value in flat.items():
        name, key = fqn.rsplit(".", 1)
        out.setdefault(name, {})[key] = value
    return out


def _index(optimizer: torch.optim.Optimizer) -> dict[int, int]:
    """id(parameter) -> its index in the optimizer's state_dict (param_groups' order)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    return {id(p): i for i, p in enumerate(params)}


def _entries(engine) -> Iterator[tuple[str, object, int]]:
    """(parameter name, its block's weights, its index there) of every optimized parameter."""
    for w in engine.weights:
        if w.optimizer is not None:
            for k, name in enumerate(w.names):
                yield name, w, k


def _holder(w, k: int) -> torch.Tensor:
    """The tensor the block's optimizer keys parameter k's state by."""
    return w.masters[k] if w.optim == "host" else w.params[k]


def _per_element(w) -> Callable[[str, object, torch.Size], bool]:
    return w.shaped_keys() if isinstance(w, ShardedWeights) else (
        lambda key, v, shape: False)


def _mesh(ranks: Ranks) -> DeviceMesh | None:
    """A CPU mesh over every rank (the default group is gloo), or None on one rank."""
    return init_device_mesh("cpu", (ranks.world_size,)) if ranks.world_size > 1 else None


def _whole_scalar(v: torch.Tensor, ranks: Ranks) -> torch.Tensor:
    """A 0-dim parameter's entry, whole on every rank: rank 0 holds its one row."""
    out = torch.zeros((), dtype=v.dtype)
    if ranks.main:
        out.copy_(v.reshape(()))
    dist.broadcast(out, src=0)
    return out


def _contiguous(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(tuple(shape)):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
