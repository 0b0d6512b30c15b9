"""The model-file protocol: how karma gets a model, its data, its loss and its optimizer.

A model file is a plain Python file that defines

    build_model() -> torch.nn.Module                        (required)
    example_batch(batch_size) -> (inputs, targets)          (required; factory functions only,
                                                             so it also works on the meta device;
                                                             inputs a Tensor, a tuple (positional)
                                                             or a dict (keyword arguments))
    loss_fn(output, targets) -> Tensor                      (optional; default: the output's
                                                             `loss` if it has one, else
                                                             cross-entropy over the last dimension)
    make_optimizer(params) -> torch.optim.Optimizer         (optional; default AdamW, lr=1e-3)
    make_scheduler(optimizer) -> lr_scheduler               (optional; a torch.optim.lr_scheduler
                                                             over `optimizer`, stepped once after
                                                             each optimizer step; default: none)
    batches(batch_size, rank, world_size) -> iterator       (optional; default: example_batch
                                                             once per step under a seed derived
                                                             from the step and the rank)
    eval_batches(batch_size) -> finite iterable             (optional; held-out batches for
                                                             karma-run --eval-every)
    BATCH_SIZE: int                                         (optional; default for --batch-size)

Both the planner (through the IR) and the runtime load model files through `load_model_file`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import sys
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree

from karma.errors import ModelFileError
from karma.schedule import MODEL_FUNCTIONS

Batch = tuple[Any, Any]


@dataclass(frozen=True)
class ModelInputs:
    """One batch's inputs as the model is called with them: `model(*args, **kwargs)`."""

    args: tuple[torch.Tensor, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)  # tensors, or plain Python constants

    def call(self, model: Callable) -> Any:
        return model(*self.args, **self.kwargs)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (*self.args, *self.kwargs.values()) if isinstance(t, torch.Tensor)]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> ModelInputs:
        """The same inputs with `fn` applied to every tensor (e.g. a move to the device)."""
        return ModelInputs(tuple(fn(t) for t in self.args),
                           {k: fn(v) if isinstance(v, torch.Tensor) else v
                            for k, v in self.kwargs.items()})


def map_targets(targets: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """`targets` (a Tensor, a tuple of Tensors or None) with `fn` applied to each tensor."""
    return pytree.tree_map(lambda t: fn(t) if isinstance(t, torch.Tensor) else t, targets)

DEFAULT_BATCH_SIZE = 8


def default_loss_fn(output: Any, targets: Any) -> torch.Tensor:
    """The output's own `loss` if it has one (a Hugging Face model given `labels`), else
    cross-entropy of its logits over the last dimension, leading dimensions flattened."""
    loss = output_field(output, "loss")
    if isinstance(loss, torch.Tensor):
        return loss
    if targets is None:
        raise ModelFileError(
            "the model's output has no `loss` and example_batch/batches gave no targets; pass "
            "`labels` in the inputs dict (Hugging Face models then compute their loss), return "
            "targets, or define loss_fn(output, targets)")
    logits = output_field(output, "logits")
    if not isinstance(logits, torch.Tensor):
        logits = next(iter(output_tensors(output)), None)
    if logits is None:
        raise ModelFileError("the model's output holds no tensor; return the logits or "
                             "define loss_fn(output, targets)")
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def output_field(output: Any, name: str) -> Any:
    """`output[name]` of a mapping (a Hugging Face ModelOutput is one), `output.name` of
    another object, or None."""
    if isinstance(output, torch.Tensor):
        return None
    if isinstance(output, Mapping):
        return output.get(name)
    return getattr(output, name, None)


def output_tensors(output: Any) -> list[torch.Tensor]:
    """Every tensor in a model's output, wherever it sits: a Tensor, a tuple or list, a dict,
    a dataclass or a Hugging Face ModelOutput (never by iterating a mapping, which yields
    its keys)."""
    to_tuple = getattr(output, "to_tuple", None)
    if callable(to_tuple) and not isinstance(output, (tuple, torch.Tensor)):
        output = to_tuple()
    elif dataclasses.is_dataclass(output) and not isinstance(output, type):
        output = {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
    return [t for t in pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]


def default_make_optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def batch_seed(step: int, rank: int) -> int:
    """The seed under which the default `batches` draws step `step` of rank `rank`."""
    return 0x6B61726D + 1_000_003 * step + rank  # "karm" + step/rank offset


@dataclass(frozen=True)
class ModelFile:
    """A loaded model file, its protocol functions filled in with defaults."""

    path: Path
    sha256: str  # fingerprint of the file's bytes; schedules record it
    module: ModuleType | None  # None: a model object whose functions were given
    build_model: Callable[[], torch.nn.Module]
    example_batch: Callable[[int], Batch]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    make_optimizer: Callable[[Any], torch.optim.Optimizer]
    default_batch_size: int
    user_batches: Callable[[int, int, int], Iterator[Batch]] | None
    eval_batches: Callable[[int], Iterable[Batch]] | None = None
    make_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None  # None: constant lr
    # None: a model file, its functions by the protocol's names. A model object (model()):
    # (protocol name, the function's name in `path`) for each function given, "" for one
    # that cannot be imported again (a lambda, a local function, a module instance)
    entry: tuple[tuple[str, str], ...] | None = None

    def build(self, log: Callable[[str], None] | None = None) -> torch.nn.Module:
        """build_model(), with a Hugging Face model's KV cache turned off (see use_cache_off)."""
        model = self.build_model()
        if use_cache_off(model) and log is not None:
            log(USE_CACHE_NOTE)
        return model

    def checked_batches(self, batch_size: int, rank: int = 0,
                        world_size: int = 1) -> Iterator[tuple[ModelInputs, Any]]:
        """`batches`, each batch checked as example_batch's is: (ModelInputs, targets)."""
        where = (f"{self.path}: batches({batch_size}, {rank}, {world_size})"
                 if self.user_batches is not None else f"{self.path}: example_batch({batch_size})")
        for batch in self.batches(batch_size, rank, world_size):
            yield check_batch(batch, where)

    def checked_eval_batches(self, batch_size: int) -> list[tuple[ModelInputs, Any]]:
        """The model file's held-out batches, checked; an error if it defines none."""
        if self.eval_batches is None:
            raise ModelFileError(
                f"model file {self.path} defines no eval_batches(batch_size); define it to "
                "return a finite iterable of (inputs, targets), or drop --eval-every")
        where = f"{self.path}: eval_batches({batch_size})"
        try:  # under a seed of its own: the global RNG (dropout's) is left as it was
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(batch_seed(-1, 0))
                batches = list(self.eval_batches(batch_size))
        except Exception as e:  # noqa: BLE001 - user code; report where it failed
            raise ModelFileError(f"{where} raised {type(e).__name__}: {e}"
                                 f"{user_frame(e, self.path)}") from e
        if not batches:
            raise ModelFileError(f"{where} gave no batches; return at least one")
        return [check_batch(b, where) for b in batches]

    def batches(self, batch_size: int, rank: int = 0, world_size: int = 1) -> Iterator[Batch]:
        """The model file's `batches`, or `example_batch` once per step under a derived seed.

        The default leaves the global RNG exactly as it found it.
        """
        if self.user_batches is not None:
            return iter(self.user_batches(batch_size, rank, world_size))
        return self._default_batches(batch_size, rank)

    def _default_batches(self, batch_size: int, rank: int) -> Iterator[Batch]:
        step = 0
        while True:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(batch_seed(step, rank))
                batch = self.example_batch(batch_size)
            yield batch
            step += 1

    def checked_example_batch(self, batch_size: int) -> tuple[ModelInputs, Any]:
        """Call example_batch and check its shape: returns (ModelInputs, targets)."""
        try:
            result = self.example_batch(batch_size)
        except Exception as e:  # noqa: BLE001 - user code; report where it failed
            raise ModelFileError(
                f"{self.path}: example_batch({batch_size}) raised {type(e).__name__}: {e}"
                f"{user_frame(e, self.path)}"
            ) from e
        return check_batch(result, f"{self.path}: example_batch({batch_size})")


def check_batch(result: Any, where: str) -> tuple[ModelInputs, Any]:
    """Check that `result` is (inputs, targets) and return the inputs as `ModelInputs`.

    inputs: a Tensor, a tuple or list of Tensors (positional arguments) or a dict of str to
    Tensors (keyword arguments, `model(**inputs)`); targets: a Tensor, a tuple of Tensors or
    None (the model computes its own loss).
    """
    fix = ("return (inputs, targets), where inputs is a Tensor, a tuple of Tensors or a dict "
           "of keyword arguments, and targets a Tensor, a tuple of Tensors or None")
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise ModelFileError(f"{where} returned {_describe(result)}; {fix}")
    inputs, targets = result
    if isinstance(inputs, ModelInputs):  # checked already
        model_inputs = inputs
    elif isinstance(inputs, torch.Tensor):
        model_inputs = ModelInputs((inputs,))
    elif isinstance(inputs, (tuple, list)) and inputs \
            and all(isinstance(t, torch.Tensor) for t in inputs):
        model_inputs = ModelInputs(tuple(inputs))
    elif isinstance(inputs, Mapping) and inputs:
        bad = [k for k, v in inputs.items() if not isinstance(k, str)
               or not isinstance(v, (torch.Tensor, bool, int, float, str, type(None)))]
        if bad:
            raise ModelFileError(
                f"{where} returned an inputs dict whose entry {bad[0]!r} is "
                f"{_describe(inputs[bad[0]])}; its keys must be the forward's argument names "
                "and its values Tensors (or plain constants)")
        model_inputs = ModelInputs((), dict(inputs))
    else:
        raise ModelFileError(f"{where} returned inputs of type {_describe(inputs)}; {fix}")
    if targets is not None and not _is_tensor_tree(targets):
        raise ModelFileError(
            f"{where} returned targets of type {_describe(targets)}; targets must be a Tensor, "
            "a tuple of Tensors, or None when the model computes its own loss"
        )
    return model_inputs, targets


def check_signature(model: torch.nn.Module, inputs: ModelInputs, where: str,
                    failure: BaseException | None = None) -> None:
    """The model's forward accepts these arguments, or a ModelFileError that names them.

    A forward with **kwargs (every Hugging Face model's) takes any key, and ignores one it
    does not know: a misspelled `input_idz` leaves `input_ids` None. So a key that is not one
    of the forward's parameters is refused where it looks like a misspelling of one (difflib)
    and is not a keyword that Hugging Face's forwards take through **kwargs (their
    `TransformersKwargs`: `output_attentions`, ...); and after the forward failed
    (`failure`: what it raised, from tracing) any such key is refused, the failure named."""
    import difflib

    try:
        signature = inspect.signature(model.forward)
    except (TypeError, ValueError):  # a builtin or C forward: let the call itself say
        return
    params = signature.parameters
    forward = f"{type(model).__name__}.forward"
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    hf = sys.modules.get("transformers.utils.generic")
    passed_on = set(getattr(getattr(hf, "TransformersKwargs", None), "__annotations__", ()))
    for key in (k for k in inputs.kwargs if takes_any and k not in params and k not in passed_on):
        close = difflib.get_close_matches(key, named, n=1, cutoff=0.75)
        if failure is None and close:
            raise ModelFileError(
                f"{where}: the inputs' key {key!r} is not a parameter of {forward}, whose "
                f"**kwargs would take it; it looks like a misspelling of {close[0]!r}: rename it")
        if failure is not None:
            first_line = (str(failure).strip().splitlines() or [""])[0][:160]
            raise ModelFileError(
                f"{where}: the inputs' key {key!r} is not a parameter of {forward}, whose "
                f"**kwargs took it, and the forward failed ({type(failure).__name__}: "
                f"{first_line}); rename the key to "
                + (repr(close[0]) if close else f"one of {', '.join(named)}")) from failure
    try:
        unknown = [k for k in inputs.kwargs if k not in params] if not takes_any else []
        if unknown:
            raise TypeError(f"it takes no argument {', '.join(map(repr, unknown))}")
        signature.bind(*inputs.args, **inputs.kwargs)
    except TypeError as e:
        raise ModelFileError(
            f"{where}: {forward}({', '.join(params)}) does not accept these inputs ({e}); "
            "make the inputs dict's keys the forward's argument names") from e


def build_meta(mf: ModelFile, batch_size: int) -> tuple[torch.nn.Module, ModelInputs, object]:
    """build_model() and example_batch(batch_size) on the meta device, the model in training
    mode: what the IR traces and the fingerprint (karma/fingerprint.py) hashes."""
    with torch.device("meta"):
        try:
            model = mf.build_model()
        except Exception as e:  # noqa: BLE001 - user code
            raise ModelFileError(
                f"{mf.path}: build_model() raised {type(e).__name__}: {e}{user_frame(e, mf.path)}"
            ) from e
        if not isinstance(model, torch.nn.Module):
            raise ModelFileError(
                f"{mf.path}: build_model() returned {type(model).__name__}, not a "
                "torch.nn.Module; return the model"
            )
        inputs, targets = mf.checked_example_batch(batch_size)
    if "forward" in vars(model):  # a wrapper set on the instance hides the modules it calls
        raise ModelFileError(
            f"{mf.path}: the model's forward is replaced on the instance "
            f"({getattr(vars(model)['forward'], '__qualname__', 'a wrapper')}; Accelerate's "
            "prepare and autocast wrappers do this), which hides its blocks from karma; give "
            "karma the model before it is wrapped (karma applies bf16 autocast itself: "
            "dtype='bf16')")
    check_signature(model, inputs, f"{mf.path}: example_batch({batch_size})")
    for t in inputs.tensors():
        if t.device.type != "meta":
            raise ModelFileError(
                f"{mf.path}: example_batch made a tensor on {t.device}, not on the meta device; "
                "make inputs with factory functions (torch.randn, torch.randint, ...) and no "
                "device= argument, so that they follow the default device"
            )
    model.train()
    return model, inputs, targets


def _is_tensor_tree(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    return isinstance(x, (tuple, list)) and bool(x) and all(isinstance(t, torch.Tensor) for t in x)


def _describe(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        inner = ", ".join(type(v).__name__ for v in x[:4])
        return f"{type(x).__name__} of {len(x)} ({inner}{', ...' if len(x) > 4 else ''})"
    return type(x).__name__


def user_frame(e: BaseException, path: Path) -> str:
    """' (at FILE:LINE: code)' for the innermost frame of the traceback inside `path`."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {f.filename}:{f.lineno}: {(f.line or '').strip()})"


def load_model_file(path: str | Path,
                    entry: tuple[tuple[str, str], ...] | None = None) -> ModelFile:
    """Import a model file and check that it follows the protocol. `entry`: a model
    object's functions by their names in the file (karma/model_object.py), instead of the
    protocol's names."""
    path = Path(path)
    if not path.exists():
        raise ModelFileError(
            f"model file '{path}' does not exist; pass the path of a Python file that defines "
            "build_model() and example_batch(batch_size), e.g. examples/gpt.py"
        )
    if not path.is_file() or path.suffix != ".py":
        raise ModelFileError(f"model file '{path}' is not a .py file; pass a Python model file")
    path = path.resolve()
    data = path.read_bytes()
    try:
        compile(data, str(path), "exec")
    except SyntaxError as e:
        raise ModelFileError(
            f"{path}:{e.lineno}: syntax error: {e.msg}: {(e.text or '').strip()!r}; fix the "
            "model file (python -m py_compile FILE shows the same error)"
        ) from e

    name = "karma_model_" + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # noqa: BLE001 - user code; report where it failed
        del sys.modules[name]
        raise ModelFileError(
            f"importing model file {path} failed: {type(e).__name__}: {e}{user_frame(e, path)}"
        ) from e

    names = dict(entry) if entry is not None else {name: name for name in MODEL_FUNCTIONS}
    functions = {p: resolve_function(module, where) for p, where in names.items()}
    for required in ("build_model", "example_batch"):
        if not callable(functions.get(required)):
            raise ModelFileError(
                f"model file {path} does not define {names.get(required, required)}(); a "
                "model file must define build_model() -> nn.Module and "
                "example_batch(batch_size) -> (inputs, targets)")
    batch_size = getattr(module, "BATCH_SIZE", DEFAULT_BATCH_SIZE)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ModelFileError(
            f"model file {path}: BATCH_SIZE = {batch_size!r} is not a positive integer"
        )
    return make_model_file(path, hashlib.sha256(data).hexdigest(), module,
                           functions, batch_size, entry)


def resolve_function(module: ModuleType, where: str) -> Any:
    """A function of a model file, or of a model object's entry: `where` names it in
    `module`, or is "package.module:name" (karma/model_object.py); None if absent."""
    if ":" not in where:
        return getattr(module, where, None) if where else None
    name, _, attribute = where.partition(":")
    try:
        return getattr(importlib.import_module(name), attribute, None)
    except ImportError:
        return None


def make_model_file(path: Path, sha256: str, module: ModuleType | None,
                functions: Mapping[str, Any], batch_size: int,
                entry: tuple[tuple[str, str], ...] | None = None) -> ModelFile:
    """The one place a ModelFile is made, from a model file's functions or a model
    object's, the optional ones filled in with the defaults."""
    return ModelFile(
        path=path, sha256=sha256, module=module,
        build_model=functions["build_model"],
        example_batch=functions["example_batch"],
        loss_fn=functions.get("loss_fn") or default_loss_fn,
        make_optimizer=functions.get("make_optimizer") or default_make_optimizer,
        default_batch_size=batch_size,
        user_batches=functions.get("batches"),
        eval_batches=functions.get("eval_batches"),
        make_scheduler=functions.get("make_scheduler"),
        entry=entry,
    )


USE_CACHE_NOTE = ("turned off the Hugging Face model's KV cache (config.use_cache = False): "
                  "training never reads it, and Hugging Face's Trainer does the same under "
                  "gradient checkpointing")


def use_cache_off(model: torch.nn.Module) -> bool:
    """Turn off a Hugging Face model's KV cache; True if it was on.

    With `use_cache=True` the model returns a DynamicCache, which torch.export cannot trace
    and training never needs.
    """
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is True:
        config.use_cache = False
        return True
    return False
