"""karma-run: train the model a schedule was planned for, by replaying the schedule.

    karma-run schedule.yaml --steps 100 --checkpoint-dir ckpt --report report.json
    karma-run schedule.yaml --steps 100 --checkpoint-dir ckpt --resume
    karma-run schedule.yaml --steps 3 --trace trace.json    # step 2's ops on each stream
    karma-run schedule.yaml --steps 10 --cap-memory          # CPU: held to what it planned
    karma-run schedule.yaml --steps 10 --trace t.json --trace-steps 8   # t.step2.json .. step9
    torchrun --nproc-per-node 2 --no-python karma-run schedule.yaml   # planned --world-size 2
    torchrun --nproc-per-node 2 --no-python karma-run s.yaml --dist-backend gloo  # 1 GPU, 2 ranks
    python -m karma.run schedule.yaml                                  # the same as karma-run

Each step prints a progress line with the measured step time and peak memory beside the
schedule's predictions; --report writes them as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
from pathlib import Path

from karma.cli.common import (
    check_writable,
    check_writable_dir,
    huge_pages_for_large_tensors,
    positive_int,
    run_cli,
)
from karma.errors import KarmaError
from karma.fileio import write_text_atomic
from karma.schedule import HOST_OPTIMIZERS


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="karma-run", description="Train by replaying a schedule.")
    p.add_argument("schedule", help="a schedule written by karma-plan -o")
    p.add_argument("--steps", type=positive_int, default=10, help="train until this step")
    p.add_argument("--seed", type=int, default=None, help="default: the schedule's seed")
    p.add_argument("--checkpoint-dir", type=Path, default=None,
                   help="write DIR/step_N/ checkpoints (the final step always)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="also write a checkpoint every N steps")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --checkpoint-dir")
    p.add_argument("--eval-every", type=int, default=0, metavar="N",
                   help="every N steps, print the mean loss over the model file's "
                        "eval_batches(batch_size), forward only (report: evals)")
    p.add_argument("--report", type=Path, default=None,
                   help="write a JSON report here (on several ranks: rank 0's)")
    p.add_argument("--trace", type=Path, default=None, metavar="FILE",
                   help="write the start and end of every op of one step on its stream "
                        "(CUDA events on the GPU) and the compute thread's waits to this "
                        "JSON file; view it with karma-inspect SCHEDULE --trace FILE")
    p.add_argument("--trace-step", type=positive_int, default=None, metavar="N",
                   help="the step --trace records (default: the second step this run "
                        "trains, or the only one)")
    p.add_argument("--trace-steps", type=positive_int, default=1, metavar="K",
                   help="trace K steps from --trace-step on, each into FILE with its step in "
                        "the name (trace.json: trace.step2.json, ...); a traced step waits "
                        "at its end for the updates it leaves running, so its time is not "
                        "an untraced step's")
    p.add_argument("--cap-device-memory", nargs="?", const=True, default=False,
                   metavar="SIZE",
                   help="on CUDA: emulate a GPU of SIZE (default: the schedule's budget): "
                        "PyTorch's allocator may hold SIZE less the memory already in use "
                        "outside it (the CUDA context), measured at the start")
    p.add_argument("--cap-memory", action="store_true",
                   help="on the CPU backend: cap this process's data segment (RLIMIT_DATA, "
                        "what prlimit --data caps) at what the schedule needs: its fixed "
                        "cost and karma's threads, measured before the first step, + the "
                        "plan's peak + 128 MiB slack, said in one line. The host tier, a "
                        "file in /dev/shm by default, is RAM outside the cap "
                        "(KARMA_TIER_DIR=/path/on/disk puts it on a disk)")
    p.add_argument("--dist-backend", choices=("nccl", "gloo"), default=None,
                   help="on several ranks, what all-reduces the gradients (default: nccl on "
                        "CUDA, gloo on the CPU); ranks that share one GPU need gloo")
    p.add_argument("--host-optimizer", choices=HOST_OPTIMIZERS, default=None,
                   help="the kernel of blocks stepped on the host (default: the schedule's, "
                        "karma-plan --host-optimizer): fused, or as-given (the model file's "
                        "optimizer exactly as made: bitwise the plain loop)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="SECONDS",
                   help="on several ranks: how long to wait for the rendezvous, and for a "
                        "rank that stops answering, before stopping with an error (a rank "
                        "that dies is noticed at once)")
    return p


def _run(args: argparse.Namespace) -> int:
    from karma.runtime.loop import RunOptions, open_model_file, train
    from karma.schedule_load import load_schedule
    from karma.units import parse_size

    _check_args(args)
    signal.signal(signal.SIGTERM, _stopped)
    # [Note: a file past ulimit -f is an error, not a kill] Writing past RLIMIT_FSIZE sends
    # SIGXFSZ, whose default action ends the process with a core dump and no word of which
    # file; ignored, the write fails with EFBIG instead, and the checkpoint or host tier that
    # wrote it stops the run with the path and the limit (storage.write_failure). karma-run
    # owns its process; the Runtime library leaves signals to its caller.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    cap = args.cap_device_memory
    if isinstance(cap, str):
        cap = parse_size(cap, "--cap-device-memory")
    schedule_path = Path(args.schedule)
    schedule = load_schedule(schedule_path)
    cap = _memory_cap(args, cap, dict(schedule.hardware).get("device_kind", "cpu"))
    mf = open_model_file(schedule, schedule_path)
    try:
        report = train(schedule, mf, RunOptions(
            steps=args.steps, seed=args.seed, checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every, resume=args.resume,
            timeout_s=args.timeout, cap_device_memory=cap, dist_backend=args.dist_backend,
            eval_every=args.eval_every, trace_path=args.trace, trace_step=args.trace_step,
            trace_steps=args.trace_steps, host_optimizer=args.host_optimizer,
            log=lambda line: print(line, flush=True)))
    except (MemoryError, RuntimeError) as e:
        reported = user_error(e)
        if reported is None:
            raise
        raise reported from e
    if report.rank == 0:
        _summary(report, schedule.predicted.calibration == "measured")
    if args.report and report.rank == 0:
        write_text_atomic(args.report, json.dumps(report.to_json(), indent=2))
    return 0


def _check_args(args: argparse.Namespace) -> None:
    """Refuse what cannot run before anything starts."""
    if args.resume and args.checkpoint_dir is None:
        raise KarmaError("--resume needs --checkpoint-dir DIR (where the checkpoints are)")
    if args.checkpoint_every < 0:
        raise KarmaError(f"--checkpoint-every {args.checkpoint_every} must be 0 or more")
    if args.eval_every < 0:
        raise KarmaError(f"--eval-every {args.eval_every} must be 0 (never) or more")
    if args.timeout <= 0:
        raise KarmaError(f"--timeout {args.timeout:g} must be a positive number of seconds")
    if args.trace_step is not None and args.trace is None:
        raise KarmaError("--trace-step needs --trace FILE (where the timeline goes)")
    if args.trace_step is not None and args.trace_step > args.steps:
        raise KarmaError(f"--trace-step {args.trace_step} is after the last step "
                         f"(--steps {args.steps}); choose a step from 1 to {args.steps}")
    if args.trace_steps > 1 and args.trace is None:
        raise KarmaError("--trace-steps needs --trace FILE (where the timelines go)")
    first = args.trace_step or min(2, args.steps)
    if first + args.trace_steps - 1 > args.steps:
        raise KarmaError(f"--trace-steps {args.trace_steps} from step {first} goes past the "
                         f"last step (--steps {args.steps}); train "
                         f"--steps {first + args.trace_steps - 1} or trace fewer")
    if args.checkpoint_dir is not None:
        check_writable_dir(Path(args.checkpoint_dir), "--checkpoint-dir")
    if args.report is not None:
        check_writable(Path(args.report), "--report", "report.json")
    if args.trace is not None:  # written after its step: refused first
        check_writable(Path(args.trace), "--trace", "trace.json")


def _memory_cap(args: argparse.Namespace, device_cap: bool | int, device_kind: str) -> bool | int:
    """The cap the run asks of its backend (RunOptions.cap_device_memory, whose device on
    the CPU backend is the process's private memory): --cap-device-memory on CUDA,
    --cap-memory on the CPU."""
    if device_kind == "cpu" and device_cap:
        raise KarmaError("--cap-device-memory caps a GPU's memory; on the CPU backend "
                         "--cap-memory caps this process at what the schedule needs")
    if device_kind != "cpu" and args.cap_memory:
        raise KarmaError("--cap-memory caps the CPU backend's process; on CUDA "
                         "--cap-device-memory emulates a GPU of the schedule's budget")
    return True if args.cap_memory else device_cap


def _summary(report, measured: bool) -> None:
    """The run's closing lines: measured against predicted, the drift note, all-reduces."""
    from karma.units import format_bytes, format_seconds

    if report.step_s:
        median = statistics.median(report.step_s)
        print(f"done: {len(report.steps)} steps; median step {format_seconds(median)} against "
              f"{format_seconds(report.predicted_step_s)} predicted; peak "
              f"{format_bytes(report.peak_device_bytes)} against "
              f"{format_bytes(report.predicted_peak_device_bytes)} predicted (budget "
              f"{format_bytes(report.capacity_bytes)})"
              + (f"; {format_bytes(report.outside_private_bytes)} of the process was outside "
                 "its tensors at a step's start (thread pools, small tensors, Python "
                 "objects), " + (f"planned as {format_bytes(report.planned_outside_bytes)}"
                                 if report.planned_outside_bytes else
                                 "which the plan does not count")
                 if report.outside_private_bytes else ""))
        ratio = median / report.predicted_step_s if report.predicted_step_s else 1.0
        if measured and not 0.8 <= ratio <= 1.25:
            # [Note: a machine whose speed drifts] in karma/calibrate/__init__.py
            print(f"note: the steps took {ratio:.2f}x the predicted time. A shared machine's "
                  "speed drifts, and this one's may have since its blocks were measured; "
                  "`karma-plan --remeasure` measures them again")
    if report.rank_host_bytes:
        each = ", ".join(format_bytes(b) for b in report.rank_host_bytes)
        print(f"host memory a rank at its peak: {each} against "
              f"{format_bytes(report.predicted_host_bytes)} predicted")
    if report.world_size > 1 and report.allreduce_s:
        total, hidden = sum(report.allreduce_s), sum(report.allreduce_hidden_s)
        print(f"all-reduce: {format_seconds(total / len(report.allreduce_s))} per step on "
              f"{report.world_size} ranks (predicted "
              f"{format_seconds(report.predicted_allreduce_s)}), "
              f"{100 * hidden / total if total else 100:.0f}% of it hidden under backward")


def user_error(e: BaseException) -> KarmaError | None:
    """The error karma-run reports (exit 2) for `e`, raised while training, or None when `e`
    is a bug in karma (an internal error). KarmaErrors stand for themselves; a stream's
    KarmaError met outside a step (a checkpoint waits for the last updates) and running out
    of memory are the user's to fix too."""
    from karma.runtime.replay.streams import OpFailed

    if isinstance(e, KarmaError):
        return e
    if isinstance(e, OpFailed) and isinstance(e.__cause__, KarmaError):
        return KarmaError(str(e.__cause__))
    if isinstance(e, RuntimeError) and "can't start new thread" in str(e):
        return KarmaError(
            f"a thread could not start ({e}): the process's memory limit leaves no room for "
            "its stack; raise the limit, or let karma-run --cap-memory set it")
    if isinstance(e, (MemoryError, RuntimeError)) and _out_of_memory(e):
        return KarmaError(
            f"ran out of memory while training: {str(e).splitlines()[0][:200]}; the process's "
            "memory limit is below what the schedule needs (its budget plus about 0.3 GiB for "
            "Python and PyTorch): re-plan with a smaller --gpu-mem, or raise the limit")
    return None


def _stopped(signum, frame) -> None:
    raise KarmaError("stopped by SIGTERM (torchrun stops every rank when one of them fails: "
                     "see the first rank's error); restart with --resume to continue from the "
                     "last checkpoint")


def _out_of_memory(e: BaseException) -> bool:
    text = str(e)
    return isinstance(e, MemoryError) or "can't allocate memory" in text \
        or "out of memory" in text.lower() or "std::bad_alloc" in text


def main(argv: list[str] | None = None) -> int:
    huge_pages_for_large_tensors()  # before torch is imported
    prog = "karma-run"
    if os.environ.get("WORLD_SIZE", "1").strip() not in ("", "1"):  # say which rank fails
        prog += f" (rank {os.environ.get('RANK', '?')})"
    return run_cli(prog, _run, _parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
