"""Atomic checkpoints: DIR/step_N/{state/, extras.pt, meta.json}.

Every rank takes part. A checkpoint is written into a hidden temporary directory, each file
to a temporary name that is renamed when complete, and the directory is renamed to step_N
last, by rank 0, once every rank's part is in: a run killed at any moment leaves either a
complete checkpoint or none, and the newest complete one is what --resume loads.
- state/: the weights, buffers and every block's optimizer state through
  torch.distributed.checkpoint, each rank writing the part it holds (dcp_state.py, [Note:
  the state through DCP]); it loads into any number of ranks. karma-export (export.py)
  writes the model's plain state_dict from it.
- extras.pt: the model's state_dict keys, the optimizers' classes and hyperparameters
  (param_groups), the LR schedule's state (params/lr.py), the RNG state and the world size it was
  written at; meta.json says what the checkpoint is.
The ranks draw the same random numbers (one seed, the same draws: their streams are equal),
so the RNG state is rank 0's, and a run resumed on another number of ranks goes on with it
on every rank. Checkpoints of the earlier format (model.pt, optimizer.pt) still load.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil
import tempfile
from pathlib import Path

import torch

from karma.errors import KarmaError
from karma.fileio import replaced_atomically
from karma.runtime.checkpoints import dcp_state
from karma.runtime.distributed import process_group
from karma.runtime.distributed.process_group import SINGLE, Ranks
from karma.runtime.params.host_optimizer import hyperparameters
from karma.storage import NO_ROOM, write_failure

FORMAT = "karma-checkpoint-2"
FILES = ("extras.pt", "meta.json", f"{dcp_state.STATE_DIR}/.metadata")
LEGACY_FORMAT = "karma-checkpoint-1"  # model.pt, optimizer.pt (the state gathered whole)
LEGACY_FILES = ("model.pt", "optimizer.pt", "meta.json")


def model_state(model: torch.nn.Module, engine, scratch: Path,
                snapshot: bool = False) -> dict[str, torch.Tensor]:
    """The model's state_dict with each parameter's up-to-date value (host masters included)."""
    current: dict[str, torch.Tensor] = {}
    for w in engine.weights:
        current.update(w.current())
    canonical = {id(p): n for n, p in model.named_parameters()}
    state, copies = {}, {}
    for name, value in model.state_dict(keep_vars=True).items():
        if isinstance(value, torch.nn.Parameter):
            value = current[canonical[id(value)]]
        if id(value) not in copies:  # a tied weight is saved once, under both names
            copies[id(value)] = _standalone(value.detach().cpu(), scratch, snapshot)
        state[name] = copies[id(value)]
    return state


def _standalone(t: torch.Tensor, scratch: Path, snapshot: bool = False) -> torch.Tensor:
    """`t` if it owns its whole storage (and no `snapshot` is asked for), else a copy in a
    file-backed storage of its own.

    [Note: saving views of the host tier] torch.save writes a view's whole storage, and the
    host tier's tensors are views of large arenas; cloning them would take private memory
    that a capped run does not have. A file-backed copy of exactly the tensor's bytes costs
    neither.
    """
    nbytes = t.numel() * t.element_size()
    if not snapshot and t.untyped_storage().nbytes() == nbytes and t.storage_offset() == 0 \
            and t.is_contiguous():
        return t
    fd, name = tempfile.mkstemp(dir=scratch, suffix=".bin")
    with os.fdopen(fd, "wb") as f:  # see [Note: the tier's disk is taken when it grows]
        os.posix_fallocate(f.fileno(), 0, max(nbytes, 1))
    out = torch.from_file(name, shared=True, size=t.numel(), dtype=t.dtype).view(t.shape)
    os.unlink(name)  # the mapping stays until the copy is dropped
    out.copy_(t)
    return out


def runtime_state(model: torch.nn.Module, engine, scratch: Path, snapshot: bool = False,
                  lr_schedule=None) -> dict:
    """The training state: {"model": model.pt's state_dict, "optimizer": optimizer.pt's}.

    With `snapshot`, every tensor is a copy (file-backed: no private memory), which later
    steps leave as it is; without, a tensor may be the live one (written out at once).
    """
    engine.settle()  # the last step's updates, if still running, are part of the state
    return {
        "model": model_state(model, engine, scratch, snapshot),
        "optimizer": {
            "format": FORMAT,
            "blocks": [_detached_state(w.optimizer_state(), scratch, snapshot)
                       for w in engine.weights],
            "lr_schedule": (None if lr_schedule is None  # a copy: later steps leave it as it is
                            else copy.deepcopy(lr_schedule.state_dict())),
            "rng_state": torch.get_rng_state(),
            "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
        },
    }


def load_runtime_state(state: dict, model: torch.nn.Module, engine, source: str,
                       lr_schedule=None) -> None:
    """Restore parameters, buffers, each block's optimizer, the LR schedule and the RNG from
    `state`."""
    if not isinstance(state, dict) or not {"model", "optimizer"} <= state.keys():
        raise KarmaError(f"{source} is not a karma state: expected a dict with 'model' and "
                         "'optimizer', as Runtime.state_dict() returns and karma-run's "
                         "checkpoints hold")
    engine.settle()  # nothing of the last step may still write what is loaded
    values, opt = state["model"], state["optimizer"]
    if not isinstance(values, dict) or not isinstance(opt, dict) \
            or opt.get("format") != FORMAT or "rng_state" not in opt \
            or len(opt.get("blocks", ())) != len(engine.weights):
        raise KarmaError(f"{source} was written for another schedule; load it with the "
                         "schedule that wrote it")
    if (opt.get("lr_schedule") is None) != (lr_schedule is None):
        has = "has no" if lr_schedule is not None else "has an"
        raise KarmaError(f"{source} {has} LR schedule but the model file's make_scheduler "
                         f"{'is defined' if lr_schedule is not None else 'is not'}; load it "
                         "with the model file that wrote it")
    expected = model.state_dict()
    missing = sorted(set(expected) - set(values))
    if missing:
        raise KarmaError(f"{source} lacks {len(missing)} of the model's entries (e.g. "
                         f"{missing[0]}); load a state of this model")
    wrong = [k for k, v in expected.items() if tuple(values[k].shape) != tuple(v.shape)]
    if wrong:
        k = wrong[0]
        raise KarmaError(f"{source}: {k} has shape {tuple(values[k].shape)}, the model's "
                         f"{tuple(expected[k].shape)}; load a state of this model")
    with torch.no_grad():
        for name, buf in model.named_buffers():
            buf.copy_(values[name])
    for w, block_state in zip(engine.weights, opt["blocks"]):
        w.load(values)
        if w.optimizer is not None and block_state is not None:
            w.load_optimizer_state(block_state)
    if lr_schedule is not None:
        lr_schedule.load_state_dict(opt["lr_schedule"], source)
    torch.set_rng_state(opt["rng_state"])
    if opt.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(opt["cuda_rng_state"])


def save_checkpoint(directory: Path, step: int, model, engine, schedule, seed: int,
                    lr_schedule=None, ranks: Ranks = SINGLE, timeout_s: float = 60.0) -> Path:
    """Write step `step`'s checkpoint into `directory` (every rank calls it); its path."""
    from torch.distributed.checkpoint.api import CheckpointException

    from karma.schedule import schedule_sha256

    directory = Path(directory)
    final = directory / f"step_{step}"
    tmp = directory / f".step_{step}.tmp"
    engine.settle()  # the last step's updates, if still running, are part of the state
    try:
        if ranks.main:
            directory.mkdir(parents=True, exist_ok=True)
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir()
        process_group.barrier(ranks, f"starting the checkpoint of step {step}", timeout_s)
        scratch = tmp / f"scratch{ranks.rank}"
        scratch.mkdir()
        dcp_state.save(model, engine, ranks, tmp / dcp_state.STATE_DIR,
                       lambda t: _standalone(t.detach().cpu(), scratch))
        if ranks.main:
            _save(tmp / "extras.pt", _extras(model, engine, lr_schedule, ranks))
        scratch.rmdir()
        process_group.barrier(ranks, f"writing the checkpoint of step {step}", timeout_s)
        if ranks.main:
            meta = {"format": FORMAT, "step": step, "seed": seed,
                    "world_size": ranks.world_size,
                    "schedule_sha256": schedule_sha256(schedule),
                    "model_sha256": schedule.model.sha256, "complete": True}
            _write(tmp / "meta.json", json.dumps(meta, indent=2).encode())
            old = directory / f".step_{step}.old{os.getpid()}"
            replacing = final.exists()  # a rerun of the same step replaces it
            if replacing:
                os.replace(final, old)
            os.replace(tmp, final)  # step_N is gone only between these two renames
            _fsync_dir(directory)
            if replacing:
                shutil.rmtree(old)
    except (OSError, CheckpointException) as e:
        if ranks.main:
            shutil.rmtree(tmp, ignore_errors=True)
        cause = _os_error(e)
        if cause is None:
            raise KarmaError(f"cannot write checkpoint {final}: {_first_line(e)}") from e
        need = 2 * _state_bytes(model, engine) if cause.errno in NO_ROOM else None
        raise KarmaError(write_failure(
            "checkpoint", final, cause, need,
            "choose another --checkpoint-dir (--resume continues from the newest complete "
            "checkpoint)")) from e
    except BaseException:  # nothing half-written stays, even hidden
        if ranks.main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def _extras(model, engine, lr_schedule, ranks: Ranks) -> dict:
    """What a checkpoint holds besides tensors: extras.pt."""
    return {
        "format": FORMAT,
        "world_size": ranks.world_size,
        "state_keys": dcp_state.state_keys(model),
        "optimizers": [None if w.optimizer is None else type(w.optimizer).__name__
                       for w in engine.weights],
        "params": [list(w.names) for w in engine.weights],
        "param_groups": [None if w.optimizer is None else
                         [{k: v for k, v in g.items() if k != "params"}
                          for g in w.optimizer.param_groups] for w in engine.weights],
        "lr_schedule": None if lr_schedule is None else copy.deepcopy(lr_schedule.state_dict()),
        "rng_state": torch.get_rng_state(),
        "cuda_rng_state": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None,
    }


def _os_error(e: BaseException) -> OSError | None:
    """The OSError behind `e` (a CheckpointException wraps each rank's), if any."""
    if isinstance(e, OSError):
        return e
    for failure in getattr(e, "failures", {}).values():
        cause = failure[0] if isinstance(failure, tuple) else failure
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__cause__
        if cause is not None:
            return cause
    return None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[-1][:300] if text else type(e).__name__


def _state_bytes(model, engine) -> int:
    """About what a checkpoint's tensors take: the model's state and every optimizer's.
    (Writing one takes up to twice that: see [Note: saving views of the host tier].)"""
    tensors = list(model.state_dict().values())
    for w in engine.weights:
        if w.optimizer is not None:
            tensors += [v for st in w.optimizer.state.values() for v in st.values()
                        if isinstance(v, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def latest_checkpoint(directory: Path | None) -> Path | None:
    """The newest complete checkpoint in `directory`, or None."""
    if directory is None or not Path(directory).is_dir():
        return None
    best: tuple[int, Path] | None = None
    for d in Path(directory).glob("step_*"):
        try:
            meta = json.loads((d / "meta.json").read_text())
        except (OSError, ValueError):
            continue
        # what a complete checkpoint's meta.json says: its own step, as its name does
        if not isinstance(meta, dict) or meta.get("step") != _named_step(d):
            continue
        files = LEGACY_FILES if meta.get("format") == LEGACY_FORMAT else FILES
        if meta.get("complete") and all((d / f).is_file() for f in files):
            if best is None or meta["step"] > best[0]:
                best = (meta["step"], d)
    return best[1] if best else None


def _named_step(d: Path) -> int | None:
    """N of a directory named step_N, else None."""
    n = d.name.removeprefix("step_")
    return int(n) if n.isdigit() else None


def load_checkpoint(path: Path, model, engine, lr_schedule=None, ranks: Ranks = SINGLE,
                    schedule=None) -> int:
    """Restore model, optimizers, the LR schedule and RNG from `path`, written by any number
    of ranks; return its step."""
    from torch.distributed.checkpoint.api import CheckpointException

    where = f"checkpoint {path}"
    try:
        meta = json.loads((path / "meta.json").read_text())
        if meta.get("format") == LEGACY_FORMAT:
            return _load_legacy(path, meta, model, engine, lr_schedule)
        extras = torch.load(path / "extras.pt", weights_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise KarmaError(f"cannot read {where}: {_first_line(e)}; delete it to resume from the "
                         "one before") from e
    if schedule is not None and meta.get("model_sha256") not in (None, schedule.model.sha256):
        raise KarmaError(f"{where} was written by another model file (sha256 "
                         f"{str(meta['model_sha256'])[:12]}, this one's {schedule.model.sha256[:12]}); "
                         "resume with the model file that wrote it, or start without --resume")
    _check_optimizers(extras, engine, where)
    if [k for k, _ in extras.get("state_keys", ())] != list(model.state_dict()):
        raise KarmaError(f"{where} holds another model's entries; resume with the model file "
                         "that wrote it")
    engine.settle()  # nothing of the last step may still write what is loaded
    try:
        dcp_state.load(model, engine, ranks, path / dcp_state.STATE_DIR)
    except (CheckpointException, OSError, RuntimeError, ValueError, KeyError, EOFError,
            pickle.UnpicklingError) as e:
        if "Size mismatch" in str(e):  # DCP's words for a tensor of another shape
            raise KarmaError(f"{where} holds tensors of other shapes than this model's "
                             f"({_first_line(e)}); resume with the model file and the "
                             "environment that wrote it") from e
        raise KarmaError(f"cannot read the state of {where} ({_first_line(e)}): a shard is "
                         "missing or damaged; delete the checkpoint to resume from the one "
                         "before") from e
    for w, groups in zip(engine.weights, extras["param_groups"]):
        if w.optimizer is not None and groups is not None:
            for group, saved in zip(w.optimizer.param_groups, groups):
                # the hyperparameters; the kernel stays this run's (host_optimizer.py)
                group.update(hyperparameters(saved))
    _load_lr_and_rng(extras, lr_schedule, where)
    return int(meta["step"])


def _check_optimizers(extras: dict, engine, where: str) -> None:
    names = [None if w.optimizer is None else type(w.optimizer).__name__
             for w in engine.weights]
    if len(extras.get("optimizers", ())) != len(names):
        raise KarmaError(f"{where} was written for another model ({len(extras['optimizers'])} "
                         f"blocks, this one's {len(names)}); resume with the model that wrote it")
    for k, (saved, now) in enumerate(zip(extras["optimizers"], names)):
        if saved != now:
            raise KarmaError(f"{where} holds the state of a {saved} for block {k}, but the model "
                             f"file's make_optimizer makes a {now}; resume with the optimizer "
                             "that wrote it, or start without --resume")


def _load_lr_and_rng(extras: dict, lr_schedule, where: str) -> None:
    if (extras.get("lr_schedule") is None) != (lr_schedule is None):
        has = "has no" if lr_schedule is not None else "has an"
        raise KarmaError(f"{where} {has} LR schedule but the model file's make_scheduler "
                         f"{'is defined' if lr_schedule is not None else 'is not'}; load it "
                         "with the model file that wrote it")
    if lr_schedule is not None:
        lr_schedule.load_state_dict(extras["lr_schedule"], where)
    torch.set_rng_state(extras["rng_state"])
    if extras.get("cuda_rng_state") is not None:
        torch.cuda.set_rng_state(extras["cuda_rng_state"])


def _load_legacy(path: Path, meta: dict, model, engine, lr_schedule) -> int:
    """A checkpoint of the earlier format: model.pt and optimizer.pt, the state whole."""
    values = torch.load(path / "model.pt", weights_only=True)
    opt = torch.load(path / "optimizer.pt", weights_only=True)
    load_runtime_state({"model": values, "optimizer": opt}, model, engine, f"checkpoint {path}",
                       lr_schedule)
    return int(meta["step"])


def _detached_state(sd: dict | None, scratch: Path, snapshot: bool = False) -> dict | None:
    """An optimizer's state_dict, its tensors out of the host tier's arenas (_standalone)."""
    if sd is None:
        return None
    sd["state"] = {k: {n: _standalone(v.cpu(), scratch, snapshot) if isinstance(v, torch.Tensor) else v
                       for n, v in st.items()}
                   for k, st in sd["state"].items()}
    return sd


def _save(path: Path, obj) -> None:
    with replaced_atomically(path) as tmp, open(tmp, "wb") as f:
        out = _KeepsWriteErrors(f)
        try:
            torch.save(obj, out)
        except RuntimeError:
            if out.error is not None:  # the disk's answer, not the zip writer's
                raise out.error from None
            raise


class _KeepsWriteErrors:
    """A file for torch.save that keeps the OSError of a failed write: torch.save's zip
    writer turns it into a RuntimeError without the errno ("unexpected pos 704 vs 598"),
    and the errno says what to free (ENOSPC) or raise (EFBIG)."""

    def __init__(self, f):
        self._f = f
        self.error: OSError | None = None

    def write(self, data) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self._f.flush()


def _write(path: Path, data: bytes) -> None:
    with replaced_atomically(path) as tmp:
        tmp.write_bytes(data)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
