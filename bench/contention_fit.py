"""How much the CPU backend's streams really slow each other, fitted from two traces.

    KARMA_GPT=small KARMA_SEQ=64 karma-plan examples/gpt.py --hardware cpu --strategy keep_all \
        --gpu-mem 4G --batch-size 2 -o keep.yaml
    KARMA_GPT=small KARMA_SEQ=64 karma-run keep.yaml --steps 3 --trace keep.json
    KARMA_GPT=small KARMA_SEQ=64 karma-plan examples/gpt.py --hardware cpu --gpu-mem 861M \
        --batch-size 2 -o plan.yaml
    KARMA_GPT=small KARMA_SEQ=64 karma-run plan.yaml --steps 3 --trace plan.json
    .venv/bin/python bench/contention_fit.py keep.json plan.yaml plan.json

The keep_all trace gives each compute op's time alone (nothing else runs) and each block's
optimizer step alone (its device step: the same step the host optimizer runs on the CPU);
a copy's time alone is its bytes at the schedule's measured copy rate. The plan's trace shows
how long each op took and how much of that other streams were busy. With processor sharing
(simulate.py, [Note: processor sharing]), an op's work alone equals its time with nothing
beside it plus its overlapped time times its speed there: for compute ops that is linear in
two speeds (beside copies, beside host steps; time with both busy is counted in each), fitted
by least squares; for host steps and copies, one speed each beside compute. It prints them
beside the fractions the schedule was planned with (karma-profile's matmul beside a copy or an
AdamW(foreach) step). One trace of one step: a measurement to look at, not yet a calibration.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import yaml


def overlap(start: float, end: float, intervals: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, b) - max(start, a)) for a, b in intervals)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("keep_trace", help="karma-run --trace of a keep_all schedule")
    p.add_argument("schedule", help="the schedule whose trace follows")
    p.add_argument("trace", help="karma-run --trace of that schedule")
    args = p.parse_args()
    with open(args.keep_trace) as f:
        keep = json.load(f)
    with open(args.schedule) as f:
        schedule = yaml.safe_load(f)
    with open(args.trace) as f:
        trace = json.load(f)
    alone = {(o["kind"], o["block"]): o["end_s"] - o["start_s"] for o in keep["ops"]}
    hw, ops = schedule["hardware"], schedule["ops"]

    def busy(streams: set[str]) -> list[tuple[float, float]]:
        return [(o["start_s"], o["end_s"]) for o in trace["ops"] if o["stream"] in streams]

    copies, host, compute = busy({"h2d", "d2h"}), busy({"host"}), busy({"compute"})
    rows, work = [], []
    for o in trace["ops"]:
        if o["stream"] != "compute" or (o["kind"], o["block"]) not in alone:
            continue
        s, e = o["start_s"], o["end_s"]
        beside_copy, beside_host = overlap(s, e, copies), overlap(s, e, host)
        rows.append([beside_copy, beside_host])
        work.append(alone[(o["kind"], o["block"])] - max(e - s - beside_copy - beside_host, 0))
    (copy_s, host_s), *_ = np.linalg.lstsq(np.array(rows), np.array(work), rcond=None)

    def side_speed(streams: set[str], alone_s) -> float:
        done = overlapped = 0.0
        for o in trace["ops"]:
            if o["stream"] in streams:
                s, e = o["start_s"], o["end_s"]
                o_s = overlap(s, e, compute)
                done += alone_s(o) - (e - s - o_s)
                overlapped += o_s
        return done / overlapped if overlapped else float("nan")

    host_speed = side_speed({"host"}, lambda o: alone.get(("device_step", o["block"]), 0.0))
    copy_speed = side_speed({"h2d", "d2h"}, lambda o: ops[o["op"]]["bytes"] / hw[
        "h2d_bytes_per_s" if o["stream"] == "h2d" else "d2h_bytes_per_s"])
    print("speed (1: full)            fitted from the traces   planned with")
    for name, fitted, field in [
        ("compute beside copies", copy_s, "compute_slowdown_copy"),
        ("compute beside host steps", host_s, "compute_slowdown_host"),
        ("host steps beside compute", host_speed, "host_slowdown_compute"),
        ("copies beside compute", copy_speed, "copy_slowdown_compute"),
    ]:
        print(f"{name:26s} {fitted:22.3f}   {1 - float(hw.get(field, 0.0)):.3f}")


if __name__ == "__main__":
    main()
