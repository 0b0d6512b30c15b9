"""Real schedules for tests: the tiny GPT example planned for a V100, assembled by hand.

    from tests.schedule_fixtures import tiny_schedule
    s = tiny_schedule()                                  # the ILP at 480 KiB of device memory
    s = tiny_schedule("swap_all", world_size=2)          # a baseline, data parallel
    s = tiny_schedule("offload_all", 1 << 30, 2, "sharded")  # host state sharded over 2 ranks
    ev = tiny_evaluation()                               # the planner's Evaluation behind it

Graphs and schedules are cached: tracing costs about two seconds once per test process.
"""

from __future__ import annotations

from functools import cache

from karma.schedule import ModelRef, Schedule, dump_schedule
from karma.schedule_load import load_schedule
from karma.testing.fuzz import MIXED  # every decision on the tiny GPT
from tests.conftest import EXAMPLES, ROOT, environment

TINY_ENV = (("KARMA_GPT", "tiny"),)
TINY_BATCH = 2
TINY_CAPACITY_BYTES = 480 * 1024  # under the 800 KiB keep-all needs: the ILP mixes choices
HARDWARE = "v100-16g"


@cache
def tiny_graph():
    """The block graph of examples/gpt.py at KARMA_GPT=tiny (4 blocks), batch 2."""
    from karma.ir.build import build_block_graph
    from karma.modelfile import load_model_file

    with environment(dict(TINY_ENV)):
        mf = load_model_file(EXAMPLES / "gpt.py")
    model = str((EXAMPLES / "gpt.py").relative_to(ROOT))
    return mf, build_block_graph(mf, TINY_BATCH, model_name=model)


@cache
def tiny_evaluation(strategy: str = "ilp", capacity_bytes: int = TINY_CAPACITY_BYTES,
                    world_size: int = 1, host_state: str = "replicated"):
    """The planner's Evaluation of `strategy` ("ilp" or a baseline) on the tiny GPT."""
    from karma.planner.baselines import BASELINES
    from karma.planner.hardware import load_hardware
    from karma.planner.plan import Plan, evaluate
    from karma.planner.problem import build_problem

    _, graph = tiny_graph()
    problem = build_problem(graph, load_hardware(HARDWARE), world_size=world_size,
                            host_state=host_state)
    if strategy == "ilp":  # a fixed mix of every choice, so these tests do not move when the
        # solver's answer does; it fits TINY_CAPACITY_BYTES (checked in test_schedule.py)
        return evaluate(problem, Plan("ilp", MIXED, status="optimal"), capacity_bytes)
    return evaluate(problem, BASELINES[strategy](problem, capacity_bytes), capacity_bytes)


@cache
def tiny_schedule(strategy: str = "ilp", capacity_bytes: int = TINY_CAPACITY_BYTES,
                  world_size: int = 1, host_state: str = "replicated") -> Schedule:
    """A complete Schedule, built as karma-plan builds it (pipeline.schedule_from)."""
    from karma.planner.hardware import load_hardware
    from karma.planner.options import PlanOptions
    from karma.planner.pipeline import schedule_from

    mf, graph = tiny_graph()
    ev = tiny_evaluation(strategy, capacity_bytes, world_size, host_state)
    model = ModelRef.now(graph.model, mf.sha256, graph.to_json(), TINY_ENV)
    options = PlanOptions(gpu_mem=capacity_bytes, hardware=load_hardware(HARDWARE),
                          batch_size=graph.batch_size, world_size=world_size)
    return schedule_from(graph, model, options, ev, single_rank_s=ev.step_s)


def rounded(s: Schedule) -> Schedule:
    """`s` as it reads back from its YAML: times rounded to what the file holds."""
    return load_schedule(dump_schedule(s))
