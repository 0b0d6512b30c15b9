"""The Hugging Face zoo under karma: per model and strategy, its blocks, the plan, measured
against predicted step time and peak, and whether the parameters after the steps are
bitwise those of the plain PyTorch loop.

    .venv/bin/python bench/zoo.py [--steps 3] [--fraction 0.5] [--models hf_llama,hf_t5]
        [--strategies ilp,swap_all,recompute_all,offload_all]

The ILP plans at --fraction of keep_all's peak, the baselines at keep_all's peak. Tiny sizes
(KARMA_HF=tiny), CPU backend, one process; rows are printed as they finish.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

ZOO = ["hf_llama", "hf_qwen2", "hf_mistral", "hf_neox", "hf_bert", "hf_t5", "hf_vit",
       "hf_mixtral", "hf_gpt2"]
KIB = 1024


def main() -> None:
    from karma.planner.plan import InfeasiblePlan
    from karma.testing.exactness import load_with_env, plan, reference_train

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--fraction", type=float, default=0.5)
    p.add_argument("--models", default=",".join(ZOO))
    p.add_argument("--strategies", default="ilp")
    args = p.parse_args()
    print(f"{'model':<11} {'strategy':<13} {'blocks':>6} {'keep_all':>9} {'budget':>8}  "
          f"{'plan':<30} {'step ms':>8} {'pred ms':>8} {'peak KiB':>9} {'pred KiB':>9} "
          f"{'bitwise':>7}", flush=True)
    for name in args.models.split(","):
        mf = load_with_env(ROOT / "examples" / f"{name}.py",
                           {"KARMA_HF": "tiny", "KARMA_HF_GPT2": "tiny"})
        for strategy in args.strategies.split(","):
            try:
                schedule = plan(mf, strategy, args.fraction if strategy == "ilp" else 1.0)
            except InfeasiblePlan as e:
                print(f"{name:<11} {strategy:<13} does not fit: {e}", flush=True)
                continue
            reference = reference_train(mf, schedule.config.batch_size, args.steps,
                                        schedule=schedule)
            print(_row(name, strategy, mf, schedule, reference, args.steps), flush=True)


def _row(name: str, strategy: str, mf, schedule, reference, steps: int) -> str:
    from karma.runtime.checkpoints.export import model_state_dict
    from karma.testing.exactness import assert_bitwise_equal, keep_all_peak_bytes, run

    ref_sd, ref_losses = reference
    acts = [b.act for b in schedule.blocks]
    decisions = (f"{acts.count('keep')}k {acts.count('swap')}s {acts.count('recompute')}r "
                 f"{sum(b.weights == 'streamed' for b in schedule.blocks)} str "
                 f"{sum(b.optim == 'host' for b in schedule.blocks)} host")
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        report = run(schedule, mf, steps, checkpoint_dir=Path(d))
        wall = time.perf_counter() - t0
        state = model_state_dict(Path(d) / f"step_{steps}")
    try:
        assert_bitwise_equal(state, ref_sd)
        bitwise = "yes" if report.losses == ref_losses else "params"
    except AssertionError:
        bitwise = "NO"
    step_ms = 1e3 * statistics.median(report.step_s[1:] or report.step_s)
    return (f"{name:<11} {strategy:<13} {len(schedule.blocks):>6} "
            f"{keep_all_peak_bytes(mf) / KIB:>8.0f}K {schedule.config.capacity_bytes / KIB:>7.0f}K"
            f"  {decisions:<30} {step_ms:>8.1f} {1e3 * report.predicted_step_s:>8.2f} "
            f"{report.peak_device_bytes / KIB:>9.0f} "
            f"{report.predicted_peak_device_bytes / KIB:>9.0f} {bitwise:>7}   ({wall:.1f} s)")


if __name__ == "__main__":
    main()
