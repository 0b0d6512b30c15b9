"""A checkpoint as plain files: the model's state_dict, and with it the optimizer state.

    export_checkpoint("ckpt", "model.pt")                   # the newest complete checkpoint
    export_checkpoint("ckpt/step_40", "model.safetensors", optimizer=True)

The model file holds exactly the keys of build_model().state_dict() (tied weights under each
of their names), so `model.load_state_dict(torch.load(FILE, weights_only=True))` of the
user's own model takes it; a Hugging Face model's keys are its own, so `save_pretrained`
after that loading writes a directory `from_pretrained` reads. The optimizer state is read
whole from the ranks' shards by torch.distributed.checkpoint's own loader
(dcp_state.consolidated_optimizer) and written beside the
model as FILE's stem + ".optimizer.pt": {"state": {parameter name: {entry: tensor}},
"param_groups": each block's hyperparameters, "optimizers": their classes, "params": each
block's parameter names}. Every file is written to a temporary name and renamed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from karma.errors import KarmaError
from karma.fileio import replaced_atomically
from karma.runtime.checkpoints import checkpoint, dcp_state

FORMATS = ("torch", "safetensors")


def export_checkpoint(source: str | Path, output: str | Path, optimizer: bool = False,
                      fmt: str | None = None) -> list[Path]:
    """Write `source`'s model (and with `optimizer` its optimizer state) as plain files;
    `source` is a checkpoint directory (its newest complete checkpoint) or one step_N.
    fmt: "torch" or "safetensors" (default: by `output`'s suffix). Returns the paths."""
    step_dir = resolve(Path(source))
    output = Path(output)
    fmt = fmt or ("safetensors" if output.suffix == ".safetensors" else "torch")
    if fmt not in FORMATS:
        raise KarmaError(f"export format {fmt!r} is not one karma writes; use torch or "
                         "safetensors")
    if not output.parent.is_dir():
        raise KarmaError(f"-o {output}: directory {output.parent} does not exist; create it")
    written = [_write_model(model_state_dict(step_dir), output, fmt)]
    if optimizer:
        written.append(_write_optimizer(step_dir, output))
    return written


def model_state_dict(step_dir: Path) -> dict[str, torch.Tensor]:
    """A checkpoint's model, whole: the keys of build_model().state_dict(), in its order."""
    try:
        meta = json.loads((step_dir / "meta.json").read_text())
        if meta.get("format") == checkpoint.LEGACY_FORMAT:
            return torch.load(step_dir / "model.pt", weights_only=True)
        extras = torch.load(step_dir / "extras.pt", weights_only=True)
        return dcp_state.consolidated_model(step_dir / dcp_state.STATE_DIR,
                                            [tuple(k) for k in extras["state_keys"]])
    except Exception as e:  # noqa: BLE001 - DCP's errors name no type of their own
        raise KarmaError(f"cannot read the model of {step_dir} ({e}); export another "
                         "checkpoint") from e


def resolve(source: Path) -> Path:
    """The step directory to export: `source` itself if it is a complete checkpoint, else
    the newest complete one inside it."""
    if (source / "meta.json").is_file():
        try:
            meta = json.loads((source / "meta.json").read_text())
        except (OSError, ValueError) as e:
            raise KarmaError(f"{source} is not a complete checkpoint ({e})") from e
        if not meta.get("complete"):
            raise KarmaError(f"{source} is not a complete checkpoint (its writer stopped "
                             "before the end); export another one")
        return source
    found = checkpoint.latest_checkpoint(source)
    if found is None:
        raise KarmaError(f"{source} holds no complete checkpoint (step_N with its meta.json); "
                         "give a checkpoint directory that karma-run --checkpoint-dir wrote")
    return found


def _write_model(model: dict[str, torch.Tensor], output: Path, fmt: str) -> Path:
    if fmt == "torch":
        checkpoint._save(output, model)  # noqa: SLF001 - the one atomic torch.save
        return output
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise KarmaError("--safetensors needs the safetensors package: pip install "
                         "safetensors") from e
    seen: set[int] = set()
    plain = {}
    for name, t in model.items():  # safetensors refuses tensors that share memory
        ptr = t.untyped_storage().data_ptr()
        plain[name] = t.clone() if ptr in seen else t.contiguous()
        seen.add(ptr)
    with replaced_atomically(output) as tmp:
        save_file(plain, str(tmp))
    return output


def _write_optimizer(step_dir: Path, output: Path) -> Path:
    meta = json.loads((step_dir / "meta.json").read_text())
    if meta.get("format") != checkpoint.FORMAT:
        raise KarmaError(f"{step_dir} is of the earlier format, whose optimizer.pt is the "
                         "state already: copy it, or export a checkpoint written since")
    extras = torch.load(step_dir / "extras.pt", weights_only=True)
    try:
        state = dcp_state.consolidated_optimizer(step_dir / dcp_state.STATE_DIR)
    except Exception as e:  # noqa: BLE001 - DCP's errors name no type of their own
        raise KarmaError(f"cannot read the optimizer state of {step_dir} ({e}); export "
                         "another checkpoint") from e
    path = output.with_name(output.name.split(".")[0] + ".optimizer.pt")
    checkpoint._save(path, {"state": state, "param_groups": extras["param_groups"],  # noqa: SLF001
                            "optimizers": extras["optimizers"],
                            "params": extras.get("params")})
    return path
