"""The batch to train at: the search behind `--batch-size max|best` (karma.api.choose_batch).

    batch = search_batch("best", fits, samples_per_s, ceiling=1 << 16)

`fits(b)` and `samples_per_s(b)` plan batch b (the caller remembers each plan: a batch is
planned once, and where karma measures this machine each new batch is timed, seconds to
minutes). Both searches assume that a batch fits when a larger one does, and double from 1
until a batch does not fit. `max` then halves the interval between the last batch that fits
and the first that does not. `best` does not: it refines around the doubling's fastest
batch, in halving steps from half of it, never at or above a batch known not to fit: where
the fastest doubled batch is the largest that fits, its steps upward halve that interval
themselves; elsewhere the largest batch that fits does not matter, and `best` plans none of
the batches between the largest doubled and the first that does not fit.
"""

from __future__ import annotations

from collections.abc import Callable

from karma.planner.options import BATCH_CHOICES


def search_batch(how: str, fits: Callable[[int], bool], samples_per_s: Callable[[int], float],
                 ceiling: int) -> int:
    """The largest batch up to `ceiling` that fits ("max"), or the one of most samples per
    second among those tried ("best"); batch 1 must fit."""
    if how not in BATCH_CHOICES:
        raise ValueError(f"how = {how!r}; use one of {', '.join(BATCH_CHOICES)}")
    low = 1
    while 2 * low <= ceiling and fits(2 * low):
        low *= 2
    high = min(2 * low, ceiling + 1)  # low fits, high does not (or is past the ceiling)
    if how == "max":
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if fits(mid) else (low, mid)
        return low
    doubled = [1 << k for k in range(low.bit_length())]
    best = max(doubled, key=samples_per_s)
    step = max(1, best // 2)
    while step >= 1:
        for b in (best - step, best + step):
            if not 1 <= b < high:
                continue
            if not fits(b):
                high = b  # nothing larger fits either
            elif samples_per_s(b) > samples_per_s(best):
                best = b
        step //= 2
    return best
