"""What every karma command shares: argument types, the error boundary and the notes.

Bad input is a `KarmaError`: the command prints `PROG: error: MESSAGE` and exits 2, with no
traceback unless --debug. Anything else is a bug in karma: a one-line message that says so
and asks for --debug, exit 1. The library's notes (the `karma` logger, karma/logs.py) are
printed to stderr as `PROG: note: MESSAGE`.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import warnings
from collections.abc import Callable
from pathlib import Path

from karma.errors import KarmaError
from karma.logs import printing_notes


def huge_pages_for_large_tensors() -> None:
    """[Note: huge pages for large tensors] With glibc returning freed memory promptly
    (runtime/host/tier.py, return_freed_memory_promptly), every tensor of 64 KiB or more is a fresh mapping,
    faulted in 4 KiB page by page each time it is made: on GPT-2 small (sequence 64, batch 2)
    the plain training loop with those settings takes 514 thousand page faults a step. PyTorch's
    CPU allocator can align tensors of 2 MiB and more to 2 MiB and ask the kernel for
    transparent huge pages (`madvise(MADV_HUGEPAGE)`), one fault per 2 MiB: 126 thousand a
    step, with the same private memory. It reads the switch, the environment variable
    THP_MEM_ALLOC_ENABLE, once, at its first allocation, so karma-run and karma-plan (which
    times blocks as karma-run runs them) set it
    before torch is imported (a user's own value wins); a program that imports torch first
    sets it itself. The kernel must allow huge pages (`madvise` or `always` in
    /sys/kernel/mm/transparent_hugepage/enabled); where it does not, nothing changes."""
    if "torch" not in sys.modules:
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")


def check_writable(path: Path, flag: str, example: str | None = None) -> None:
    """A file `flag` names can be written: not a directory, in a directory that exists and
    is writable. Checked before the work that writes it (example: a file name to suggest)."""
    if path.is_dir():
        raise KarmaError(f"{flag} {path} is a directory; give a file name, e.g. "
                         f"{path / (example or 'FILE')}")
    parent = path.resolve().parent
    if not parent.is_dir():
        raise KarmaError(f"{flag} {path}: directory {parent} does not exist; create it or "
                         "choose another path")
    if not os.access(parent, os.W_OK):
        raise KarmaError(f"{flag} {path}: directory {parent} is not writable; choose another "
                         "path")


def check_writable_dir(path: Path, flag: str) -> None:
    """A directory `flag` names can be made and written: its nearest existing ancestor is a
    writable directory."""
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir() or not os.access(probe, os.W_OK):
        raise KarmaError(f"{flag} {path} is not writable; choose a directory you can write to")


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer, e.g. 8")
    return value


def run_cli(prog: str, body: Callable[[argparse.Namespace], int],
            parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse `argv`, run `body(args)` inside the error boundary, the library's notes
    printed, and return the exit code."""
    parser.add_argument("--debug", action="store_true",
                        help="show tracebacks and library warnings")
    args = parser.parse_args(argv)
    with printing_notes(prog):
        return _boundary(prog, body, args)


def _boundary(prog: str, body: Callable[[argparse.Namespace], int],
              args: argparse.Namespace) -> int:
    try:
        if args.debug:
            code = body(args)
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                code = body(args)
        sys.stdout.flush()  # here, where a reader gone away is seen (below), not at exit
        return code
    except KarmaError as e:
        if args.debug:
            raise
        print(f"{prog}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError as e:
        if args.debug:
            raise
        if stdout_reader_gone():
            # `karma-inspect s.yaml | head`: the reader has what it wanted; stop quietly (what
            # is still buffered goes nowhere, not into a second error at exit)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 128 + signal.SIGPIPE
        return _internal_error(prog, e)
    except Exception as e:  # noqa: BLE001 - the boundary: never a bare traceback
        if args.debug:
            raise
        return _internal_error(prog, e)


def _internal_error(prog: str, e: Exception) -> int:
    print(f"{prog}: internal error: {type(e).__name__}: {e}\n"
          f"(this is a bug in karma; rerun with --debug for the traceback and report it)",
          file=sys.stderr)
    return 1


def stdout_reader_gone() -> bool:
    """Whether standard output is a pipe whose reading end is closed (poll reports an error
    on the writing end)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (OSError, ValueError, AttributeError):  # no file descriptor, or no poll here
        return False
