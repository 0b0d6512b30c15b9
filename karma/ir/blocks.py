"""Group a traced graph's nodes into blocks by their `nn_module_stack`.

Automatic granularity: every call of a repeated layer (a child of a ModuleList, Sequential or
ModuleDict that has a sibling of the same class and owns parameters: transformer layers,
ResNet bottlenecks) is a block. The runs of nodes outside such layers become "head", "tail"
or "after.NAME" blocks when they use parameters, and join the block before them otherwise.
`--blocks REGEX` names the layer modules instead (matched against module paths).
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import torch
import torch.fx
import torch.nn as nn

from karma.errors import IRError

_CONTAINERS = (nn.ModuleList, nn.Sequential, nn.ModuleDict)


@dataclass(frozen=True)
class BlockSpec:
    """Which graph nodes and parameters make up one block (before measuring it)."""

    name: str
    modules: tuple[str, ...]
    nodes: tuple[str, ...]  # names of the graph's compute nodes, in order
    params: tuple[str, ...]  # owned (first user)
    shared_params: tuple[str, ...]  # used, owned by an earlier block
    one_call: bool = False  # its nodes are one call of its module, nothing of the caller's


def find_units(model: nn.Module, blocks_regex: str | None = None) -> set[str]:
    """Module paths whose calls are blocks of their own (outermost matches only)."""
    names = [name for name, _ in model.named_modules()]
    if blocks_regex is not None:
        try:
            pattern = re.compile(blocks_regex)
        except re.error as e:
            raise IRError(f"--blocks {blocks_regex!r} is not a regular expression: {e}") from e
        found = [n for n in names if n and pattern.fullmatch(n)]
        if not found:
            sample = ", ".join(n for n in names[1:12] if n)
            raise IRError(
                f"--blocks {blocks_regex!r} matches no module path; paths look like: {sample}"
            )
    else:
        found = []
        for name, mod in model.named_modules():
            if not isinstance(mod, _CONTAINERS):
                continue
            children = list(mod.named_children())
            per_class = Counter(type(c) for _, c in children)
            for child_name, child in children:
                if per_class[type(child)] >= 2 and _has_params(child):
                    found.append(f"{name}.{child_name}" if name else child_name)
        if not found:  # no repeated layers: each top-level child with parameters is a block
            found = [n for n, m in model.named_children() if _has_params(m)]
    found_set = set(found)
    return {n for n in found_set if not any(n.startswith(o + ".") for o in found_set)}


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def group_nodes(gm: torch.fx.GraphModule, units: set[str]) -> list[BlockSpec]:
    """Assign every compute node of `gm` to a block; blocks come out in execution order."""
    param_names = _param_names(gm)
    runs: list[_Run] = []
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr", "output"):
            continue
        key, fqn = _unit_of(node, units)
        if not runs or runs[-1].key != key:
            runs.append(_Run(key, fqn))
        run = runs[-1]
        run.nodes.append(node.name)
        run.modules.extend(m for m in _outer_modules(node, units) if m not in run.modules)
        run.params.extend(p for p in _params_used(node, gm, param_names) if p not in run.params)

    runs = _merge_parameter_free_glue(runs)
    first_unit = next((i for i, r in enumerate(runs) if r.key is not None), None)
    last_unit = max((i for i, r in enumerate(runs) if r.key is not None), default=None)

    specs: list[BlockSpec] = []
    owner: dict[str, int] = {}
    seen_keys: set[str] = set()
    for i, run in enumerate(runs):
        if run.key is not None:
            if run.key in seen_keys:
                raise IRError(
                    f"the call of module {run.fqn} ({run.key}) is interleaved with other blocks; "
                    "name the blocks with --blocks REGEX"
                )
            seen_keys.add(run.key)
            name = run.fqn + (f"#{run.key.rsplit('@', 1)[1]}" if "@" in run.key else "")
            modules: tuple[str, ...] = (run.fqn,)
            one_call = not run.glued
        else:
            if first_unit is None or i < first_unit:
                name = "head" if first_unit is not None else "model"
            elif i > last_unit:
                name = "tail"
            else:
                name = f"after.{specs[-1].name}"
            modules = tuple(run.modules)
            one_call = False
        owned = tuple(p for p in run.params if p not in owner)
        for p in owned:
            owner[p] = len(specs)
        shared = tuple(p for p in run.params if p not in owned)
        specs.append(BlockSpec(name, modules, tuple(run.nodes), owned, shared, one_call))

    unused = [p for p in param_names.values() if p not in owner]
    if unused and specs:  # parameters the forward never uses still occupy memory: first block
        first = specs[0]
        specs[0] = BlockSpec(first.name, first.modules, first.nodes,
                             first.params + tuple(unused), first.shared_params,
                             first.one_call)
    return specs


@dataclass
class _Run:
    key: str | None  # the unit call's nn_module_stack key, None outside units
    fqn: str
    nodes: list[str]
    modules: list[str]
    params: list[str]
    glued: bool  # it took in a run of the caller's parameter-free nodes

    def __init__(self, key: str | None, fqn: str):
        self.key, self.fqn = key, fqn
        self.nodes, self.modules, self.params = [], [], []
        self.glued = False


def _merge_parameter_free_glue(runs: list[_Run]) -> list[_Run]:
    """Glue runs without parameters join the run before them (the one after, if first)."""
    out: list[_Run] = []
    pending: _Run | None = None  # parameter-free glue seen before any run
    for run in runs:
        if run.key is None and not run.params:
            if out:
                _absorb(out[-1], run)
            elif pending is None:
                pending = run
            else:
                _absorb(pending, run)
            continue
        if pending is not None:
            _absorb(pending, run)  # pending first, then this run's nodes, in graph order
            pending.key, pending.fqn = run.key, run.fqn
            run, pending = pending, None
        out.append(run)
    if pending is not None:
        out.append(pending)
    # runs of the same unit call separated only by parameter-free glue are one block
    merged: list[_Run] = []
    for run in out:
        if merged and run.key is not None and merged[-1].key == run.key:
            _absorb(merged[-1], run)
        else:
            merged.append(run)
    return merged


def _absorb(into: _Run, other: _Run) -> None:
    into.glued = True
    into.nodes.extend(other.nodes)
    into.modules.extend(m for m in other.modules if m not in into.modules)
    into.params.extend(p for p in other.params if p not in into.params)


def _unit_of(node: torch.fx.Node, units: set[str]) -> tuple[str | None, str]:
    for key, (fqn, _type) in (node.meta.get("nn_module_stack") or {}).items():
        if fqn in units:
            return key, fqn
    return None, ""


def _outer_modules(node: torch.fx.Node, units: set[str]) -> list[str]:
    """The outermost module the node runs in that contains no unit (if any)."""
    for fqn, _type in (node.meta.get("nn_module_stack") or {}).values():
        if fqn and not any(u == fqn or u.startswith(fqn + ".") for u in units):
            return [fqn]
    return []


def _param_names(gm: torch.fx.GraphModule) -> dict[int, str]:
    """id(parameter) -> its first name in gm (a tied parameter has one entry)."""
    return {id(p): name for name, p in gm.named_parameters()}


def _params_used(node: torch.fx.Node, gm: torch.fx.GraphModule,
                 param_names: dict[int, str]) -> list[str]:
    used = []
    for arg in node.all_input_nodes:
        if arg.op == "get_attr":
            obj = _fetch(gm, arg.target)
            if id(obj) in param_names:
                used.append(param_names[id(obj)])
    if node.op == "call_module":  # the torch.fx fallback keeps leaf modules as calls
        for p in gm.get_submodule(node.target).parameters():
            used.append(param_names[id(p)])
    return used


def _fetch(gm: torch.fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
