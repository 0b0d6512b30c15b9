"""Device memory stage by stage: the planner's bound on what a plan holds.

A buffer counts in every stage from the one of the op that allocates it to the one of the op
that frees it (`buffer_spans`); host step temporaries count as [Note: host step temporaries]
says. `stage_memory` sums them for a plan; the ILP's memory constraint (formulation.py) sums
the same spans over its one-hot choices, and the schedule checker walks the same bound
(schedule_replay.walk_peak_bytes).
"""

from __future__ import annotations

from karma.planner.fragment import Fragment
from karma.planner.lowering import (
    PLAIN,
    Choice,
    Stages,
    Training,
    common_fragment,
    fragment,
)
from karma.planner.problem import Problem
from karma.schedule import HOST_TEMP_PREFIX


def buffer_spans(problem: Problem, f: Fragment) -> list[tuple[int, int, int]]:
    """(first stage, last stage, bytes) of each buffer of a fragment: the stages it is live in.

    A buffer counts in every stage from the one of the op that allocates it to the one of the
    op that frees it, both included: the ILP's memory bound, never below the simulated peak.
    """
    st = Stages(len(problem.blocks), problem.world_size)
    own = {o.key: o.stage for o in f.ops}

    def stage_of(key: tuple) -> int:
        if key in own:
            return own[key]
        kind, block = key[0], key[1]
        return st.fwd(block) if kind == "forward" else st.bwd(block)  # always present

    return [(stage_of(b.alloc) if b.alloc is not None else 0,
             stage_of(b.free) if b.free is not None else st.count - 1, b.bytes)
            for b in f.buffers if not b.name.startswith(HOST_TEMP_PREFIX)]


def host_temp_bytes(f: Fragment) -> int:
    """[Note: host step temporaries] On the CPU backend a host optimizer step makes a
    temporary the size of its largest weight in private memory. Host steps run one at a time
    but not in a fixed stage: block i's starts after the stage that brings its gradients to
    the host (to_host(i)) and may run on through any later stage. So the stage model counts,
    in each stage from to_host(i) on, the largest temporary among the blocks whose host step
    may have started (host_temp_by_stage), rather than each in its own stage. With
    clipping the host steps run on into the next step's forward (the runtime overlaps them:
    runtime/replay/update.py, [Note: updates overlapped with the next forward]), so the
    largest of them counts in every stage."""
    return max((b.bytes for b in f.buffers if b.name.startswith(HOST_TEMP_PREFIX)), default=0)


def host_temp_first_stage(problem: Problem, i: int, training: Training = PLAIN) -> int:
    """The first stage in which block i's host step temporaries count (see host_temp_bytes):
    the stage of its gradients' copy to the host, or every stage with clipping."""
    return 0 if training.clip else Stages(len(problem.blocks), problem.world_size).to_host(i)


def host_temp_by_stage(problem: Problem, frags: list[Fragment],
                       training: Training = PLAIN) -> list[int]:
    """Host step temporaries counted in each stage; frags[i] is block i's fragment."""
    return _host_temp_by_stage(problem, [host_temp_bytes(f) for f in frags], training)


def _host_temp_by_stage(problem: Problem, temp_bytes: list[int],
                        training: Training = PLAIN) -> list[int]:
    """host_temp_by_stage from each block's largest host step temporary: in each stage the
    largest among the blocks whose temporaries count from it or an earlier stage."""
    count = Stages(len(problem.blocks), problem.world_size).count
    starting = [0] * count
    for i, nbytes in enumerate(temp_bytes):
        if nbytes > 0:
            k = host_temp_first_stage(problem, i, training)
            starting[k] = max(starting[k], nbytes)
    out, largest = [], 0
    for nbytes in starting:
        largest = max(largest, nbytes)
        out.append(largest)
    return out


def stage_memory(problem: Problem, choices: list[Choice],
                 training: Training = PLAIN) -> list[int]:
    """Device bytes live in each stage (the ILP's memory model) for these choices."""
    return StageMemory(problem, training)(choices)


class StageMemory:
    """stage_memory for many plans of one problem: each block is lowered once per choice, so
    a heuristic that changes one block at a time (baselines.greedy) pays for that block, not
    for all of them (on 500 blocks greedy took 40 s)."""

    def __init__(self, problem: Problem, training: Training = PLAIN) -> None:
        self.problem, self.training = problem, training
        self.count = Stages(len(problem.blocks), problem.world_size).count
        self.common = buffer_spans(problem, common_fragment(problem))
        self.lowered: dict[tuple[int, Choice], tuple[list[tuple[int, int, int]], int]] = {}

    def block(self, i: int, c: Choice) -> tuple[list[tuple[int, int, int]], int]:
        """Block i's buffer spans and largest host step temporary under choice c."""
        if (i, c) not in self.lowered:
            f = fragment(self.problem, i, c, self.training)
            self.lowered[i, c] = (buffer_spans(self.problem, f), host_temp_bytes(f))
        return self.lowered[i, c]

    def __call__(self, choices: list[Choice]) -> list[int]:
        delta = [0] * (self.count + 1)
        temps = []
        for spans, temp in [(self.common, 0)] + [self.block(i, c) for i, c in
                                                  enumerate(choices)]:
            for first, last, nbytes in spans:
                delta[first] += nbytes
                delta[last + 1] -= nbytes
            temps.append(temp)
        host_temp = _host_temp_by_stage(self.problem, temps[1:], self.training)
        live, out = 0, []
        for k in range(self.count):
            live += delta[k]
            out.append(live + host_temp[k])
        return out
