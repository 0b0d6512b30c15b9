"""What a model is, as traced: the fingerprint a schedule records, and the check against it.

    fp = model_fingerprint(mf)        # parameters, buffers, modules, ops, optimizer state
    fp.sha256                         # what ModelRef.graph_sha256 records
    check_model(schedule, mf, "S.yaml", log)   # fine, a note, or StaleSchedule

[Note: a schedule is keyed on the model, not on its file's bytes] A schedule depends on what
the model file builds: its parameters (each block's, their bytes), its buffers, its module
tree (blocks are module paths), the operations of a forward and the loss (the activations
each block saves) and the optimizer's state (what a step holds). A comment, a reformatted
line or a learning rate changes none of them, so such an edit keeps the schedule runnable;
any change to them needs a new plan. The fingerprint is computed on the meta device (nothing
is allocated; GPT-2 small takes about 0.15 s, once torch has imported its compiler, which its
meta kernels do once a process, in about a second, as tracing does) at a fixed batch of
FINGERPRINT_BATCH, so it does not depend on the batch the plan is for, under a fixed seed so
that randomness in the model file cannot change it. The planner records it
(model_ref, into karma/schedule.py's ModelRef); the runtime compares it only when the file's bytes
differ from the planned file's (open_model_file). This module imports neither karma.ir nor
karma.planner: the runtime calls it.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import json
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from karma.errors import KarmaError, ModelFileError
from karma.logs import note
from karma.modelfile import ModelFile, build_meta, use_cache_off, user_frame
from karma.schedule import ModelRef, Schedule
from karma.units import format_bytes

FINGERPRINT_BATCH = 2  # the batch example_batch is called with (any plan's batch: the same)
_RECIPE = "karma-fingerprint-1"  # hashed with the parts: a new recipe is a new fingerprint
_SEED = 0


class StaleSchedule(KarmaError):
    """The model file builds another model than the one the schedule was planned for."""


@dataclass(frozen=True)
class Param:
    """One parameter as the model registers it."""

    name: str
    dtype: str  # "float32"
    shape: tuple[int, ...]
    requires_grad: bool
    tied_to: str | None  # the first name of the same tensor, for a shared parameter
    nbytes: int

    def text(self) -> str:
        """'h.0.fc.weight float32[256, 64]' (as an error names it)."""
        return f"{self.name} {self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class ModelFingerprint:
    """The model a model file builds, as the planner traces it; `sha256` hashes it all."""

    params: tuple[Param, ...]
    buffers: tuple[str, ...]  # "name dtype[shape]"
    modules: tuple[str, ...]  # "path Class" for every module (the root's path is "")
    ops: tuple[str, ...]  # "aten.op.overload -> dtype[shape], ..." for forward and loss
    optimizer: tuple[str, ...]  # its class, its state after a step, its non-numeric flags

    @property
    def sha256(self) -> str:
        parts = {"recipe": _RECIPE,
                 "params": [[p.name, p.dtype, list(p.shape), p.requires_grad, p.tied_to]
                            for p in self.params],
                 "buffers": list(self.buffers), "modules": list(self.modules),
                 "ops": list(self.ops), "optimizer": list(self.optimizer)}
        text = json.dumps(parts, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()


def model_fingerprint(mf: ModelFile) -> ModelFingerprint:
    """The fingerprint of the model `mf` builds: on the meta device, at FINGERPRINT_BATCH,
    under a fixed seed (the global RNGs are left as they were). ModelFileError, naming the
    model file's line, where its code fails."""
    with _fixed_seed():
        model, inputs, targets = build_meta(mf, FINGERPRINT_BATCH)
        use_cache_off(model)
        recorder = _OpRecorder()
        try:
            with recorder:
                mf.loss_fn(inputs.call(model), targets)
        except Exception as e:  # noqa: BLE001 - user code: say where it failed
            raise ModelFileError(
                f"{mf.path}: the forward and loss on the meta device (the model's fingerprint) "
                f"raised {type(e).__name__}: {e}{user_frame(e, mf.path)}") from e
    return ModelFingerprint(_params(model), _buffers(model), _modules(model),
                            tuple(recorder.ops), _optimizer(mf))


def graph_sha256(mf: ModelFile) -> str | None:
    """The hash of the model `mf` builds; None where its forward does not run eagerly on the
    meta device (a Mixture of Experts' grouped matmul): its file's bytes are checked
    instead. Inside remembering(mf), computed once."""
    if _REMEMBERED.get(id(mf), _UNKNOWN) is not _UNKNOWN:
        return _REMEMBERED[id(mf)]
    try:
        sha = model_fingerprint(mf).sha256
    except KarmaError:
        sha = None
    if id(mf) in _REMEMBERED:
        _REMEMBERED[id(mf)] = sha
    return sha


_UNKNOWN = object()
_REMEMBERED: dict[int, object] = {}  # id of a ModelFile -> its graph_sha256, in remembering()


@contextlib.contextmanager
def remembering(mf: ModelFile) -> Iterator[None]:
    """Inside, graph_sha256(mf) is computed once: for one planning of one model, which
    records it (model_ref) and keys its measurements on it (code_sha256, a model object's)
    while the model cannot change; outside, every call looks at the model as it is then (a
    module instance may have been changed in place)."""
    if id(mf) in _REMEMBERED:  # an enclosing planning remembers it already
        yield
        return
    _REMEMBERED[id(mf)] = _UNKNOWN
    try:
        yield
    finally:
        del _REMEMBERED[id(mf)]


def model_ref(path: str, mf: ModelFile, ir_json: str,
              env: tuple[tuple[str, str], ...] | None = None,
              plan_command: str | None = None) -> ModelRef:
    """What a schedule planned from `mf` records of it (ModelRef.now): `path` as given, its
    bytes' and its model's hashes, and a model object's entry."""
    return ModelRef.now(path, mf.sha256, ir_json, env, graph_sha256=graph_sha256(mf),
                        plan_command=plan_command, entry=mf.entry)


@contextlib.contextmanager
def _fixed_seed():
    """torch's CPU generator, Python's `random` and numpy's (where the model file imported
    it) seeded for the block, then restored as they were."""
    numpy = sys.modules.get("numpy")
    python_state = random.getstate()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_SEED)
            random.seed(_SEED)
            if numpy is not None:
                numpy.random.seed(_SEED)
            yield
    finally:
        random.setstate(python_state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)


class _OpRecorder(TorchDispatchMode):
    """Every aten op that runs under it, with its outputs' dtypes and shapes, in order.

    [Note: a value read on the meta device] A meta tensor has no values, so reading one
    (`.item()`, `bool(t)`: aten._local_scalar_dense) fails. Hugging Face models read a few
    in eager mode: `padding_mask.all()` to skip an all-ones attention mask, and whether the
    position ids restart (packed sequences). Here such a read gives True (1 for a number):
    what a batch without padding or packing gives those checks. Any fixed answer keeps the
    fingerprint a function of the model alone.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:
            value = True if args[0].dtype == torch.bool else (
                1.0 if args[0].is_floating_point() else 1)
            self.ops.append(f"{func} -> {value}")
            return value
        out = func(*args, **(kwargs or {}))
        shapes = ", ".join(_tensor_text(t) for t in pytree.tree_leaves(out)
                           if isinstance(t, torch.Tensor))
        self.ops.append(f"{func} -> {shapes}")
        return out


def _tensor_text(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _params(model: torch.nn.Module) -> tuple[Param, ...]:
    first: dict[int, str] = {}
    params = []
    for name, p in model.named_parameters(remove_duplicate=False):
        tied_to = first.setdefault(id(p), name)
        params.append(Param(name, str(p.dtype).removeprefix("torch."), tuple(p.shape),
                            p.requires_grad, None if tied_to == name else tied_to,
                            p.numel() * p.element_size()))
    return tuple(params)


def _buffers(model: torch.nn.Module) -> tuple[str, ...]:
    return tuple(f"{name} {_tensor_text(b)}"
                 for name, b in model.named_buffers(remove_duplicate=False))


def _modules(model: torch.nn.Module) -> tuple[str, ...]:
    """Each module's path and class name (not its Python module: a model file's classes
    live in a module named after the file's path, which a copy elsewhere changes)."""
    return tuple(f"{name} {type(m).__qualname__}"
                 for name, m in model.named_modules(remove_duplicate=False))


def _optimizer(mf: ModelFile) -> tuple[str, ...]:
    """The model file's optimizer stepped once on a small parameter: its class, the state
    it keeps (what a step holds in memory: Adam's two moments, SGD's momentum or none) and
    its flags (amsgrad, foreach, fused, ...); not its rates, which no plan depends on."""
    param = torch.nn.Parameter(torch.zeros(2, 3))
    try:
        opt = mf.make_optimizer([param])
        param.grad = torch.ones_like(param)
        opt.step()
    except Exception as e:  # noqa: BLE001 - user code
        raise ModelFileError(f"{mf.path}: make_optimizer(params) failed on a test parameter: "
                             f"{type(e).__name__}: {e}{user_frame(e, mf.path)}") from e
    state = sorted(f"state {key} {_tensor_text(v)}"
                   for key, v in opt.state.get(param, {}).items() if isinstance(v, torch.Tensor))
    group = opt.param_groups[0]
    flags = sorted(f"flag {key}={value}" for key, value in group.items()
                   if isinstance(value, (bool, str, type(None))))
    return (type(opt).__qualname__, *state, *flags)


def code_sha256(mf: ModelFile) -> str:
    """Fingerprint of the model file's code: its syntax tree, so comments and formatting do
    not count and every other edit does (a constant that changes how fast the model runs
    but not what it builds, such as torch.set_num_threads or the optimizer's kernel, too).
    Measurements of the model (karma/calibrate) are cached under it.

    A model object's (karma/model_object.py) code is only partly in its file (a module
    instance, a lambda, functions of other modules): its fingerprint and where its
    functions come from are hashed with the file's tree, so that another model or another
    optimizer in the same file is measured again."""
    h = hashlib.sha256()
    if mf.path.is_file():
        h.update(ast.dump(ast.parse(mf.path.read_bytes(), str(mf.path))).encode())
    if mf.entry is not None:
        h.update(repr(mf.entry).encode())
        h.update((graph_sha256(mf) or "").encode())
    return h.hexdigest()


# --- the check ---------------------------------------------------------------------------

def check_model(schedule: Schedule, mf: ModelFile, schedule_path: str | Path | None,
                log: Callable[[str], None] | None = None) -> None:
    """The model file `mf` builds the model `schedule` was planned for, or StaleSchedule
    naming what changed and the karma-plan command that plans it again.

    The same bytes of a model file: fine. Other bytes, the same fingerprint: fine, and a
    note to `log` (default: the karma logger). A model object's file is not the model (a
    module instance's is torch's own nn.Linear, say; an optimizer may be a lambda beside
    it), so its fingerprint is compared whatever the bytes. A schedule without a
    fingerprint (planned before schedules recorded it, or for a model whose forward does
    not run on the meta device) needs the same bytes."""
    model = schedule.model
    same_bytes = mf.sha256 == model.sha256
    if same_bytes and (model.entry is None or model.graph_sha256 is None):
        return
    replan = model.replan_command(schedule_path)
    if model.graph_sha256 is None:
        raise StaleSchedule(
            f"the schedule is stale: model file {mf.path} has changed since it was planned "
            f"(sha256 {mf.sha256[:12]}, the schedule has {model.sha256[:12]}; it records no "
            "fingerprint of the model, planned by an older karma or for a model whose "
            f"forward does not run on the meta device, so any edit counts); re-plan it: "
            f"{replan}")
    try:
        fingerprint = model_fingerprint(mf)
    except ModelFileError as e:
        raise StaleSchedule(
            f"the schedule may be stale: model file {mf.path} has changed since it was "
            f"planned, and the model it builds could not be compared ({e}); re-plan it: "
            f"{replan}") from e
    if fingerprint.sha256 != model.graph_sha256:
        raise StaleSchedule(
            f"the schedule is stale: model file {mf.path} builds another model than the one "
            f"it was planned for: {what_changed(schedule, fingerprint)}; re-plan it: {replan}")
    if same_bytes:
        return
    (log or note)(
        f"model file {mf.path} has changed since the schedule was planned, but the model it "
        "builds has not (the same parameters, modules, operations and optimizer state: "
        "comments, formatting or constants no plan depends on); the schedule holds")


def what_changed(schedule: Schedule, fp: ModelFingerprint) -> str:
    """What differs between the model the schedule holds and `fp`, as far as the schedule
    tells: a parameter gone or new, a block whose parameters' bytes differ; else the parts
    the schedule keeps only in the fingerprint."""
    now = {p.name: p for p in fp.params if p.tied_to is None}
    planned = [name for b in schedule.blocks for name in b.params]
    gone = [name for name in planned if name not in now]
    if gone:
        return f"its parameter {gone[0]} is gone" + _more(gone)
    known = set(planned)
    new = [p for name, p in now.items() if name not in known]
    if new:
        return f"it has a new parameter {new[0].text()}" + _more(new)
    for b in schedule.blocks:
        nbytes = sum(now[name].nbytes for name in b.params)
        if nbytes != b.param_bytes:
            shown = ", ".join(now[name].text() for name in b.params[:3])
            more = ", ..." if len(b.params) > 3 else ""
            return (f"the parameters of block {b.index} ({b.name}) hold "
                    f"{format_bytes(nbytes)} now, {format_bytes(b.param_bytes)} when planned "
                    f"({shown}{more})")
    return ("its parameters are as planned, but its operations (e.g. another activation), "
            "module classes, buffers or optimizer state are not")


def _more(items: list) -> str:
    return f" (and {len(items) - 1} more)" if len(items) > 1 else ""


def model_file_path(schedule: Schedule, schedule_path: str | Path | None) -> Path:
    """The schedule's model file: its path as recorded, or, for a relative path that does
    not exist from here, the same path beside the schedule file."""
    path = Path(schedule.model.path)
    if not path.is_absolute() and not path.exists() and schedule_path is not None:
        beside = Path(schedule_path).resolve().parent / path
        path = beside if beside.exists() else path
    return path


