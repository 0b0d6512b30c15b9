"""karma-plan's capacity answers: many plans at once, before anything is launched.

    karma-plan MODEL --sweep gpu-mem=4G:24G:2G [--plot FILE.png]   # budgets (or batch-size=)
    karma-plan MODEL --gpu-mem 16G --batch-size max|best            # the batch to train at
    karma-plan MODEL --hardware v100-16g,a100-80g,h100-80g          # the same model on each

Each takes karma-plan's other flags as one PlanOptions (cli/plan.py's plan_options), varies
what it asks about, and prints a table, or with --json the records.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace

from karma.cli.common import positive_int
from karma.errors import KarmaError
from karma.logs import OncePerKind, note
from karma.planner.hardware import load_hardware
from karma.planner.options import BATCH_CHOICES, PlanOptions
from karma.planner.report import hardware_table, sweep_table
from karma.units import parse_size


def compare_hardware(args: argparse.Namespace,
                     options_on: Callable[[str], PlanOptions]) -> int:
    """--hardware A,B,C: the same model planned on each profile (`options_on(name)`: the
    flags' options there), at its own device memory unless --gpu-mem is given; one row each
    (--json: a list). A profile the options do not fit (its node holds fewer ranks than
    --nproc-per-node, say) is a row that says why."""
    from karma.api import sweep as plan_sweep

    if args.output or args.print_ir or args.batch_size in BATCH_CHOICES or args.sweep:
        raise KarmaError("--hardware A,B,... compares plans and writes no schedule: leave out "
                         "-o, --print-ir, --sweep and --batch-size max|best, and plan on the "
                         "profile you choose")
    names = args.hardware.split(",")
    for name in names:
        load_hardware(name)  # an unknown name is bad input, before anything is planned
    rows, say = [], OncePerKind(note)
    for name in names:
        try:
            options = options_on(name)
        except KarmaError as e:
            hw = load_hardware(name)
            rows.append({"hardware": hw.name, "gpu_mem_bytes": hw.device_mem_bytes,
                         "world_size": args.world_size, "feasible": False, "reason": str(e)})
            continue
        if options.gpu_mem is None:
            options = replace(options, gpu_mem=options.profile.device_mem_bytes)
        rows += plan_sweep(args.model, "gpu-mem", [options.gpu_mem], options, say)
    say.finish("profiles")
    print(json.dumps(rows, indent=2) if args.json else hardware_table(rows))
    return 0


def sweep(args: argparse.Namespace, options: PlanOptions) -> int:
    """--sweep: every point planned, a table (or --json: a list) of them; a note said at
    every point is said once."""
    from karma.api import sweep as plan_sweep

    if len(args.sweep) > 1:
        raise KarmaError(f"--sweep is given {len(args.sweep)} times; sweep one quantity at a "
                         "time, e.g. --sweep gpu-mem=4G:24G:2G")
    if args.output or args.print_ir:
        raise KarmaError("--sweep plans many points and writes no schedule: leave out "
                         f"{'-o' if args.output else '--print-ir'}, and plan the point you "
                         "choose with --gpu-mem and --batch-size")
    quantity, values = parse_sweep(args.sweep[0])
    if quantity == "gpu-mem" and options.gpu_mem is not None:
        raise KarmaError("--sweep gpu-mem=... and --gpu-mem contradict each other; give one")
    if quantity == "batch-size" and options.gpu_mem is None:
        raise KarmaError("a batch-size sweep plans at one budget: give --gpu-mem")
    say = OncePerKind(note)
    points = plan_sweep(args.model, quantity, values, options, say)
    say.finish("points")
    if args.plot:
        from karma.plot import plot_sweep

        plot_sweep(points, quantity, args.plot)
    print(json.dumps(points, indent=2) if args.json else sweep_table(points)
          + (f"\nwrote {args.plot}" if args.plot else ""))
    return 0


def parse_sweep(spec: str) -> tuple[str, list[int]]:
    """QUANTITY=A:B[:STEP] or QUANTITY=V1,V2,...: the quantity and its values, in order."""
    quantity, _, text = spec.partition("=")
    if quantity not in ("gpu-mem", "batch-size"):  # profiles: --hardware A,B,C
        raise KarmaError(f"--sweep {spec!r}: karma sweeps gpu-mem or batch-size, as "
                         "gpu-mem=4G:24G:2G or batch-size=1:64")
    parse = (lambda t: parse_size(t, "--sweep gpu-mem")) if quantity == "gpu-mem" \
        else (lambda t: positive_int(t))
    try:
        if ":" in text:
            parts = [parse(t) for t in text.split(":")]
            if len(parts) not in (2, 3) or parts[0] > parts[1] or (len(parts) == 3
                                                                  and parts[2] <= 0):
                raise ValueError
            values, v = [], parts[0]
            while v <= parts[1] and len(values) < 1000:
                values.append(v)
                v = v + parts[2] if len(parts) == 3 else 2 * v
        else:
            values = [parse(t) for t in text.split(",")]
    except (ValueError, argparse.ArgumentTypeError, KarmaError):
        raise KarmaError(f"--sweep {spec!r} is not a range or a list; write {quantity}="
                         + ("4G:24G:2G (from:to:step) or 8G,16G,24G" if quantity == "gpu-mem"
                            else "1:64 (doubling), 8:64:8 (from:to:step) or 4,8,16")) from None
    if not values or (quantity == "gpu-mem" and ":" in text and len(text.split(":")) == 2):
        raise KarmaError(f"--sweep {spec!r}: a budget range needs its step, e.g. "
                         "gpu-mem=4G:24G:2G")
    return quantity, values
