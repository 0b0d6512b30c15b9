"""Chaos timing: random short pauses around every operation and hand-off (KARMA_CHAOS).

[Note: chaos timing] The runtime's correctness rests on an ordering protocol: every wait
after its issue, every release after its operation. On the CPU backend the streams are
worker threads that, on a 2-core machine, rarely interleave in unlucky ways, so a missing
wait can pass every test and then corrupt a GPU run, whose copy engines really do run late.
With KARMA_CHAOS=SEED each stream worker and the compute thread pause, at random (seeded per
thread), for up to a few milliseconds before and after each operation and each hand-off:
orders that the protocol allows but that the machine rarely produces then happen. A correct
schedule still trains bitwise equal; a missing wait shows (tests/test_chaos.py; two ranks,
whose threads pause differently, in tests/test_distributed.py).
"""

from __future__ import annotations

import os
import random
import threading
import time
import zlib

CHAOS_ENV = "KARMA_CHAOS"


class Chaos:
    """pause(): sleep, half the time, up to `max_pause_s`; each thread its own seeded RNG."""

    def __init__(self, seed: int, max_pause_s: float = 0.003):
        self.seed = seed
        self.max_pause_s = max_pause_s
        self._local = threading.local()
        # the ranks of a data-parallel run name their threads alike: each pauses differently
        rank = _rank()
        self._rank_suffix = f"@{rank}" if rank else ""

    @classmethod
    def from_env(cls) -> Chaos | None:
        """KARMA_CHAOS=SEED[:MAX_MS] (integers; pauses of up to 3 ms by default) turns it
        on; unset, empty or 0 leaves it off."""
        text = os.environ.get(CHAOS_ENV, "").strip()
        if not text or text == "0":
            return None
        seed, _, max_ms = text.partition(":")
        try:
            return cls(int(seed), int(max_ms) / 1e3 if max_ms else 0.003)
        except ValueError:
            from karma.errors import KarmaError

            raise KarmaError(f"{CHAOS_ENV}={text!r} is not SEED or SEED:MAX_MS; set it to "
                             "integers, e.g. 1 or 1:20 (or unset it)") from None

    def pause(self) -> None:
        rng = getattr(self._local, "rng", None)
        if rng is None:
            name = threading.current_thread().name + self._rank_suffix
            rng = self._local.rng = random.Random(self.seed * 1_000_003 + zlib.crc32(name.encode()))
        if rng.random() < 0.5:
            time.sleep(rng.uniform(0.0, self.max_pause_s))


def _rank() -> int:
    """This process's rank among several (0 on one)."""
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def pause(chaos: Chaos | None) -> None:
    """chaos.pause() where chaos is on; nothing otherwise."""
    if chaos is not None:
        chaos.pause()


__all__ = ["CHAOS_ENV", "Chaos", "pause"]
