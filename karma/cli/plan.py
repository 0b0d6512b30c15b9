"""karma-plan: plan out-of-core training of a model file into a schedule.

    karma-plan examples/gpt.py --gpu-mem 800M -o schedule.yaml   # for this machine
    KARMA_GPT=xl karma-plan examples/gpt.py --hardware v100-16g --gpu-mem 16G --json
    karma-plan examples/gpt.py --print-ir            # the block graph only

Exit codes: 0 planned; 2 bad input; 3 no plan fits the budget (the message gives the smallest
--gpu-mem that would).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from decimal import ROUND_CEILING, Decimal
from pathlib import Path

from karma.cli import capacity
from karma.cli.common import check_writable, huge_pages_for_large_tensors, positive_int, run_cli
from karma.errors import KarmaError
from karma.logs import note
from karma.planner.options import BATCH_CHOICES, PlanOptions
from karma.schedule import HOST_OPTIMIZERS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="karma-plan",
        description="Plan out-of-core training for a model file (see README: model files).",
    )
    p.add_argument("model", help="a model file: a Python file defining build_model() and "
                                 "example_batch(batch_size)")
    _hardware_flags(p)
    _training_flags(p)
    _solver_flags(p)
    _output_flags(p)
    return p


def _hardware_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gpu-mem", metavar="SIZE",
                   help="device memory budget, e.g. 16G (with --hardware cpu: the budget of "
                        "the process's private memory)")
    p.add_argument("--hardware", default=None, metavar="NAME|FILE",
                   help="a built-in profile (v100-16g, a100-40g, a100-80g, h100-80g, "
                        "h200-141g, cpu) or a file from karma-profile (default: this machine, "
                        "said in one line: cpu where there is no GPU, else the GPU's built-in "
                        "profile, or the GPU measured where no built-in profile is it)")
    p.add_argument("--world-size", type=positive_int, default=1, help="ranks (default 1)")
    p.add_argument("--nproc-per-node", type=positive_int, default=None, metavar="N",
                   help="ranks per node, sharing its host memory (default: the profile's "
                        "devices per node, at most --world-size; with --hardware cpu, "
                        "every rank)")
    p.add_argument("--host-mem", metavar="SIZE", default=None,
                   help="the node's host memory, e.g. 384G (default: the profile's); pinned "
                        "memory is scaled alike")
    p.add_argument("--host-state", default="auto", metavar="auto|sharded|replicated",
                   help="host master weights, gradients and optimizer state: sharded across "
                        "the ranks, or a whole copy on each (default auto: sharded on several "
                        "ranks unless replicated fits and is faster)")
    p.add_argument("--host-optimizer", choices=HOST_OPTIMIZERS, default="fused",
                   help="the kernel of blocks stepped on the host: fused (default), torch's "
                        "fused CPU kernel where the model file's optimizer (Adam, AdamW, SGD, "
                        "Adagrad) asks for none: several times faster than its default for "
                        "CPU tensors, and not bitwise equal to it (an ulp here and there, "
                        "carried on by training); as-given, the model file's optimizer "
                        "exactly as it is made, bitwise the plain loop")
    measure = p.add_mutually_exclusive_group()
    measure.add_argument("--no-measure", dest="measure", action="store_const",
                         const="estimate", default="cached",
                         help="estimate block times from FLOPs and bytes (roofline) even when "
                              "--hardware is this machine, where they are measured by default "
                              "(once; cached in ~/.cache/karma)")
    measure.add_argument("--remeasure", dest="measure", action="store_const", const="fresh",
                         help="measure this machine and the blocks again instead of reading "
                              "them from the cache (a shared machine's speed drifts); only for "
                              "a profile of this machine, and a failure to time the blocks "
                              "is then an error, not the roofline estimate")


def _training_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-size", type=_batch_size, default=None,
                   help="samples per step and rank (default: the model file's BATCH_SIZE, or "
                        "8); max or best: the largest batch that fits, or the fastest")
    p.add_argument("--dtype", default="fp32", metavar="fp32|bf16",
                   help="bf16: mixed precision (autocast compute, fp32 weights and optimizer)")
    p.add_argument("--accumulate", type=int, default=1, metavar="N",
                   help="micro-batches per optimizer step (gradient accumulation; default 1)")
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="X",
                   help="clip gradients to global norm X, as torch.nn.utils.clip_grad_norm_")
    p.add_argument("--seed", type=int, default=0, help="training seed recorded in the schedule")
    p.add_argument("--blocks", metavar="REGEX", default=None,
                   help="module paths whose calls are blocks, e.g. 'h\\.\\d+' "
                        "(default: every call of a repeated layer)")


def _solver_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", default="ilp",
                   help="ilp (default) or a baseline: keep_all, recompute_all, selective_all, "
                        "swap_all, offload_all, greedy")
    p.add_argument("--time-limit", type=float, default=60.0, metavar="S",
                   help="ILP time limit in seconds (default 60)")
    p.add_argument("--gap", type=float, default=0.01,
                   help="relative optimality gap at which the ILP stops (default 0.01)")
    p.add_argument("--no-selective", dest="selective", action="store_false",
                   help="plan without selective recompute (keeping what a block's matmuls "
                        "return and recomputing the rest), as before it existed")
    p.add_argument("--no-pairs", dest="pairs", action="store_false",
                   help="plan no two blocks recomputed under one checkpoint (a block's output "
                        "then held from the next block's forward to its backward when that "
                        "block recomputes)")


def _output_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sweep", action="append", metavar="QUANTITY=RANGE",
                   help="plan at every point of gpu-mem=4G:24G:2G (from:to:step), or "
                        "batch-size=1:64 (doubling; from:to:step adds step), or a list "
                        "(gpu-mem=8G,16G): a table of every point, each baseline beside it")
    p.add_argument("--plot", metavar="FILE.png", default=None,
                   help="with --sweep: draw samples/s against the swept quantity, a line per "
                        "strategy")
    p.add_argument("-o", "--output", metavar="FILE", help="write the schedule YAML here")
    p.add_argument("--print-ir", action="store_true",
                   help="print the block graph (blocks, sizes, FLOPs, edges) and exit")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")


def _batch_size(text: str) -> int | str:
    """A batch size: a positive whole number, or max or best (searched: karma.api)."""
    return text if text in BATCH_CHOICES else positive_int(text)


def options_from(args: argparse.Namespace, hardware: str | None = None) -> PlanOptions:
    """karma-plan's flags as the one PlanOptions every command path plans with (checked
    here, once: a bad value is one line before anything is traced); `hardware`: one of the
    profiles of --hardware A,B,C (capacity.compare_hardware plans on each)."""
    return PlanOptions(
        gpu_mem=args.gpu_mem, hardware=hardware or args.hardware,
        batch_size=args.batch_size,
        world_size=args.world_size, nproc_per_node=args.nproc_per_node,
        host_mem=args.host_mem, host_state=args.host_state, dtype=args.dtype,
        accumulate=args.accumulate, clip_grad_norm=args.clip_grad_norm,
        strategy=args.strategy, seed=args.seed, time_limit_s=args.time_limit, gap=args.gap,
        blocks=args.blocks, measure=args.measure, host_optimizer=args.host_optimizer,
        selective=args.selective, pairs=args.pairs)


def _plan(args: argparse.Namespace) -> int:
    if args.plot and not args.sweep:
        raise KarmaError("--plot draws a sweep: give --sweep too (karma-inspect --plot draws "
                         "one schedule)")
    if args.hardware and "," in args.hardware:
        return capacity.compare_hardware(args, lambda name: options_from(args, name))
    options = options_from(args)
    if not args.print_ir:  # the block graph is the same on any hardware
        for line in options.machine_notes:
            print(f"karma-plan: {line}", file=sys.stderr)
    if args.sweep:
        return capacity.sweep(args, options)
    if args.print_ir:
        return _print_ir(args, options)
    return _plan_one(args, options)


def _print_ir(args: argparse.Namespace, options: PlanOptions) -> int:
    from karma.ir.build import build_block_graph
    from karma.modelfile import load_model_file

    if options.searches_batch:
        raise KarmaError(f"--print-ir prints the block graph at one batch size: give a number "
                         f"for --batch-size, not {options.batch_size}")
    mf = load_model_file(args.model)
    graph = build_block_graph(mf, options.batch_size, options.blocks, model_name=args.model,
                              dtype=options.dtype)
    for text in graph.notes:
        note(text)
    print(graph.to_json() if args.json else graph.table())
    return 0


def _plan_one(args: argparse.Namespace, options: PlanOptions) -> int:
    """One schedule: planned (--batch-size max|best: at the batch searched), written (-o)
    and summarized. (Without --gpu-mem, plan_report says so before tracing.)"""
    from karma.api import plan_report
    from karma.planner.plan import InfeasiblePlan

    if args.output:  # before anything is traced
        check_writable(Path(args.output), "-o", "schedule.yaml")
    try:
        report = plan_report(args.model, options)
    except InfeasiblePlan as e:
        if args.json:
            print(json.dumps({"feasible": False, "capacity_bytes": options.capacity_bytes,
                              "min_capacity_bytes": e.min_capacity_bytes,
                              "resource": e.resource}, indent=2))
        if e.resource != "device":
            raise
        raise InfeasiblePlan(
            f"{e}. Try --gpu-mem {at_least(e.min_capacity_bytes, args.gpu_mem)}"
            + (" or a smaller --batch-size" if e.batch_size > 1 else ""),
            e.min_capacity_bytes) from e

    if args.output:
        report.schedule.save(args.output)
    print(json.dumps(report.to_json(), indent=2) if args.json else report.text(args.output))
    return 0


def at_least(nbytes: int, given: str | None) -> str:
    """A --gpu-mem value of at least `nbytes`, in the unit of `given` (the --gpu-mem that did
    not fit), rounded up to two significant digits: 32M for 31.3 MiB given 20M, 0.031G given
    0.02G, 22G for 21.4 GiB; a plain number of bytes where `given` was one."""
    unit = re.search(r"[KMGT]", (given or "G").upper())
    if unit is None:
        return str(nbytes)
    value = Decimal(nbytes) / 1024 ** ("KMGT".index(unit[0]) + 1)
    quantum = Decimal(1).scaleb(value.adjusted() - 1)  # two significant digits
    rounded = (value / quantum).to_integral_value(rounding=ROUND_CEILING) * quantum
    return f"{rounded.normalize():f}{unit[0]}"


def main(argv: list[str] | None = None) -> int:
    huge_pages_for_large_tensors()  # blocks are timed as karma-run runs them (karma/calibrate)
    argv = list(sys.argv[1:] if argv is None else argv)
    # `--gpu-mem -1G` would read as an unknown option; glue it so it is checked as a size
    for k in range(len(argv) - 1):
        if argv[k] == "--gpu-mem" and argv[k + 1].startswith("-"):
            argv[k:k + 2] = [f"--gpu-mem={argv[k + 1]}"]
            break
    return run_cli("karma-plan", _plan, _parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
