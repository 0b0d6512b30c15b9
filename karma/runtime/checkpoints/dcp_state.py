"""A checkpoint's tensors, each rank writing its own part, with torch.distributed.checkpoint.

[Note: the state through DCP] With sharded host state no rank holds all of the optimizer
state (AdamW: twice the weights), and the weights are better written by every rank than by
one. So each rank hands torch.distributed.checkpoint (DCP) what it holds, under one key per
weight ("model.h.0.attn.c_attn.weight"; a tied weight once, under its first name), buffer
("model." too; rank 0's: BatchNorm statistics stay per rank) and optimizer state entry
("optim.h.0.attn.c_attn.weight.exp_avg"):
- a sharded block's weights and per-element entries as DTensors, Shard(0) over the ranks: a
  rank's rows are DTensor's own cut of dim 0 (distributed/cut.py cuts as torch.chunk does), so DCP
  writes each rank's rows from that rank, in parallel, and records the whole shape;
- everything else (replicated state, a device optimizer's, AdamW's `step`) as plain tensors,
  the same on every rank, which DCP writes once, spread over the ranks.
Loading builds the targets from the checkpoint's metadata, cut as this run's ranks hold
them, and DCP's load planner reads into each the parts of the saved shards it overlaps: a
checkpoint of N ranks loads into M, sharded or not; a sharded block's weights are then
all-gathered whole. A 0-dim parameter's entries are kept whole on every rank (DTensor cannot
cut them).

The tensors handed to DCP own their storage (checkpoint._standalone: file-backed copies of
the host tier's views), so that DCP does not clone them into private memory.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from karma.runtime.distributed.cut import rows_of
from karma.runtime.distributed.process_group import Ranks
from karma.runtime.host.tier import _contiguous_strides
from karma.runtime.params.layout import ShardedLayout

STATE_DIR = "state"  # the DCP checkpoint's directory inside step_N
MODEL, OPTIM = "model.", "optim."


@contextlib.contextmanager
def _one_process():
    """DCP without a process group (one rank: what karma asks for with no_dist) warns on
    every call that it assumes one process; that is the intent, so it is not shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"torch\.distributed is (disabled|unavailable)",
                                UserWarning)
        yield


def state_keys(model: torch.nn.Module) -> list[tuple[str, str]]:
    """(key of model.state_dict(), the key it is saved under, less MODEL): a tied weight's
    every name maps to its first."""
    canonical = {id(p): n for n, p in model.named_parameters()}
    return [(name, canonical.get(id(value), name))
            for name, value in model.state_dict(keep_vars=True).items()]


def save(model: torch.nn.Module, engine, ranks: Ranks, directory: Path,
         standalone: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Write this rank's part of the weights, buffers and optimizer state into `directory`
    (every rank calls it, after engine.settle())."""
    mesh = _mesh(ranks)
    state = _model_tensors(model, engine, ranks, mesh, standalone)
    for name, w, k in _entries(engine):
        p = w.params[k]
        shaped = _per_element(w)
        for key, v in w.optimizer.state.get(_holder(w, k), {}).items():
            if not isinstance(v, torch.Tensor):
                continue
            if _sharded(w) and shaped(key, v, w.layout.masters[k].shape):
                v = _whole_scalar(v, ranks) if p.dim() == 0 else DTensor.from_local(
                    standalone(v), mesh, [Shard(0)], run_check=False, shape=p.shape,
                    stride=_contiguous_strides(p.shape))
            else:
                v = standalone(v)
            state[f"{OPTIM}{name}.{key}"] = v
    with _one_process():
        dcp.save(state, storage_writer=FileSystemWriter(directory),
                 no_dist=ranks.world_size == 1)


def _model_tensors(model: torch.nn.Module, engine, ranks: Ranks, mesh: DeviceMesh | None,
                   standalone: Callable[[torch.Tensor], torch.Tensor] | None) -> dict:
    """The weights and buffers as DCP takes them: to save (`standalone` copies what is a
    view of a larger storage) or, without it, as the targets to load into."""
    owner = {n: (w, k) for w in engine.weights for k, n in enumerate(w.names)}
    keep = standalone or (lambda t: t)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        w, k = owner[name]
        if _sharded(w) and p.dim() > 0:  # its rows of the whole weights
            out[MODEL + name] = DTensor.from_local(
                keep(w.layout.masters[k].detach()), mesh, [Shard(0)], run_check=False,
                shape=p.shape, stride=_contiguous_strides(p.shape))
        else:
            out[MODEL + name] = keep(w.current()[name])
    if standalone is None or ranks.main:
        for name, b in model.named_buffers():
            out[MODEL + name] = keep(b.detach())
    return out


def load(model: torch.nn.Module, engine, ranks: Ranks, directory: Path) -> None:
    """Load the weights, buffers and every optimizer's state from `directory`, written by
    any number of ranks, into what this rank holds; the optimizers' states are replaced."""
    reader = FileSystemReader(directory)
    saved = reader.read_metadata().state_dict_metadata
    mesh = _mesh(ranks)
    targets = _model_tensors(model, engine, ranks, mesh, None)
    missing = sorted(k for k in targets if k not in saved)
    if missing:
        raise KeyError(f"it lacks {len(missing)} of the model's entries (e.g. "
                       f"{missing[0][len(MODEL):]})")
    loaded: list[tuple[object, int, str, torch.Tensor]] = []
    by_param: dict[str, list[str]] = {}
    for fqn in saved:
        if fqn.startswith(OPTIM):
            name, key = fqn[len(OPTIM):].rsplit(".", 1)
            by_param.setdefault(name, []).append(key)
    for name, w, k in _entries(engine):
        p = w.params[k]
        shaped = _per_element(w)
        for key in by_param.get(name, ()):
            md = saved[f"{OPTIM}{name}.{key}"]
            size, dtype = tuple(md.size), md.properties.dtype
            if _sharded(w) and p.dim() > 0 and size == tuple(p.shape):
                c = w.layout.cuts[k]
                local = torch.zeros((c.stop - c.start, *size[1:]), dtype=dtype)
                targets[f"{OPTIM}{name}.{key}"] = DTensor.from_local(
                    local, mesh, [Shard(0)], run_check=False, shape=torch.Size(size),
                    stride=_contiguous_strides(size))
            else:
                local = torch.zeros(size, dtype=dtype)
                targets[f"{OPTIM}{name}.{key}"] = local
                if _sharded(w) and p.dim() == 0 \
                        and shaped(key, local, w.layout.masters[k].shape):
                    local = rows_of(local, w.layout.cuts[k])  # this rank's row of a 0-dim one
            loaded.append((w, k, key, local))
    with torch.no_grad():
        with _one_process():
            dcp.load(targets, storage_reader=reader, no_dist=ranks.world_size == 1)
    for w in engine.weights:  # the weights: every rank's rows gathered, then on the device
        if _sharded(w):
            w.layout.all_gather()
        w.load(w.current())
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
            w.load_own_optimizer_state({"state": states.get(id(w), {}),
                                        "param_groups": sd["param_groups"]})


def consolidated_model(directory: Path,
                       keys: list[tuple[str, str]]) -> dict[str, torch.Tensor]:
    """The model's whole state_dict from a checkpoint, in `keys`' order (state_keys: a tied
    weight under each name), read in this process with DCP's own loader (karma-export)."""
    flat = _read(directory, {MODEL + saved for _, saved in keys})
    return {name: flat[MODEL + saved] for name, saved in keys}


def consolidated_optimizer(directory: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The whole optimizer state of a checkpoint, {parameter name: {entry: tensor}}, read in
    this process with DCP's own loader (karma-export --optimizer)."""
    reader = FileSystemReader(directory)
    keys = {k for k in reader.read_metadata().state_dict_metadata if k.startswith(OPTIM)}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for fqn, value in _read(directory, keys).items():
        name, key = fqn[len(OPTIM):].rsplit(".", 1)
        out.setdefault(name, {})[key] = value
    return out


def _read(directory: Path, keys: set[str]) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    if not keys:
        return {}
    with _one_process():
        return _load_state_dict_from_keys(keys, checkpoint_id=str(directory))


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
    return w.params[k] if w.layout is None else w.layout.masters[k]


def _sharded(w) -> bool:
    """Whether block weights `w` hold only this rank's rows of their host state."""
    return isinstance(w.layout, ShardedLayout)


def _per_element(w) -> Callable[[str, object, torch.Size], bool]:
    return w.shaped_keys() if _sharded(w) else (lambda key, v, shape: False)


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
