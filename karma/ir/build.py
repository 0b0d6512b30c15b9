"""A model file's block graph: traced on the meta device, grouped into blocks, measured.

    graph = build_block_graph(load_model_file("examples/gpt.py"), batch_size=8)
    print(graph.table())
"""

from __future__ import annotations

import torch

from karma.errors import IRError, KarmaError
from karma.ir.blocks import find_units, group_nodes
from karma.ir.compute import Compute
from karma.ir.graph import Block, BlockGraph, Edge
from karma.ir.measure import measure_blocks, saved_bytes
from karma.ir.trace import trace
from karma.modelfile import USE_CACHE_NOTE, ModelFile, user_frame

__all__ = ["build_block_graph"]


def build_block_graph(mf: ModelFile, batch_size: int | None = None,
                      blocks_regex: str | None = None, model_name: str | None = None,
                      dtype: str = "fp32") -> BlockGraph:
    """Trace the model file's model on the meta device and measure its blocks as training in
    `dtype` runs them: fp32, or bf16 (mixed precision: forward and loss under autocast; see
    [Note: measuring under autocast] in karma/ir/compute.py)."""
    batch_size = batch_size or mf.default_batch_size
    compute = Compute(dtype)
    traced = trace(mf, batch_size)
    gm = traced.gm
    specs = group_nodes(gm, find_units(traced.model, blocks_regex))
    try:
        measured = measure_blocks(gm, specs, traced.flat_inputs, compute)
    except Exception as e:  # noqa: BLE001 - name the stage that failed
        where = "the meta device" if dtype == "fp32" else f"fake CPU tensors under {dtype} autocast"
        raise IRError(f"measuring the blocks of {mf.path} on {where} failed: "
                      f"{type(e).__name__}: {str(e)[:300]}") from e

    params = dict(gm.named_parameters())  # unique parameters, first name of each
    # loss_fn sees the output as karma-run will hand it over: in its real structure (a
    # ModelOutput, a dict, a tuple, ...), every floating-point tensor requiring grad
    output = traced.output([_grad_leaf(t) for t in measured.flat_output])
    loss_act_bytes = _loss_saved_bytes(mf, output, compute.tree(traced.targets), compute)

    owner = {p: i for i, spec in enumerate(specs) for p in spec.params}
    blocks = tuple(
        Block(
            index=i,
            name=spec.name,
            modules=spec.modules,
            params=spec.params,
            shared_params=spec.shared_params,
            shared_from=_shared_from(spec.shared_params, owner, params),
            param_bytes=sum(_nbytes(params[p]) for p in spec.params),
            act_bytes=fig.act_bytes,
            out_bytes=fig.out_bytes,
            fwd_flops=fig.fwd_flops,
            bwd_flops=fig.bwd_flops,
            fwd_temp_bytes=fig.fwd_temp_bytes,
            bwd_temp_bytes=fig.bwd_temp_bytes,
            max_param_bytes=max((_nbytes(params[p]) for p in spec.params), default=0),
            selective=fig.selective,
            one_call=spec.one_call,
        )
        for i, (spec, fig) in enumerate(zip(specs, measured.blocks))
    )
    edges = tuple(Edge(src, dst, nbytes) for (src, dst), nbytes in sorted(measured.edges.items()))
    return BlockGraph(
        model=model_name or str(mf.path),
        batch_size=batch_size,
        total_param_bytes=sum(_nbytes(p) for p in params.values()),
        input_bytes=sum(_nbytes(t) for t in traced.inputs.tensors()),
        loss_act_bytes=loss_act_bytes,
        blocks=blocks,
        edges=edges,
        tracer=traced.tracer,
        shared_saved=measured.shared_saved,
        notes=(USE_CACHE_NOTE,) if traced.cache_turned_off else (),
        dtype=dtype,
    )


def _grad_leaf(t):
    if isinstance(t, torch.Tensor) and (t.is_floating_point() or t.is_complex()):
        return t.detach().requires_grad_(True)
    return t


def _loss_saved_bytes(mf: ModelFile, output, targets, compute: Compute) -> int:
    """The bytes loss_fn saves for backward (under autocast for bf16, as training computes
    the loss); checks that it returns a differentiable scalar."""
    try:
        with compute.forward():
            loss, nbytes = saved_bytes(mf.loss_fn, output, targets)
    except KarmaError:
        raise
    except Exception as e:  # noqa: BLE001 - user code
        raise IRError(f"{mf.path}: loss_fn(output, targets) failed on the model's output "
                      f"({type(output).__name__}): {type(e).__name__}: {e}"
                      f"{user_frame(e, mf.path)}") from e
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        what = (f"a tensor of shape {tuple(loss.shape)}" + ("" if loss.requires_grad else
                " that does not require grad") if isinstance(loss, torch.Tensor)
                else type(loss).__name__)
        raise IRError(f"{mf.path}: loss_fn(output, targets) returned {what}; return a scalar "
                      "tensor computed from the model's output")
    return nbytes


def _shared_from(names: tuple[str, ...], owner: dict[str, int],
                 params: dict[str, torch.Tensor]) -> tuple[tuple[int, int], ...]:
    per_owner: dict[int, int] = {}
    for name in names:
        per_owner[owner[name]] = per_owner.get(owner[name], 0) + _nbytes(params[name])
    return tuple(sorted(per_owner.items()))


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
