"""Memory the planner counts where gradients meet: a tied weight's gradients in autograd's
input buffer ([Note: a shared weight's gradients meet in autograd's input buffer] in
karma/planner/lowering.py), and host optimizer temporaries stage by stage ([Note: host step
temporaries]), checked against plain PyTorch, against arithmetic on parameter sizes, and
against the simulator and brute force."""

from __future__ import annotations

import dataclasses
import random
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from karma.ir.build import build_block_graph
from karma.modelfile import load_model_file
from karma.planner.hardware import load_hardware
from karma.planner.ilp import min_capacity_bytes, solve_ilp
from karma.planner.lowering import Choice, Stages, Training, fragment, valid_choices
from karma.planner.memory import host_temp_by_stage, stage_memory
from karma.planner.plan import Plan, evaluate
from karma.planner.problem import Problem, build_problem
from tests.conftest import MODELS
from tests.test_planner import GB, HUGE, all_plans, chain, random_problem

KEEP_DEVICE = Choice("keep", "resident", "device")


def tied_chain(n: int, param_bytes: int, users: tuple[int, ...]) -> Problem:
    """n blocks with no activations; block 0 owns param_bytes of weights, which each block
    in `users` uses too (a tied embedding and output head), all stepped on the device."""
    return chain(n, act_bytes=0, param_bytes=[param_bytes] + [0] * (n - 1),
                 shared_from=[((0, param_bytes),) if i in users else () for i in range(n)])


# --- a tied weight's gradients ----------------------------------------------------------------


@pytest.mark.parametrize("users", [(2,), (1, 2)])
def test_the_owners_backward_holds_three_copies_of_a_tied_gradient_by_hand(users):
    # Block 0's weights P are used by later blocks too. During block 0's backward: its
    # weights P and AdamW state 2P, resident; the gradient that arrived first (the last
    # user's backward), P; the owner's own gradient of them and the sum, 2P: 6P.
    # A middle user's backward adds the same 2P to the first gradient: 6P there too.
    p = GB
    problem = tied_chain(3, p, users)
    ev = evaluate(problem, Plan("x", (KEEP_DEVICE,) * 3), HUGE)
    assert ev.peak_device_bytes == 6 * p
    assert ev.peak_device_bytes <= ev.stage_peak_bytes


def test_with_accumulation_the_tied_sum_waits_beside_grad_from_its_first_gradient():
    # accumulate 2: .grad (P) lives all step; the first gradient to arrive waits beside it
    # in autograd's input buffer (P) until the owner's backward adds its own (2P): 7P there
    p = GB
    problem = tied_chain(3, p, (2,))
    training = Training(accumulate=2)
    ev = evaluate(problem, Plan("x", (KEEP_DEVICE,) * 3), HUGE, training)
    assert ev.peak_device_bytes == 7 * p
    st = Stages(3, 1)
    memory = stage_memory(problem, [KEEP_DEVICE] * 3, training)
    assert memory[st.bwd(2)] - memory[st.fwd(2)] == p  # the first gradient waits from here
    assert memory[st.bwd(0)] == 7 * p


class TiedGradients(TorchDispatchMode):
    """The most storages of `weight`'s shape (or its transpose) alive at once, among those
    made under the mode: the copies of its gradient that autograd holds at the same time."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        shape = tuple(weight.shape)
        self.shapes = {shape, shape[::-1]}
        self.live = 0
        self.most = 0
        self._refs: list[weakref.ref] = []
        self._seen = {weight.untyped_storage().data_ptr()}  # views of the weight itself

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and tuple(t.shape) in self.shapes:
                storage = t.untyped_storage()
                if storage.data_ptr() not in self._seen:  # a view of one already counted
                    self._seen.add(storage.data_ptr())
                    self._refs.append(weakref.ref(storage, self._freed))
                    self.live += 1
                    self.most = max(self.most, self.live)
        return out

    def _freed(self, ref) -> None:
        self.live -= 1


def test_plain_pytorch_holds_as_many_copies_of_a_tied_gradient_as_planned():
    mf = load_model_file(MODELS / "tied_lm.py")
    torch.manual_seed(0)
    model = mf.build_model()
    inputs, targets = mf.checked_example_batch(2)
    loss = mf.loss_fn(inputs.call(model), targets)
    with TiedGradients(model.wte.weight) as counted:
        loss.backward()
    assert counted.most == 3  # the lm_head's, the embedding's, and their sum

    graph = build_block_graph(mf, batch_size=2)
    problem = build_problem(graph, load_hardware("v100-16g"))
    owner, (user,) = 0, [j for j, b in enumerate(problem.blocks) if b.shared_from]
    (_, shared), = problem.blocks[user].shared_from
    assert shared == model.wte.weight.numel() * 4
    buffers = {b.name: b for b in fragment(problem, owner, KEEP_DEVICE).buffers}
    # the first gradient to arrive is held in grad.0 (from the user's backward on); the
    # owner's backward makes the rest beside it
    assert buffers[f"grad.{owner}"].alloc == ("backward", user)
    at_owners_backward = buffers[f"gradacc.{owner}"]
    assert at_owners_backward.alloc == at_owners_backward.free == ("backward", owner)
    assert 1 + at_owners_backward.bytes // shared == counted.most


# --- host optimizer temporaries, stage by stage ---------------------------------------------


def with_host_temps(problem: Problem) -> Problem:
    """The problem on the CPU backend: each host step's temporaries (AdamW's: twice its
    largest weight; here its weights) in device memory."""
    blocks = tuple(dataclasses.replace(b, step_temp_bytes=2 * b.param_bytes)
                   for b in problem.blocks)
    return dataclasses.replace(problem, blocks=blocks, host_temps_on_device=True)


def test_a_host_steps_temporaries_count_from_its_gradients_copy_to_the_host_on():
    # Block 0 (3 GB of weights, tied to block 2) is stepped on the host; its 6 GB of step
    # temporaries cannot exist before its gradients reach the host, after its backward,
    # where its tied gradient is summed (one stage model peak used to hold both).
    problem = with_host_temps(chain(3, act_bytes=0, param_bytes=[3 * GB, GB, GB],
                                    shared_from=[(), (), ((0, 3 * GB),)]))
    host = Choice("keep", "resident", "host")
    choices = [host] * 3
    st = Stages(3, 1)
    frags = [fragment(problem, i, c) for i, c in enumerate(choices)]
    temps = host_temp_by_stage(problem, frags)
    assert temps[st.to_host(2)] == temps[st.bwd(0)] == 2 * GB
    assert temps[st.to_host(0)] == 6 * GB
    assert all(t == 0 for t in temps[:st.to_host(2)])
    on_gpu = stage_memory(dataclasses.replace(problem, host_temps_on_device=False), choices)
    assert [m - g for m, g in zip(stage_memory(problem, choices), on_gpu)] == temps
    # the peak stage, block 0's backward: weights 5 GB, grad.0 3 GB, grad.1 1 GB, the tied
    # gradient's sum 6 GB and block 1's or 2's host step temporaries 2 GB (not block 0's 6)
    ev = evaluate(problem, Plan("x", tuple(choices)), HUGE)
    assert ev.stage_peak_bytes == max(stage_memory(problem, choices)) == 17 * GB
    assert ev.peak_device_bytes <= ev.stage_peak_bytes


def unpaired(choices: list[Choice]) -> list[Choice]:
    """The choices of no pair (a plan of one block's pair choices alone is not a plan)."""
    return [c for c in choices if not (c.with_next or c.with_prev)]


@pytest.mark.parametrize("training", [Training(), Training(clip=True), Training(2)])
def test_with_host_temporaries_stage_memory_is_never_below_the_simulated_peak(training):
    for seed in range(6):
        problem = with_host_temps(random_problem(random.Random(seed), 5))
        for choices in [[Choice("keep", "resident", "host")] * 5,
                        [unpaired(valid_choices(problem, i))[-1] for i in range(5)]]:
            ev = evaluate(problem, Plan("x", tuple(choices)), HUGE, training)
            assert ev.peak_device_bytes <= ev.stage_peak_bytes, (seed, training)


@pytest.mark.parametrize("seed", range(4))
def test_with_host_temporaries_the_ilp_needs_the_least_stage_memory_of_any_plan(seed):
    # the ILP's per-stage host temporaries are stage_memory's: its smallest budget is the
    # smallest stage peak of any plan (copies one stage ahead), rounded up to a KiB or MiB
    problem = with_host_temps(random_problem(random.Random(seed), 3))
    least = min(max(stage_memory(problem, list(choices)))
                for choices in all_plans(problem) if all(c.ahead == 1 for c in choices))
    low = min_capacity_bytes(problem)
    assert least <= low < least + (1 << 20)
    ev = evaluate(problem, solve_ilp(problem, low, gap=0.0), low)
    assert ev.feasible and ev.peak_device_bytes <= ev.stage_peak_bytes <= low
