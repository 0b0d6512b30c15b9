"""Block times: every distinct block's forward, backward and selective recompute and the
model file's optimizer stepping its weights, measured on this machine and cached.

The cache key: the machine, the model file's code (its syntax tree: a comment or a
reformatted line measures nothing again; karma/fingerprint.py, code_sha256) and KARMA_*
environment, the block graph's hash, the batch size, the dtype, --blocks, and whether the
times were taken in a keep_all step (in_context.py) or block by block (karma.ir.timing).

[Note: timing at a smaller batch] Timing every block at the plan's batch can take minutes on
a CPU (GPT-2 small's output layer alone does 1.9 TFLOP per step at batch 8). Blocks are timed
at the largest batch whose roofline estimate from the profile given (not the measured one:
a quick matmul's rate varies threefold between runs on a shared machine), one forward and
backward of each distinct block, stays under _TIMING_BUDGET_S, and their times (the
selective recompute's too) are scaled by the plan's batch over that one. A block's work is
proportional to its batch, so this is close
once a batch fills the device; what does not grow with the batch (per-call overheads, an
embedding's dense weight gradient) is scaled up too, which errs slow. GPT-2 small (sequence
1024) on the 2-core machine: timed at batch 2, its layers' time per sample is 1.445 s against
1.211 s at batch 4 (1.380 s at batch 1); its output layer's 5.06 s against 4.72 s.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from karma.calibrate.cache import read
from karma.calibrate.machine import allocating_as_the_runtime_does, machine_key
from karma.errors import KarmaError
from karma.fingerprint import code_sha256
from karma.ir.graph import BlockGraph
from karma.ir.timing import BlockTimes, time_blocks
from karma.modelfile import ModelFile
from karma.planner.problem import Measurements
from karma.schedule import model_env

_TIMING_BUDGET_S = 15.0  # see [Note: timing at a smaller batch]
# the blocks' forwards and selective recomputes timed alone, for their ratio in context: see
# [Note: the selective recompute in context] in in_context.py
_RATIO_BUDGET_S = 5.0


@dataclass(frozen=True)
class Timed:
    """What timing a model's blocks measured, and how."""

    fwd_bwd_s: tuple[tuple[float, float], ...]  # per block
    step_s: tuple[tuple[float, float], ...]  # (device s, host s) of each block's optimizer step
    process_bytes: int  # Measurements.process_bytes
    where: str  # "in a keep_all step" or "block by block"
    loss_s: float | None = None  # the loss's forward and backward (in context), else None
    # the side streams' contention fractions and wait (Hardware fields) fitted to a probe's
    # steps (in context: [Note: side streams timed in context] in planner/fit_contention.py),
    # else None
    side_streams: dict[str, float] | None = None
    # per block, its selective recompute's seconds by policy (those that ran it), or None:
    # not timed (Measurements.selective_s)
    selective_s: tuple[dict[str, float], ...] | None = None

    @property
    def measured(self) -> Measurements:
        """What the planner takes from it."""
        return Measurements(tuple(map(tuple, self.fwd_bwd_s)), tuple(map(tuple, self.step_s)),
                            self.process_bytes, self.loss_s,
                            None if self.selective_s is None else tuple(self.selective_s))


def blocks_key(mf: ModelFile, graph: BlockGraph, device: str, blocks_regex: str | None,
               in_context: bool, host_optimizer: str = "fused") -> dict:
    """Everything a model's block times depend on (`host_optimizer`: the host kernel, whose
    steps a probe's side streams are fitted beside)."""
    return {
        "machine": machine_key(device),
        "model_code_sha256": code_sha256(mf),
        "env": [list(kv) for kv in model_env()],
        "graph_sha256": hashlib.sha256(graph.to_json().encode()).hexdigest(),
        "batch_size": graph.batch_size,
        "dtype": graph.dtype,
        "blocks": blocks_regex,
        "in_context": in_context,
        "host_optimizer": host_optimizer,
    }


def read_times(path: Path, n_blocks: int) -> Timed | None:
    """The block times cached in `path`, or None when they do not check out."""
    data = read(path)
    try:
        times = tuple((float(f), float(b)) for f, b in data["fwd_bwd_s"])
        steps = tuple((float(d), float(h)) for d, h in data["step_s"])
        process_bytes = data["process_bytes"]
        where = str(data["where"])
        loss_s = None if data.get("loss_s") is None else float(data["loss_s"])
        side = data.get("side_streams")
        side = None if side is None else {str(k): float(v) for k, v in side.items()}
        selective = data["selective_s"]  # a file without it holds other numbers: measure
        selective = None if selective is None else tuple(
            {str(policy): float(s) for policy, s in by_policy.items()}
            for by_policy in selective)
    except (KeyError, TypeError, ValueError, AttributeError):
        return None
    ok = (len(times) == len(steps) == n_blocks
          and all(math.isfinite(t) and t >= 0 for p in (*times, *steps) for t in p)
          and isinstance(process_bytes, int) and process_bytes >= 0
          and (loss_s is None or (math.isfinite(loss_s) and loss_s >= 0))
          and (side is None or all(0 <= v < 1 for v in side.values()))
          and (selective is None or (len(selective) == n_blocks and all(
              math.isfinite(s) and s >= 0 for by in selective for s in by.values()))))
    return Timed(times, steps, process_bytes, where, loss_s, side, selective) if ok else None


def timed_alone(mf: ModelFile, graph: BlockGraph, roofline_s: Sequence[float], device: str,
                blocks_regex: str | None, path: Path, say: Callable[[str], None],
                remeasure: bool = False) -> tuple[Timed, dict]:
    """Every distinct block timed by itself (karma.ir.timing), at the batch `timing_batch`
    picks from the profile's roofline estimate `roofline_s`, scaled to the graph's batch, and
    how (the batch timed, the number of distinct blocks), which their cache file records.
    `path`: the cache file, named in the log."""
    batch = timing_batch(graph, roofline_s)
    say(f"timing the blocks of {graph.model} on this machine ({device}, batch {batch}"
        + (f", scaled to {graph.batch_size}" if batch != graph.batch_size else "")
        + f"; {'again' if remeasure else 'once'}, cached in {path})")
    timed = _time_graph_blocks(mf, graph, batch, device, blocks_regex, log=say)
    scale = graph.batch_size / batch
    times = tuple((fwd * scale, bwd * scale) for fwd, bwd in timed.fwd_bwd_s)
    selective = tuple({policy: s * scale for policy, s in by.items()}
                      for by in timed.selective_s)
    steps = tuple(_owned_share(b.param_bytes, stepped, step)
                  for b, stepped, step in zip(graph.blocks, timed.stepped_bytes, timed.step_s))
    how = {"timed_batch_size": batch, "distinct_blocks": timed.distinct}
    return Timed(times, steps, 0, "block by block", selective_s=selective), how


def selective_ratios(mf: ModelFile, graph: BlockGraph, roofline_s: Sequence[float],
                     device: str, blocks_regex: str | None, say: Callable[[str], None]
                     ) -> tuple[dict[str, float], ...]:
    """Each block's selective recompute over its forward, by policy, both timed alone
    (karma.ir.timing, forward only) at the batch `timing_batch` picks within _RATIO_BUDGET_S;
    a policy that cannot run the block left out ([Note: the selective recompute in context]
    in in_context.py)."""
    batch = timing_batch(graph, roofline_s, _RATIO_BUDGET_S)
    say(f"timing the forwards and selective recomputes of {graph.model}'s blocks alone "
        f"({device}, batch {batch}) for their ratio")
    timed = _time_graph_blocks(mf, graph, batch, device, blocks_regex, forward_only=True)
    return tuple({policy: s / fwd for policy, s in by.items()} if fwd > 0 else {}
                 for (fwd, _), by in zip(timed.fwd_bwd_s, timed.selective_s))


def _time_graph_blocks(mf: ModelFile, graph: BlockGraph, batch: int, device: str,
                       blocks_regex: str | None, **how) -> BlockTimes:
    """time_blocks of `graph`'s model at `batch`, with the selective policies the graph
    offers, under the runtime's allocator; a KarmaError where it finds other blocks."""
    with allocating_as_the_runtime_does(device):
        timed = time_blocks(mf, batch, blocks_regex, device, graph.dtype,
                            policies=policies_of(graph), **how)
    if timed.names != tuple(b.name for b in graph.blocks):
        raise KarmaError(f"timing {graph.model} at batch {batch} found the blocks "
                         f"{', '.join(timed.names)}, not the plan's; plan with --no-measure")
    return timed


def policies_of(graph: BlockGraph) -> tuple[tuple[str, ...], ...]:
    """Per block, the selective policies the block graph offers it: those timed."""
    return tuple(tuple(s.policy for s in b.selective) for b in graph.blocks)


def timing_batch(graph: BlockGraph, roofline_s: Sequence[float],
                 budget_s: float = _TIMING_BUDGET_S) -> int:
    """The batch to time blocks at, from each block's forward and backward seconds by the
    profile's roofline: the largest whose distinct blocks take `budget_s` at most (see [Note:
    timing at a smaller batch])."""
    distinct = {}
    for b, seconds in zip(graph.blocks, roofline_s):
        shape = (b.param_bytes, b.act_bytes, b.out_bytes, b.fwd_flops, b.bwd_flops)
        distinct[shape] = seconds
    estimate_s = sum(distinct.values())
    if estimate_s <= budget_s:
        return graph.batch_size
    return max(1, math.floor(graph.batch_size * budget_s / estimate_s))


def _owned_share(param_bytes: int, stepped_bytes: int, step_s: tuple[float, float]
                 ) -> tuple[float, float]:
    """A block's optimizer step for the weights it owns (`param_bytes`), from the step timed
    over every weight it uses (`stepped_bytes`, a tied weight's owner's too). The step does
    not grow with the batch: it is not scaled by it."""
    if stepped_bytes <= 0 or param_bytes <= 0:
        return 0.0, 0.0
    share = min(param_bytes / stepped_bytes, 1.0)
    return step_s[0] * share, step_s[1] * share
