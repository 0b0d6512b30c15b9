"""Selective recompute on the KARMA paper's models: each planned on one V100-16GB at 16 GiB,
with and without the selective choice, against the ideal and against selective everywhere.

    .venv/bin/python bench/selective.py [--json FILE]

For each model: the ideal (keep_all with unlimited memory), the ILP's plan without selective
recompute (karma-plan --no-selective), with it but what a selective block keeps on the device
only (the ILP's choices without `kept: host`, a restriction this script makes) and with it
all (the default), each over the ideal, and
the selective_all baseline (torchtitan's default: every block keeps what its matmuls return)
over the ideal where it fits, else the memory it needs. Roofline block times from the
v100-16g profile (--no-measure: this machine is not a V100).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from karma.api import plan_options, plan_report  # noqa: E402
from karma.planner import lowering  # noqa: E402
from karma.units import format_bytes  # noqa: E402

COMMAND = ".venv/bin/python bench/selective.py"
HARDWARE, BUDGET = "v100-16g", "16G"
# (label, model file, its environment, batch size): the paper's evaluation models
MODELS = (
    ("ResNet-50", "examples/resnet.py", {"KARMA_RESNET": "50"}, 512),
    ("ResNet-200", "examples/resnet.py", {"KARMA_RESNET": "200"}, 128),
    ("VGG16", "examples/vgg.py", {}, 256),
    ("WRN-28-10", "examples/wrn.py", {"KARMA_WRN": "28x10"}, 1024),
    ("GPT 1.5B (seq 1024)", "examples/gpt.py", {"KARMA_GPT": "xl", "KARMA_SEQ": "1024"}, 8),
)


def plan_one(path: str, env: dict[str, str], batch: int, selective: bool,
             kept_on_host: bool = True):
    os.environ.update(env)
    options = plan_options(gpu_mem=BUDGET, hardware=HARDWARE, batch_size=batch,
                           measure="estimate", selective=selective)
    with contextlib.nullcontext() if kept_on_host else kept_on_the_device():
        return plan_report(ROOT / path, options, log=lambda _: None)


@contextlib.contextmanager
def kept_on_the_device():
    """The ILP offered no `kept: host` choice: a selective block's kept outputs stay on the
    device from its forward to its backward."""
    offered = lowering.valid_choices
    with mock.patch.object(lowering, "valid_choices",
                           lambda problem, i: [c for c in offered(problem, i)
                                               if c.kept == "device"]):
        yield


def row(label: str, path: str, env: dict[str, str], batch: int) -> dict:
    start = time.perf_counter()
    before = plan_one(path, env, batch, selective=False)
    device = plan_one(path, env, batch, selective=True, kept_on_host=False)
    after = plan_one(path, env, batch, selective=True)
    ideal_s = after.schedule.predicted.ideal_s
    sel = after.baselines["selective_all"]
    acts = after.chosen.plan.counts()
    return {
        "model": label, "batch": batch, "ideal_s": ideal_s,
        "before_s": before.chosen.step_s, "device_s": device.chosen.step_s,
        "after_s": after.chosen.step_s,
        "selective_all_s": sel.step_s if sel.feasible else None,
        "selective_all_peak_bytes": sel.stage_peak_bytes,
        "decisions": {k: acts[k] for k in ("keep", "swap", "recompute", "selective",
                                           "kept_on_host")},
        "solve_s": {"before": before.chosen.plan.solve_s, "device": device.chosen.plan.solve_s,
                    "after": after.chosen.plan.solve_s},
        "seconds": time.perf_counter() - start,
    }


def table(rows: list[dict]) -> str:
    lines = ["| model | batch | ideal | ILP without selective, over ideal | ILP, kept on the "
             "device only | ILP, over ideal | selective everywhere, over ideal | ILP over "
             "selective everywhere | keep / swap / recompute / selective (of them kept on the "
             "host) | solve |",
             "| --- | ---: | ---: | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        ideal = r["ideal_s"]
        sel = (f"{r['selective_all_s']:.3f} s, {r['selective_all_s'] / ideal:.2f}x"
               if r["selective_all_s"] is not None else
               f"does not fit (needs {format_bytes(r['selective_all_peak_bytes'])})")
        vs = (f"{r['after_s'] / r['selective_all_s']:.2f}x" if r["selective_all_s"] else "-")
        d = r["decisions"]
        solve = " / ".join(f"{r['solve_s'][k]:.2f}" for k in ("before", "device", "after"))
        lines.append(
            f"| {r['model']} | {r['batch']} | {ideal:.3f} s | {r['before_s']:.3f} s, "
            f"{r['before_s'] / ideal:.3f}x | {r['device_s']:.3f} s, "
            f"{r['device_s'] / ideal:.3f}x | {r['after_s']:.3f} s, "
            f"**{r['after_s'] / ideal:.3f}x** | {sel} | {vs} | {d['keep']} / {d['swap']} / "
            f"{d['recompute']} / {d['selective']} ({d['kept_on_host']}) | {solve} s |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", metavar="FILE", help="write the rows as JSON too")
    args = ap.parse_args()
    rows = []
    for label, path, env, batch in MODELS:
        rows.append(row(label, path, env, batch))
        print(f"{label}: {rows[-1]['seconds']:.0f} s", file=sys.stderr)
    print(f"    {COMMAND}\n")
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
