"""Atomic checkpoints: DIR/step_N/{model.pt, optimizer.pt, meta.json}.

A checkpoint is written into a hidden temporary directory, each file to a temporary name that
is renamed when complete, and the directory is renamed to step_N last: a run killed at any
moment leaves either a complete checkpoint or none. model.pt is a state_dict with exactly the
keys of build_model().state_dict() (it loads into a fresh model, with weights_only=True);
optimizer.pt holds each block's optimizer state, the LR schedule's (lr.py) and the RNG
state; meta.json says what the checkpoint is.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from karma.errors import KarmaError
from karma.fileio import NO_ROOM, write_failure
from karma.runtime.shard import ShardedWeights

FORMAT = "karma-checkpoint-1"
FILES = ("model.pt", "optimizer.pt", "meta.json")


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
                    lr_schedule=None) -> Path:
    from karma.schedule import schedule_sha256

    directory = Path(directory)
    final = directory / f"step_{step}"
    tmp = directory / f".step_{step}.tmp{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        scratch = tmp / "scratch"
        scratch.mkdir()
        state = runtime_state(model, engine, scratch, lr_schedule=lr_schedule)
        _save(tmp / "model.pt", state["model"])
        _save(tmp / "optimizer.pt", state["optimizer"])
        del state
        scratch.rmdir()
        meta = {"format": FORMAT, "step": step, "seed": seed,
                "schedule_sha256": schedule_sha256(schedule),
                "model_sha256": schedule.model.sha256, "complete": True}
        _write(tmp / "meta.json", json.dumps(meta, indent=2).encode())
        if final.exists():  # a rerun of the same step replaces it
            old = directory / f".step_{step}.old{os.getpid()}"
            os.replace(final, old)
            shutil.rmtree(old)
        os.replace(tmp, final)
        _fsync_dir(directory)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        need = 2 * _state_bytes(model, engine) if e.errno in NO_ROOM else None
        raise KarmaError(write_failure(
            "checkpoint", final, e, need,
            "choose another --checkpoint-dir (--resume continues from the newest complete "
            "checkpoint)")) from e
    except BaseException:  # nothing half-written stays, even hidden
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


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
        if meta.get("complete") and all((d / f).is_file() for f in FILES):
            if best is None or meta["step"] > best[0]:
                best = (int(meta["step"]), d)
    return best[1] if best else None


def load_checkpoint(path: Path, model, engine, lr_schedule=None) -> int:
    """Restore model, optimizers, the LR schedule and RNG from `path`; return its step."""
    try:
        meta = json.loads((path / "meta.json").read_text())
        values = torch.load(path / "model.pt", weights_only=True)
        opt = torch.load(path / "optimizer.pt", weights_only=True)
    except (OSError, ValueError, RuntimeError) as e:
        raise KarmaError(f"cannot read checkpoint {path}: {e}; delete it to resume from the "
                         "one before") from e
    load_runtime_state({"model": values, "optimizer": opt}, model, engine, f"checkpoint {path}",
                       lr_schedule)
    return int(meta["step"])


def share_optimizer_states(engine) -> None:
    """On a rank that does not write the checkpoint: the collectives rank 0's runtime_state
    runs to gather sharded optimizer states (shard.py), in the same order."""
    engine.settle()
    for w in engine.weights:
        if isinstance(w, ShardedWeights):
            w.optimizer_state()


def _detached_state(sd: dict | None, scratch: Path, snapshot: bool = False) -> dict | None:
    """An optimizer's state_dict, its tensors out of the host tier's arenas (_standalone)."""
    if sd is None:
        return None
    sd["state"] = {k: {n: _standalone(v.cpu(), scratch, snapshot) if isinstance(v, torch.Tensor) else v
                       for n, v in st.items()}
                   for k, st in sd["state"].items()}
    return sd


def _save(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        out = _KeepsWriteErrors(f)
        try:
            torch.save(obj, out)
        except RuntimeError:
            if out.error is not None:  # the disk's answer, not the zip writer's
                raise out.error from None
            raise
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


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
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
