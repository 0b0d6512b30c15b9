"""karma-profile: measure this machine and write its hardware profile for the planner.

    karma-profile                   # measure (about 10 s) and print the numbers
    karma-profile -o myhost.yaml    # ... and write them as a profile the planner can load
    karma-profile --quick           # about 2 s, rougher numbers (for tests)

It measures the CUDA device if PyTorch sees one, else the CPU (whose offload tier is a file on
local disk, and whose copies and host optimizer take cores from compute: it also measures how
much, see [Note: measuring contention] in karma/calibrate/measure_hw.py). The network is not
measured: edit net_bytes_per_s and net_latency_s in the file.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

from karma.cli.common import check_writable, run_cli
from karma.fileio import write_text_atomic
from karma.planner.hardware import Hardware, dump_hardware
from karma.units import format_bytes, format_number, format_seconds

PROG = "karma-profile"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description="Measure this machine and write its hardware profile."
    )
    p.add_argument("-o", "--output", metavar="FILE", help="write the profile (YAML) to FILE")
    p.add_argument("--quick", action="store_true", help="measure briefly (rougher numbers)")
    return p


def _profile(args: argparse.Namespace) -> int:
    output = None if args.output is None else Path(args.output)
    if output is not None:
        check_writable(output, "-o", "hw.yaml")  # before spending seconds measuring
    import torch  # imported here, not at the top, to keep --help fast

    from karma.calibrate.measure_hw import measure_local

    start = time.perf_counter()
    hw = measure_local(
        quick=args.quick, log=lambda what: print(f"{PROG}: measuring {what}", file=sys.stderr)
    )
    elapsed_s = time.perf_counter() - start
    omp_wait = os.environ.get("OMP_WAIT_POLICY", "unset")
    conditions = (
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, OMP_WAIT_POLICY {omp_wait}"
    )
    print(format_table(hw, f"measured in {format_seconds(elapsed_s)} ({conditions})"))
    if output is not None:
        today = datetime.date.today().isoformat()
        header = (
            f"# measured by {PROG}{' --quick' if args.quick else ''} on {today} ({conditions}).\n"
            f"# The network is not measured: set net_bytes_per_s and net_latency_s by hand.\n"
        )
        write_text_atomic(output, header + dump_hardware(hw))
        print(f"wrote {output}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(PROG, _profile, _parser(), argv)


def format_table(hw: Hardware, subtitle: str = "") -> str:
    """The profile as an aligned table with human units (TFLOP/s, GB/s, GiB)."""
    cpu = hw.device_kind == "cpu"

    def gbps(x: float) -> str:
        return f"{format_number(x / 1e9)} GB/s"

    rows = [
        ("device memory", format_bytes(hw.device_mem_bytes), "RAM budget" if cpu else ""),
        *(
            (f"matmul {dtype}", f"{format_number(rate / 1e12)} TFLOP/s", "")
            for dtype, rate in hw.flops_per_s.items()
        ),
        ("memory bandwidth", gbps(hw.mem_bytes_per_s), "read + write"),
        ("host -> device", gbps(hw.h2d_bytes_per_s), "file tier -> RAM" if cpu else "pinned"),
        ("device -> host", gbps(hw.d2h_bytes_per_s), "RAM -> file tier" if cpu else "pinned"),
        ("host memory", format_bytes(hw.host_mem_bytes), "file tier (disk)" if cpu else ""),
        ("pinned memory", format_bytes(hw.pinned_mem_bytes), ""),
        ("host optimizer", gbps(hw.host_optim_bytes_per_s), "fp32 param bytes, AdamW"),
        *(
            (label, f"{format_number(100 * value)}%", note)
            for label, value, note in (
                ("compute", hw.compute_slowdown_copy, "speed lost beside a copy"),
                ("copy", hw.copy_slowdown_compute, "speed lost beside compute"),
                ("compute", hw.compute_slowdown_host, "speed lost beside a host step"),
                ("host optimizer", hw.host_slowdown_compute, "speed lost beside compute"),
            )
            if cpu
        ),
        (
            "network",
            f"{gbps(hw.net_bytes_per_s)}, {format_seconds(hw.net_latency_s)}",
            "default, not measured",
        ),
    ]
    lines = [f"{hw.name} ({hw.device_kind})" + (f": {subtitle}" if subtitle else "")]
    for label, value, note in rows:
        lines.append(f"  {label:<18}{value:<22}{note}".rstrip())
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
