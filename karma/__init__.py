"""karma: train PyTorch models whose memory needs exceed the GPU's.

An ahead-of-time planning compiler plus a runtime:

    model.py -> karma.ir (BlockGraph) -> karma.planner (Plan) -> schedule YAML -> karma.runtime

As a library (the command-line tools are built on the same calls):

    import karma
    schedule = karma.plan("examples/gpt.py", gpu_mem="16G", hardware="v100-16g")
    schedule.save("schedule.yaml")                  # karma.load_schedule reads it back
    with karma.Runtime(schedule, seed=0) as rt:
        loss = rt.step(inputs, targets)             # one planned optimizer step
        eval_loss = rt.evaluate(inputs, targets)    # forward only, under the same budget
        rt.save("checkpoints")                      # karma-export and karma-run --resume read it

A model object instead of a file: `m = karma.model(net, example_batch, loss_fn=...)`, then
`karma.plan(m, ...)` and `karma.Runtime(schedule, model=m)` (karma/model_object.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["InfeasiblePlan", "KarmaError", "PlanOptions", "Runtime", "Schedule", "load_schedule",
           "model", "plan"]

if TYPE_CHECKING:
    from karma.api import plan
    from karma.errors import KarmaError
    from karma.model_object import model
    from karma.planner.options import PlanOptions
    from karma.planner.plan import InfeasiblePlan
    from karma.runtime.runtime import Runtime
    from karma.schedule import Schedule
    from karma.schedule_load import load_schedule

# Imported on first use: `import karma` stays cheap, and the runtime never loads the planner.
_LAZY = {
    "plan": "karma.api",
    "KarmaError": "karma.errors",
    "model": "karma.model_object",
    "InfeasiblePlan": "karma.planner.plan",
    "PlanOptions": "karma.planner.options",
    "Runtime": "karma.runtime.runtime",
    "Schedule": "karma.schedule",
    "load_schedule": "karma.schedule_load",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'karma' has no attribute {name!r}")
