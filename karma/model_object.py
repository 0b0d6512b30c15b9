"""A model object is as good as a model file: `karma.model` makes the same `ModelFile`.

    net = build()                                       # or the function `build` itself
    m = karma.model(net, example_batch, loss_fn=my_loss, make_optimizer=my_optimizer)
    schedule = karma.plan(m, gpu_mem="300M", hardware="cpu", batch_size=8)
    with karma.Runtime(schedule, model=m) as rt:
        loss = rt.step(inputs, targets)

The functions are the model file's protocol (karma/modelfile.py) under any names: the
planner and the runtime see one ModelFile whatever it came from. [Note: a model object on
the meta device] The IR builds the model on the meta device: a function is called under
`torch.device("meta")` like a model file's build_model; a module instance is copied there,
its tensors replaced by meta tensors of the same shapes (nothing is allocated, ties kept).
The runtime trains the instance itself, from its values as they are.

A schedule records where its functions can be imported from again: their file and names
(`ModelRef.entry`), so that `karma-run` (and `--resume`) can train it as it trains a model
file. A function that cannot be imported again (a lambda, a function defined inside another,
a module instance, or any function of the script Python runs, `__main__`: importing a
script runs it) is recorded without a name; karma-run says how to run such a schedule, and
calibration, which times blocks in a karma-run of their own, times them one by one instead.
"""

from __future__ import annotations

import copy
import hashlib
import inspect
import itertools
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from karma.errors import KarmaError
from karma.modelfile import DEFAULT_BATCH_SIZE, ModelFile, load_model_file, make_model_file
from karma.schedule import MODEL_FUNCTIONS

# the functions karma.model (and karma.plan, beside a module) takes by keyword: the
# protocol's, but the builder
MODEL_KEYWORDS = tuple(name for name in MODEL_FUNCTIONS if name != "build_model")
OBJECT_PATH = "<model object>"  # the path of a model object none of whose code is in a file


def model(build: torch.nn.Module | Callable[[], torch.nn.Module],
          example_batch: Callable[[int], Any] | None = None, *,
          loss_fn: Callable | None = None, make_optimizer: Callable | None = None,
          make_scheduler: Callable | None = None, batches: Callable | None = None,
          eval_batches: Callable | None = None, batch_size: int | None = None) -> ModelFile:
    """A model object for karma.plan and karma.Runtime: `build` (an nn.Module, or a function
    of no arguments that builds one) with the model file protocol's functions: example_batch
    (required), loss_fn, make_optimizer, make_scheduler, batches, eval_batches, and
    batch_size (the default batch). Left out: the model file's defaults."""
    if isinstance(build, (str, Path)):
        raise KarmaError(f"karma.model({str(build)!r}): give a module or a function that "
                         "builds one; a model file's path goes to karma.plan as it is")
    if isinstance(build, ModelFile):
        raise KarmaError("karma.model(...) was given a model already made by karma.model or "
                         "load_model_file; pass that to karma.plan/karma.Runtime as it is")
    if isinstance(build, torch.nn.Module):
        build_model: Callable[[], torch.nn.Module] = _Instance(build)
    elif callable(build):
        build_model = build
    else:
        raise KarmaError(f"karma.model: the model is a {type(build).__name__}; give an "
                         "nn.Module, or a function of no arguments that builds one")
    if example_batch is None:
        raise KarmaError("karma.model needs example_batch: a function batch_size -> (inputs, "
                         "targets) made with factory functions (torch.randint, torch.randn), "
                         "which the planner also calls on the meta device")
    functions = {"build_model": build_model, "example_batch": example_batch,
                 "loss_fn": loss_fn, "make_optimizer": make_optimizer,
                 "make_scheduler": make_scheduler, "batches": batches,
                 "eval_batches": eval_batches}
    for name, f in functions.items():
        if f is not None and not callable(f):
            raise KarmaError(f"karma.model: {name} is a {type(f).__name__}, not a function")
    if batch_size is not None and (not isinstance(batch_size, int)
                                   or isinstance(batch_size, bool) or batch_size < 1):
        raise KarmaError(f"karma.model: batch_size={batch_size!r} is not a positive integer")
    path, entry = _entry(functions, build)
    sha256 = hashlib.sha256(path.read_bytes() if path.is_file() else b"").hexdigest()
    return make_model_file(path, sha256, None, functions, batch_size or DEFAULT_BATCH_SIZE,
                           entry)


def as_model(source: Any, **functions) -> ModelFile:
    """What karma.plan and karma.Runtime take as a model: a model file's path, a ModelFile
    (karma.model's or load_model_file's), or a module or builder with karma.model's
    keyword arguments."""
    given = {k: v for k, v in functions.items() if v is not None}
    if isinstance(source, ModelFile) or isinstance(source, (str, Path)):
        if given:
            what = "the model file" if isinstance(source, (str, Path)) else "karma.model(...)"
            raise KarmaError(f"{', '.join(given)} given beside {what}, which has its own; "
                             "define them in the model file, or pass them to karma.model")
        return source if isinstance(source, ModelFile) else load_model_file(source)
    if isinstance(source, torch.nn.Module) or callable(source):
        return model(source, **functions)
    raise KarmaError(f"the model is a {type(source).__name__}; give a model file's path, "
                     "karma.model(module, example_batch, ...), or an nn.Module with "
                     "example_batch=...")


class _Instance:
    """build_model for a module instance: the instance, or its meta copy under
    torch.device("meta") (the IR's build)."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self) -> torch.nn.Module:
        if torch.get_default_device().type == "meta":
            return meta_copy(self.module)
        return self.module


def meta_copy(module: torch.nn.Module) -> torch.nn.Module:
    """A copy of `module` whose parameters and buffers are meta tensors of the same shapes,
    dtypes and requires_grad, shared ones still shared; nothing of the original copied."""
    memo: dict[int, Any] = {}
    for t in itertools.chain(module.parameters(), module.buffers()):
        if id(t) not in memo:
            meta = torch.empty_like(t, device="meta")
            memo[id(t)] = torch.nn.Parameter(meta, t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _entry(functions: dict[str, Any], build: Any) -> tuple[Path, tuple[tuple[str, str], ...]]:
    """The file of a model object (its builder's, else its class's or its first function's)
    and where each of its functions can be imported from again: its name in that file,
    "module:name" for one of an installed module (torch.nn.functional:mse_loss), "" for
    one that cannot be (see the module docstring)."""
    sources = [build, type(build)] if isinstance(build, torch.nn.Module) else [build]
    files = [_source_file(f) for f in (*sources, *functions.values()) if f is not None]
    path = next((f for f in files if f is not None), None)

    def where(f: Any) -> str:
        if not _importable(f) or f.__module__ == "__main__":  # importing a script runs it
            return ""
        return f.__name__ if _source_file(f) == path else f"{f.__module__}:{f.__name__}"

    entry = tuple((name, where(f)) for name, f in functions.items() if f is not None)
    return (path or Path(OBJECT_PATH)), entry


def _importable(f: Any) -> bool:
    """Whether `f` is a function defined at the top level of a module, under its name."""
    if not isinstance(f, types.FunctionType) or f.__qualname__ != f.__name__:
        return False
    module = sys.modules.get(f.__module__)
    return module is not None and getattr(module, f.__name__, None) is f


def _source_file(obj: Any) -> Path | None:
    try:
        source = inspect.getsourcefile(obj)
    except TypeError:  # a built-in
        return None
    return Path(source).resolve() if source and Path(source).is_file() else None


def missing_entry(entry: tuple[tuple[str, str], ...]) -> list[str]:
    """The functions of a model object's entry that cannot be imported again."""
    return [name for name, attribute in entry if not attribute]

