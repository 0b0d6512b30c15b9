"""The model-file protocol: how karma gets a model, its data, its loss and its optimizer.

A model file is a plain Python file that defines

    build_model() -> torch.nn.Module                        (required)
    example_batch(batch_size) -> (inputs, targets)          (required; factory functions only,
                                                             so it also works on the meta device)
    loss_fn(output, targets) -> Tensor                      (optional; default cross-entropy over
                                                             the last dimension)
    make_optimizer(params) -> torch.optim.Optimizer         (optional; default AdamW, lr=1e-3)
    batches(batch_size, rank, world_size) -> iterator       (optional; default: example_batch
                                                             once per step under a seed derived
                                                             from the step and the rank)
    BATCH_SIZE: int                                         (optional; default for --batch-size)

Both the planner (through the IR) and the runtime load model files through `load_model_file`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

from karma.errors import ModelFileError

Batch = tuple[Any, Any]

DEFAULT_BATCH_SIZE = 8


def default_loss_fn(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy over the last dimension, leading dimensions flattened."""
    return F.cross_entropy(output.reshape(-1, output.shape[-1]), targets.reshape(-1))


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
    module: ModuleType
    build_model: Callable[[], torch.nn.Module]
    example_batch: Callable[[int], Batch]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    make_optimizer: Callable[[Any], torch.optim.Optimizer]
    default_batch_size: int
    user_batches: Callable[[int, int, int], Iterator[Batch]] | None

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

    def checked_example_batch(self, batch_size: int) -> tuple[tuple[torch.Tensor, ...], Any]:
        """Call example_batch and check its shape: returns (inputs as a tuple, targets)."""
        try:
            result = self.example_batch(batch_size)
        except Exception as e:  # noqa: BLE001 - user code; report where it failed
            raise ModelFileError(
                f"{self.path}: example_batch({batch_size}) raised {type(e).__name__}: {e}"
                f"{_user_frame(e, self.path)}"
            ) from e
        return check_batch(result, f"{self.path}: example_batch({batch_size})")


def check_batch(result: Any, where: str) -> tuple[tuple[torch.Tensor, ...], Any]:
    """Check that `result` is (inputs, targets) with tensor inputs; return inputs as a tuple."""
    fix = "return (inputs, targets), where inputs is a Tensor or a tuple of Tensors"
    if not isinstance(result, (tuple, list)) or len(result) != 2:
        raise ModelFileError(f"{where} returned {_describe(result)}; {fix}")
    inputs, targets = result
    if isinstance(inputs, torch.Tensor):
        inputs = (inputs,)
    elif not (isinstance(inputs, (tuple, list)) and inputs
              and all(isinstance(t, torch.Tensor) for t in inputs)):
        raise ModelFileError(f"{where} returned inputs of type {_describe(inputs)}; {fix}")
    if not _is_tensor_tree(targets):
        raise ModelFileError(
            f"{where} returned targets of type {_describe(targets)}; targets must be a Tensor "
            "or a tuple of Tensors"
        )
    return tuple(inputs), targets


def _is_tensor_tree(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    return isinstance(x, (tuple, list)) and bool(x) and all(isinstance(t, torch.Tensor) for t in x)


def _describe(x: Any) -> str:
    if isinstance(x, (tuple, list)):
        inner = ", ".join(type(v).__name__ for v in x[:4])
        return f"{type(x).__name__} of {len(x)} ({inner}{', ...' if len(x) > 4 else ''})"
    return type(x).__name__


def _user_frame(e: BaseException, path: Path) -> str:
    """' (at FILE:LINE: code)' for the innermost frame of the traceback inside `path`."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
    if not frames:
        return ""
    f = frames[-1]
    return f" (at {f.filename}:{f.lineno}: {(f.line or '').strip()})"


def load_model_file(path: str | Path) -> ModelFile:
    """Import a model file and check that it follows the protocol."""
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
            f"importing model file {path} failed: {type(e).__name__}: {e}{_user_frame(e, path)}"
        ) from e

    for required in ("build_model", "example_batch"):
        if not callable(getattr(module, required, None)):
            raise ModelFileError(
                f"model file {path} does not define {required}(); a model file must define "
                "build_model() -> nn.Module and example_batch(batch_size) -> (inputs, targets)"
            )
    batch_size = getattr(module, "BATCH_SIZE", DEFAULT_BATCH_SIZE)
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ModelFileError(
            f"model file {path}: BATCH_SIZE = {batch_size!r} is not a positive integer"
        )
    return ModelFile(
        path=path,
        sha256=hashlib.sha256(data).hexdigest(),
        module=module,
        build_model=module.build_model,
        example_batch=module.example_batch,
        loss_fn=getattr(module, "loss_fn", default_loss_fn),
        make_optimizer=getattr(module, "make_optimizer", default_make_optimizer),
        default_batch_size=batch_size,
        user_batches=getattr(module, "batches", None),
    )


@dataclass(frozen=True)
class OptimizerProfile:
    """What the model file's optimizer costs in memory, per byte of parameter."""

    state_factor: int  # parameter-sized state tensors it keeps (AdamW: 2)
    temp_factor: float  # parameter-sized temporaries a step makes (AdamW: 2)


def optimizer_profile(mf: ModelFile) -> OptimizerProfile:
    """Step the model file's optimizer on a small parameter and count what it allocates.

    A first step creates the state; a second one, under a counting dispatch mode, shows the
    temporaries. Any optimizer works, with no table of known ones.
    """
    from karma.ir.measure import LiveBytes

    param = torch.nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))
    try:
        opt = mf.make_optimizer([param])
        param.grad = torch.ones_like(param)
        opt.step()
        state = [v for v in opt.state.get(param, {}).values() if isinstance(v, torch.Tensor)]
        live = LiveBytes(known=[param, param.grad, *state])
        with live, torch.no_grad():
            opt.step()
    except Exception as e:  # noqa: BLE001 - user code
        raise ModelFileError(
            f"{mf.path}: make_optimizer(params) failed on a test parameter: "
            f"{type(e).__name__}: {e}{_user_frame(e, mf.path)}") from e
    nbytes = param.numel() * param.element_size()
    return OptimizerProfile(
        state_factor=sum(1 for v in state if v.shape == param.shape),
        temp_factor=round(live.peak / nbytes, 3),
    )
