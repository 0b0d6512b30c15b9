"""Which ops a selective block keeps: its policy, read from the schedule, applied to an op.

    keeps = kept_by("save-matmuls@64")
    keeps(torch.ops.aten.mm.default, (a, b))   # True where a.shape[-1] >= 32

A policy (BlockEntry.policy; [Note: selective recompute] below) is a name of
SELECTIVE_POLICIES, and optionally `@N`: of the ops the name lists, keep only those whose
output took N or more FLOPs an element to make.

[Note: FLOPs an element] A matmul's or a convolution's output element costs 2 K FLOPs, K its
reduction (a matmul's inner size; a convolution's input channels a group times its kernel's
size), and is as many bytes as any other element: so K orders a block's kept outputs by the
compute their recompute costs per byte they free. In a ResNet bottleneck the 3x3
convolution's elements cost 18 w FLOPs, the first 1x1's 8 w and the last 1x1's 2 w (w its
width), and the last 1x1's output is four times the others'. The IR (karma/ir/measure.py) and
the runtime both read it from the op's arguments, so they agree on every op; attention and
grouped matmuls (no single K) are always kept.

Shared by the IR, the calibration, the schedule's checks and the runtime; torch only inside
checkpoint_policy (the planner parses policies without it).
"""

from __future__ import annotations

import math
from collections.abc import Callable

# [Note: selective recompute] A selective block runs its forward under non-reentrant
# checkpointing with a per-op policy (torch.utils.checkpoint's selective contexts): the
# outputs of the ops its policy keeps stay from the forward to the backward, every other op
# runs again in the recompute. BlockEntry.policy names the ops, as a key of
# SELECTIVE_POLICIES (one so far), optionally with @N: only those of its ops whose output
# took N FLOPs an element or more ([Note: FLOPs an element]):
#   save-matmuls: keep what matmuls, convolutions and attention return (nearly all the
#   FLOPs), recompute normalizations, activations, dropout, residual adds and casts (often
#   most of the bytes), as torchtitan's op-level selective checkpointing does;
#   save-matmuls@N: the same, but recompute the matmuls and convolutions of fewer FLOPs an
#   output element than N too (a ResNet bottleneck's 1x1 convolutions: large outputs that
#   are cheap to make again).
# The names are ATen operator packets (OpOverloadPacket.__name__), every overload included.
SELECTIVE_POLICIES: dict[str, frozenset[str]] = {
    "save-matmuls": frozenset({
        "mm", "addmm", "bmm", "baddbmm", "_grouped_mm", "convolution",
        "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
        "_flash_attention_forward", "_efficient_attention_forward",
    }),
}
SELECTIVE_POLICY = "save-matmuls"  # the ops the planner's policies name
_REDUCTION = {"mm": 0, "addmm": 1, "bmm": 0, "baddbmm": 1}  # where the left factor is
UNBOUNDED = math.inf  # an op of no single reduction: kept at every threshold


def parse_policy(policy: str) -> tuple[frozenset[str], int]:
    """(the op names a policy keeps, the least FLOPs an element of a kept output); ValueError
    naming the known ones where it is not a policy."""
    name, at, least = policy.partition("@")
    if name not in SELECTIVE_POLICIES or (at and not (least.isdigit() and int(least) > 0)):
        raise ValueError(f"{policy!r} is not a selective policy; use one of "
                         f"{', '.join(SELECTIVE_POLICIES)}, optionally with @N (N > 0: keep "
                         "only outputs of N FLOPs an element or more)")
    return SELECTIVE_POLICIES[name], int(least) if at else 0


def policy_name(name: str, least_flops: int) -> str:
    """The policy that keeps what `name` lists of `least_flops` FLOPs an element or more."""
    return f"{name}@{least_flops}" if least_flops else name


def flops_per_element(op_name: str, args: tuple) -> float:
    """FLOPs that an output element of a matmul or convolution takes ([Note: FLOPs an
    element]); UNBOUNDED for the other ops a policy names (attention, grouped matmuls)."""
    if op_name in _REDUCTION:
        return 2 * args[_REDUCTION[op_name]].shape[-1]
    if op_name == "convolution":
        weight, transposed, groups = args[1], args[6], args[8]
        kernel = math.prod(weight.shape[2:])
        return 2 * kernel * (weight.shape[0] // groups if transposed else weight.shape[1])
    return UNBOUNDED


def checkpoint_policy(policy: str) -> Callable:
    """`policy` as create_selective_checkpoint_contexts takes it: MUST_SAVE for the ops it
    keeps, PREFER_RECOMPUTE for the others (torch imported here only: the planner's checks
    parse policies without it)."""
    from torch.utils.checkpoint import CheckpointPolicy

    keeps = kept_by(policy)

    def decide(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if keeps(op, args) else \
            CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def kept_by(policy: str) -> Callable[[object, tuple], bool]:
    """Whether `policy` keeps an op's output, from the op (an OpOverload) and its arguments."""
    names, least = parse_policy(policy)

    def keeps(op, args: tuple) -> bool:
        packet = getattr(op, "overloadpacket", None)  # None: a higher-order operator
        if packet is None or packet.__name__ not in names:
            return False
        return least == 0 or flops_per_element(packet.__name__, args) >= least

    return keeps
