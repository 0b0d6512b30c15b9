"""Paper-scale plans: the KARMA paper's 17B GPT on 2048 V100s and a 65B GPT on 512 H100s.

    .venv/bin/python bench/scale.py               # both models, sharded beside replicated
    .venv/bin/python bench/scale.py --json out.json

Each plan runs in a process of its own (karma.api.plan_report, the roofline block times: the
GPUs are not this machine), which reports its wall time and its peak RSS (VmHWM). Printed per
plan: whether it fits, the plan time and RSS, the host memory a rank and a node needs against
the node's, the predicted step and the scaling efficiency against one rank.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30

# (label, KARMA_GPT, KARMA_SEQ, hardware, device memory, ranks)
MODELS = [
    ("GPT 17B (40x5888, seq 1024)", "40x5888x46", "1024", "v100-16g", "16G", 2048),
    ("GPT 65B (80x8192, seq 2048)", "80x8192x64x32000", "2048", "h100-80g", "80G", 512),
]
# host state, and the node's host memory (None: the profile's; replicated state is also
# planned with as much as it wants, to show what it would need and how fast it would run)
STATES = (("sharded", None), ("replicated", None), ("replicated", "1000T"))


def plan_one(model: int, state: str, host_mem: str | None) -> dict:
    """Plan one case in this process; its figures."""
    label, gpt, seq, hardware, gpu_mem, ranks = MODELS[model]
    os.environ.update(KARMA_GPT=gpt, KARMA_SEQ=seq)
    from karma.api import plan_report
    from karma.planner.options import PlanOptions
    from karma.planner.plan import InfeasiblePlan

    start = time.perf_counter()
    row = {"model": label, "hardware": hardware, "gpu_mem": gpu_mem, "world_size": ranks,
           "host_state": state, "host_mem": host_mem}
    try:
        report = plan_report(ROOT / "examples" / "gpt.py", PlanOptions(
            gpu_mem=gpu_mem, hardware=hardware, batch_size=1, world_size=ranks,
            host_state=state, host_mem=host_mem, measure="estimate"), log=lambda note: None)
    except InfeasiblePlan as e:
        row.update(feasible=False, reason=str(e))
    else:
        s, ev = report.schedule, report.chosen
        row.update(feasible=True, step_s=s.predicted.step_s,
                   scaling_efficiency=s.predicted.scaling_efficiency,
                   host_bytes=s.predicted.host_bytes, node_host_bytes=s.predicted.node_host_bytes,
                   node_pinned_bytes=s.predicted.node_pinned_bytes,
                   host_mem_bytes=ev.host_mem_bytes, pinned_mem_bytes=ev.pinned_mem_bytes,
                   nproc_per_node=s.config.nproc_per_node,
                   peak_device_bytes=s.predicted.peak_device_bytes,
                   decisions=ev.plan.counts())
    row["plan_s"] = time.perf_counter() - start
    row["rss_bytes"] = _peak_rss()
    return row


def _peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def table(rows: list[dict]) -> str:
    lines = ["| model | ranks | host state | fits | plan | RSS | host a rank | host a node "
             "(of the node's) | pinned a node (of) | step | scaling efficiency |",
             "|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        state = r["host_state"] + (", host unlimited" if r["host_mem"] else "")
        common = (f"| {r['model']} on {r['hardware']} | {r['world_size']} | {state} "
                  f"| {'yes' if r['feasible'] else 'no'} | {r['plan_s']:.1f} s "
                  f"| {r['rss_bytes'] / 2**20:.0f} MiB ")
        if r["feasible"]:
            lines.append(
                common + f"| {r['host_bytes'] / GIB:.1f} GiB "
                f"| {r['node_host_bytes'] / GIB:.0f} GiB ({r['host_mem_bytes'] / GIB:.0f}) "
                f"| {r['node_pinned_bytes'] / GIB:.0f} GiB ({r['pinned_mem_bytes'] / GIB:.0f}) "
                f"| {r['step_s']:.1f} s | {100 * r['scaling_efficiency']:.0f}% |")
        else:
            lines.append(common + "| | | | | |")
    notes = [f"- {r['model']}, {r['host_state']}: {r['reason']}" for r in rows
             if not r["feasible"]]
    return "\n".join(lines + ([""] + notes if notes else []))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", type=Path, help="write every row as JSON here")
    p.add_argument("--case", nargs=3, metavar=("MODEL", "STATE", "HOST_MEM"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:  # one plan, in a process of its own
        model, state, host_mem = args.case
        print(json.dumps(plan_one(int(model), state, None if host_mem == "-" else host_mem)))
        return 0
    rows = []
    for model in range(len(MODELS)):
        for state, host_mem in STATES:
            out = subprocess.run([sys.executable, __file__, "--case", str(model), state,
                                  host_mem or "-"],
                                 capture_output=True, text=True, cwd=ROOT, check=True)
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"planned {rows[-1]['model']}, {state}: {rows[-1]['plan_s']:.1f} s",
                  file=sys.stderr)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
