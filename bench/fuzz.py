"""Fuzzing schedules at length: mutated schedules are refused, or train bitwise equal.

    .venv/bin/python bench/fuzz.py --count 3000 --seed 1
    .venv/bin/python bench/fuzz.py --count 200 --bases "mlp ilp 0.6" --show 5
    .venv/bin/python bench/fuzz.py --count 3000 --seed 2 --chaos 1   # timing shaken too

Plans small models with several strategies (--bases), then draws --count mutants with a
seeded generator, each one to three mutations of one base (karma/testing/mutations.py: decision
words, numbers, lines deleted, duplicated and moved, keys reordered, ops deleted, duplicated
and moved, dependencies dropped and added, buffers' alloc and free moved), and judges each
as karma-run would: refused (exit 2: by validation, or when run), ran bitwise equal to plain
PyTorch, or a bug (an internal error, a result not bitwise equal, a hang past --timeout).
Prints the counts per base and in total, and the mutations behind every bug (the exit
status is 1 if there is any). With --chaos SEED the runs pause at random around every
operation (KARMA_CHAOS, karma/runtime/replay/chaos.py), so that a dependency a mutant dropped shows
as a race more often. `make test` runs a few hundred of the same (tests/test_fuzz.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# model, strategy, fraction of keep_all's peak, training options
BASES = {
    "gpt mixed": ("gpt", "mixed", 1.0, {}),  # every decision (karma.testing.fuzz.mixed_gpt)
    "mlp ilp 0.6": ("mlp", "ilp", 0.6, {}),
    "mlp offload_all 1": ("mlp", "offload_all", 1.0, {}),
    "mlp swap_all 1 accumulate 2": ("mlp", "swap_all", 1.0, {"accumulate": 2}),
    "gpt ilp 0.5": ("gpt", "ilp", 0.5, {}),
    "gpt recompute_all 1": ("gpt", "recompute_all", 1.0, {}),
    "gpt offload_all 1 clip 1": ("gpt", "offload_all", 1.0, {"clip_grad_norm": 1.0}),
    "resnet ilp 0.6": ("resnet", "ilp", 0.6, {}),
}


def draw(rng: random.Random) -> list[tuple[str, int, int]]:
    """One to three mutations (as hypothesis draws them in tests/test_fuzz.py)."""
    from karma.testing.mutations import KINDS

    return [(rng.choice(KINDS), rng.randrange(1 << 20), rng.randrange(1 << 20))
            for _ in range(rng.choice((1, 1, 2, 3)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--count", type=int, default=3000, help="mutants to try, over all bases")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bases", default=",".join(BASES),
                   help=f"comma-separated, of: {', '.join(BASES)}")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a run may take before it counts as a hang")
    p.add_argument("--show", type=int, default=3, help="bugs to print in full")
    p.add_argument("--chaos", default=None, metavar="SEED[:MAX_MS]",
                   help="run under chaos timing (KARMA_CHAOS)")
    args = p.parse_args()
    if args.chaos is not None:
        os.environ["KARMA_CHAOS"] = args.chaos  # read when each run's engine is built

    from karma.testing.exactness import SMALL_ENV, load_with_env
    from karma.testing.fuzz import Base, Tally, judge, mutate

    start = time.perf_counter()
    names = [n.strip() for n in args.bases.split(",") if n.strip()]
    unknown = [n for n in names if n not in BASES]
    if unknown:
        p.error(f"unknown bases {unknown}; choose from {', '.join(BASES)}")
    bases = []
    for name in names:
        model, strategy, fraction, training = BASES[name]
        mf = load_with_env(ROOT / "examples" / f"{model}.py", SMALL_ENV[model])
        base = Base.of(mf, model, strategy, fraction, **training)
        base.name = name
        bases.append(base)
        print(f"{name}: {len(base.schedule.ops)} ops, {len(base.text.splitlines())} lines, "
              f"exact against plain PyTorch", flush=True)
    gc.freeze()  # each run's gc.collect() then skips what was made before the fuzzing

    rng = random.Random(args.seed)
    total, per_base = Tally(), {b.name: Tally() for b in bases}
    for k in range(args.count):
        base = bases[k % len(bases)]
        mutations = draw(rng)
        verdict = judge(base, mutate(base, mutations), args.timeout)
        total.add(base, mutations, verdict)
        per_base[base.name].add(base, mutations, verdict)
        if verdict.bug:
            print(f"BUG ({verdict.outcome}) in {base.name} with {mutations}", flush=True)
        if (k + 1) % 250 == 0:
            print(f"  {k + 1}/{args.count} ({time.perf_counter() - start:.0f} s): "
                  f"{total.text()}", flush=True)

    for name, tally in per_base.items():
        print(f"{name}: {tally.text()}")
    print("refusals by rule: " + ", ".join(
        f"{reason} {n}" for reason, n in sorted(total.reasons.items(), key=lambda r: -r[1])))
    print("trained, of the mutants with each kind of mutation: " + ", ".join(
        f"{kind} {trained}/{tried}" for kind, (tried, trained) in sorted(total.by_kind.items())))
    print(f"distinct schedules that loaded (each run once): {sum(len(b.seen) for b in bases)}")
    chaos = f", chaos {args.chaos}" if args.chaos else ""
    print(f"total ({args.count} mutants, seed {args.seed}{chaos}, "
          f"{time.perf_counter() - start:.0f} s): {total.text()}")
    for name, mutations, verdict in total.examples[:args.show]:
        print(f"\n--- {verdict.outcome} in {name} with {mutations}:\n{verdict.detail}")
    sys.exit(1 if total.bugs else 0)


if __name__ == "__main__":
    main()
