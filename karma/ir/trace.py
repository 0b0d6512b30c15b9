"""Trace a model file's model on the meta device into one flat torch.fx graph.

torch.export (training IR, non-strict) first; a module-level torch.fx trace is the fallback.
Nothing is allocated: the model and its example batch are built under `torch.device("meta")`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.fx
import torch.utils._pytree as pytree

from karma.errors import IRError
from karma.modelfile import ModelFile, ModelInputs, build_meta, check_signature, use_cache_off


@dataclass(frozen=True)
class Traced:
    """A traced model: the graph, the meta model it came from, and a meta batch."""

    gm: torch.fx.GraphModule  # every node carries meta["nn_module_stack"]
    model: torch.nn.Module  # the original model, on the meta device, in training mode
    inputs: ModelInputs  # meta tensors, as the model is called with them
    flat_inputs: tuple[torch.Tensor, ...]  # the same, in the order of gm's placeholders
    targets: object  # meta tensors, or None
    tracer: str  # "torch.export" or "torch.fx"
    out_spec: pytree.TreeSpec | None  # how gm's flat outputs make the model's output
    cache_turned_off: bool = False  # a Hugging Face model's use_cache was set to False

    def output(self, flat_out) -> object:
        """The model's output in its real structure (a ModelOutput, a dict, ...) from the
        graph's flat outputs."""
        if self.out_spec is None:  # torch.fx: the output node returned it as it is
            return flat_out[0] if len(flat_out) == 1 else tuple(flat_out)
        return pytree.tree_unflatten(list(flat_out), self.out_spec)


def trace(mf: ModelFile, batch_size: int) -> Traced:
    model, inputs, targets = build_meta(mf, batch_size)
    cache_off = use_cache_off(model)
    try:
        with _quiet_torch_logs(), _eager_attention_masks(inputs):
            ep = torch.export.export(model, inputs.args, inputs.kwargs, strict=False)
        gm = _drop_guards(ep.module())
        info = gm.graph._codegen.pytree_info  # noqa: SLF001 - export's own in/out specs
        return Traced(gm, model, inputs, _flat_inputs(inputs, info.in_spec), targets,
                      "torch.export", info.out_spec, cache_off)
    except Exception as export_error:  # noqa: BLE001 - fall back, then report the first error
        # a key the forward's **kwargs took (a misspelled input_ids) is the likelier cause
        check_signature(model, inputs, f"{mf.path}: example_batch({batch_size})",
                        failure=export_error)
        if inputs.kwargs:  # the torch.fx fallback takes positional tensors only
            raise _untraceable(mf.path, export_error) from export_error
        try:
            with _quiet_torch_logs():
                gm = torch.fx.symbolic_trace(model)
        except Exception:  # noqa: BLE001
            raise _untraceable(mf.path, export_error) from export_error
        return Traced(gm, model, inputs, inputs.args, targets, "torch.fx", None, cache_off)


@contextlib.contextmanager
def _eager_attention_masks(inputs: ModelInputs):
    """Hugging Face models decide under torch.export as they do in eager, for batches without
    a padding mask.

    In eager, transformers skips the attention mask of a batch without padding and calls SDPA
    with no mask (`is_causal=True` for a decoder; for grouped-query attention also
    `enable_gqa=True` on the unexpanded key and value heads). While exporting it builds an
    explicit [B, 1, T, T] boolean mask instead (`masking_utils._ignore_causal_mask_sdpa` and
    `_ignore_bidirectional_mask_sdpa` answer False under `is_torchdynamo_exporting()`, lest an
    exported model hard-code the decision) and, with a mask, repeats the key and value heads
    (`repeat_kv`): a graph that saves more than what karma-run executes, the eager model
    (SDPA saves a float copy of a boolean mask at every call). karma measures the graph and
    never deploys it, so the decision is made as in eager for batches without a padding mask;
    a padding mask (BERT, T5) is left as it is, and so is a sliding window shorter than the
    sequence (a mask in eager too). Likewise the check for packed sequences (position ids that
    restart within a row, which need a mask): eager reads the position ids, a trace cannot,
    so transformers assumes packing; when the batch passes no position ids the model makes
    them itself (0, 1, 2, ...), never packed, so the check answers "not packed" as eager
    would. Nothing happens unless the model imported transformers.
    """
    mu = sys.modules.get("transformers.masking_utils")
    names = ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa",
             "is_torchdynamo_exporting", "find_packed_sequence_indices")
    if mu is None or not all(hasattr(mu, name) for name in names):
        yield
        return
    originals = {name: getattr(mu, name) for name in names}
    exporting = originals["is_torchdynamo_exporting"]

    def as_in_eager(decide):
        def decide_as_in_eager(padding_mask, *args, **kwargs):
            if padding_mask is not None:
                return decide(padding_mask, *args, **kwargs)
            mu.is_torchdynamo_exporting = lambda: False
            try:
                return decide(padding_mask, *args, **kwargs)
            finally:
                mu.is_torchdynamo_exporting = exporting
        return decide_as_in_eager

    for name in ("_ignore_causal_mask_sdpa", "_ignore_bidirectional_mask_sdpa"):
        setattr(mu, name, as_in_eager(originals[name]))
    # position ids could come positionally only after input_ids and attention_mask
    if "position_ids" not in inputs.kwargs and len(inputs.args) < 3:
        mu.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(mu, name, original)


def _flat_inputs(inputs: ModelInputs, in_spec: pytree.TreeSpec) -> tuple[torch.Tensor, ...]:
    """The batch's tensors in the order of the exported graph's placeholders.

    torch.export flattens (args, kwargs) with the keyword arguments in the order its input
    spec records (the forward's parameter order), not the batch dict's.
    """
    kwargs_spec = in_spec.child(1)
    kwargs = {k: inputs.kwargs[k] for k in kwargs_spec.context}
    leaves, spec = pytree.tree_flatten((inputs.args, kwargs))
    if spec != in_spec:
        raise IRError(f"torch.export's input spec {in_spec} does not match the batch's {spec}")
    return tuple(leaves)


@contextlib.contextmanager
def _quiet_torch_logs():
    """torch.export logs and prints its failures at length; karma reports them in one line.

    (With --debug the command shows the exception's full traceback instead.)
    """
    logger = logging.getLogger("torch")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    sink = io.StringIO()
    try:
        with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            yield
    finally:
        logger.setLevel(level)


def _drop_guards(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """torch.export inserts an input-guard call (`_guards_fn`); it is not part of the model."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and str(node.target).startswith("_guards"):
            gm.graph.erase_node(node)
    gm.recompile()
    return gm


def retarget_device(gm: torch.fx.GraphModule, old: torch.device, new: torch.device) -> None:
    """Make the tensors gm's forward creates itself land on `new` where the trace baked in
    `old` (a graph exported on meta keeps `arange(T, device=meta)` from `device=x.device`)."""
    found = []

    def swap(value):
        if isinstance(value, torch.device) and value == old:
            found.append(value)
            return new
        return value

    for node in gm.graph.nodes:
        n = len(found)
        args, kwargs = torch.fx.node.map_aggregate((node.args, node.kwargs), swap)
        if len(found) > n:
            node.args, node.kwargs = args, kwargs
    if found:
        gm.recompile()


def _untraceable(path: Path, e: BaseException) -> IRError:
    """Where in the model file tracing failed and the fix. Data-dependent control flow has
    a known fix, so its first line is enough; any other failure carries the tracer's whole
    error, which is the only explanation the user gets."""
    text = str(e).strip() or type(e).__name__
    where = _location(e, path)
    if "data-dependent" in text.lower() or "guard" in text.lower():
        return IRError(
            f"cannot trace the model in {path}: {text.splitlines()[0][:300]}{where}; the "
            "model's forward has Python control flow that depends on tensor values (e.g. "
            "`if (x < 0).any():`); make the branch not depend on data, e.g. with torch.where")
    return IRError(f"cannot trace the model in {path}{where}; make its forward traceable by "
                   f"torch.export, whose error follows:\n{type(e).__name__}: {text}")


def _location(e: BaseException, path: Path) -> str:
    """' (at FILE:LINE: `code`)' for the innermost place in `path` that led to `e`."""
    path = Path(path).resolve()
    frames = [f for f in traceback.extract_tb(e.__traceback__) if Path(f.filename) == path]
    if frames:
        f = frames[-1]
        return f" (at {f.filename}:{f.lineno}: `{(f.line or '').strip()}`)"
    # torch.export reports the user's frames in its message
    matches = re.findall(rf'File "?({re.escape(str(path))})"?, line (\d+)', str(e))
    if matches:
        file, line = matches[-1]
        code = _line_of(Path(file), int(line))
        return f" (at {file}:{line}: `{code}`)"
    return ""


def _line_of(path: Path, lineno: int) -> str:
    try:
        return path.read_text().splitlines()[lineno - 1].strip()
    except (OSError, IndexError):
        return ""
