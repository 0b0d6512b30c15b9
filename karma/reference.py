"""The plain PyTorch training loop that karma must equal, as a command.

    python -m karma.reference examples/gpt.py --batch-size 2 --steps 5 [--seed 0]
        [--world-size N] [--device cuda [--cap-device-memory SIZE]] [--schedule FILE]

Prints one JSON line: the losses (rank 0's with --world-size N), and the peak private memory
above the process's baseline before the model was built (on CUDA, also the peak device
memory). Used under `prlimit --data` to show that ordinary training cannot live where
karma-run does (bench/out_of_core.py).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from functools import partial

import torch

from karma.modelfile import ModelFile, load_model_file, map_targets
from karma.runtime.distributed.cut import Cut, rows_of
from karma.runtime.host.peak import PrivatePeak
from karma.runtime.host.tier import data_bytes, private_bytes
from karma.runtime.params.host_optimizer import host_make_optimizer, hyperparameters
from karma.schedule import DTYPES


@dataclass(frozen=True)
class ReferenceRun:
    model: torch.nn.Module  # after the last step
    rank_losses: list[list[float]]  # [rank][step]
    lrs: list[float] = field(default_factory=list)  # per step: param group 0's learning rate
    grad_norms: list[float] = field(default_factory=list)  # per step, before clipping (if clip)
    evals: list[dict] = field(default_factory=list)  # {"step", "loss"}, as karma-run reports

    @property
    def losses(self) -> list[float]:
        return self.rank_losses[0]


def train_reference(mf: ModelFile, batch_size: int, steps: int, seed: int = 0,
                    world_size: int = 1, on_step: Callable[[], None] | None = None,
                    device: str = "cpu", eval_every: int = 0, dtype: str = "fp32",
                    accumulate: int = 1, clip_grad_norm: float | None = None,
                    host_params: Collection[str] = (), host_optimizer: str = "fused",
                    host_shards: int = 1,
                    resize: tuple[int, int] | None = None) -> ReferenceRun:
    """Plain PyTorch training for `steps` steps: per step, `accumulate` (N) times forward
    and loss (under autocast with dtype bf16), backward of loss / N; then
    `clip_grad_norm_(model.parameters(), clip_grad_norm)` if given, `opt.step()`, the model
    file's scheduler's `step()` (if it has make_scheduler), then `opt.zero_grad()`. A step's
    loss is the mean of its micro-batches' losses.

    With world_size N it is what N data-parallel ranks compute, in one process: per step,
    each rank's batch `batches(B, r, N)` goes forward and backward from that rank's own RNG
    states, the CPU's and on CUDA the GPU's (every rank starts from the same ones, as ranks
    seeded alike do), the N gradients
    are summed in rank order and divided by N, and the optimizer steps once. Only parameters
    are comparable then: buffers (BatchNorm statistics) see every rank's batch here.
    `on_step` runs after each optimizer step (step times). On another
    `device` the model is built on the CPU and then moved, as karma-run does. With
    `eval_every` N, every N steps the mean loss over the model file's eval_batches is taken
    in evaluation mode under torch.no_grad(), as karma-run --eval-every does.

    `host_params`: the names of parameters stepped on the CPU, as a schedule's host-stepped
    blocks are (see HostStepped), with the optimizer's kernel `host_optimizer` chooses (the
    schedule's config.host_optimizer; runtime/params/host_optimizer.py): the reference then
    computes what such a schedule computes, to the bit, on the CPU and on a GPU. `host_shards`
    N: they are stepped in the N parts of sharded host state (distributed/cut.py), as N ranks
    step them: a fused kernel's last elements take a scalar path whose rounding differs from
    its vector loop's, so where a tensor is cut decides bits.

    `resize` (K, M): after step K the run goes on with M ranks, as a run resumed from step K's
    checkpoint on M ranks does: rank r of M draws `batches(B, r, M)` from where K steps of
    batches end, and every rank continues the random stream the ranks had drawn alike.
    """
    autocast = partial(torch.autocast, torch.device(device).type, dtype=torch.bfloat16,
                       enabled=dtype == "bf16")
    model, opt, sched = _built(mf, seed, device)
    if host_shards > 1 and resize is not None:
        raise ValueError("a reference with sharded host steps cannot change its world size "
                         "(resize): step the host as given (host_optimizer='as-given')")
    host = HostStepped(model, host_make_optimizer(mf.make_optimizer, host_optimizer),
                       host_params, host_shards) if host_params else None
    data = [mf.checked_batches(batch_size, r, world_size) for r in range(world_size)]
    rng = [_rng_state(device)] * world_size
    losses: list[list[float]] = [[] for _ in range(world_size)]
    lrs: list[float] = []
    grad_norms: list[float] = []
    evals: list[dict] = []
    held_out = mf.checked_eval_batches(batch_size) if eval_every else []
    to_device = partial(torch.Tensor.to, device=device)
    for step in range(1, steps + 1):
        if resize is not None and step == resize[0] + 1:
            world_size, data, rng, losses = _resized(mf, batch_size, resize, accumulate,
                                                     world_size, rng, losses, device)
        _backward_ranks(mf, model, opt, data, rng, losses, accumulate, autocast, to_device,
                        device)
        lrs.append(float(opt.param_groups[0]["lr"]))
        norm = _step(model, opt, sched, host, clip_grad_norm, accumulate)
        if norm is not None:
            grad_norms.append(norm)
        if on_step is not None:
            on_step()
        if eval_every and step % eval_every == 0:
            evals.append({"step": step, "loss": _eval_loss(mf, model, held_out, autocast,
                                                           to_device)})
    return ReferenceRun(model, losses, lrs=lrs, grad_norms=grad_norms, evals=evals)


def _built(mf: ModelFile, seed: int, device: str):
    """build_model() after torch.manual_seed(seed), moved to `device`, in training mode; its
    optimizer and the model file's LR scheduler (None without make_scheduler)."""
    torch.manual_seed(seed)
    model = mf.build()  # build_model(), a Hugging Face KV cache turned off as karma-run does
    model.to(device)
    model.train()
    opt = mf.make_optimizer(model.parameters())
    sched = mf.make_scheduler(opt) if mf.make_scheduler is not None else None
    return model, opt, sched


def _backward_ranks(mf: ModelFile, model: torch.nn.Module, opt, data: list, rng: list,
                    losses: list[list[float]], accumulate: int, autocast, to_device,
                    device: str) -> None:
    """Each rank's micro-batches of a step (rank r: `data[r]`, from its random streams
    `rng[r]`), its mean loss added to `losses[r]`; with several ranks their gradients are
    summed in rank order and divided by their number."""
    world_size = len(data)
    params = list(model.parameters())
    summed: list[torch.Tensor | None] = [None] * len(params)
    for r in range(world_size):
        if world_size > 1:
            _set_rng_state(rng[r], device)
        micro = _micro_batches(mf, model, data[r], accumulate, autocast, to_device)
        losses[r].append(sum(micro) / len(micro))
        if world_size == 1:
            return  # the plain loop: the gradients stay where backward left them
        rng[r] = _rng_state(device)
        summed = [g if s is None else s if g is None else s + g
                  for s, g in zip(summed, (p.grad for p in params))]
        opt.zero_grad()
    for p, g in zip(params, summed):
        p.grad = None if g is None else g / world_size


def _micro_batches(mf: ModelFile, model: torch.nn.Module, data, accumulate: int, autocast,
                   to_device) -> list[float]:
    """One rank's micro-batches of a step: forward and loss (under autocast), backward of
    loss / accumulate; their losses."""
    losses = []
    for _ in range(accumulate):
        x, y = next(data)
        with autocast():
            loss = mf.loss_fn(x.map(to_device).call(model), map_targets(y, to_device))
            scaled = loss / accumulate
        scaled.backward()
        losses.append(loss.item())
    return losses


def _step(model: torch.nn.Module, opt, sched, host: HostStepped | None,
          clip_grad_norm: float | None, accumulate: int) -> float | None:
    """The optimizer step, the gradients clipped first where asked (their norm returned),
    the scheduler after it, the gradients zeroed."""
    norm = None
    if host is not None:
        host.take_grads(norms_on_device=clip_grad_norm is not None and accumulate == 1)
    if clip_grad_norm is not None and host is None:
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad_norm))
    elif clip_grad_norm is not None:
        norm = host.clip(model, clip_grad_norm)
    opt.step()  # the host-stepped parameters have no gradient here: it skips them
    if host is not None:
        host.step(opt)
    if sched is not None:
        sched.step()
    opt.zero_grad()
    return norm


def _eval_loss(mf: ModelFile, model: torch.nn.Module, held_out, autocast, to_device) -> float:
    """The mean loss over the held-out batches, in evaluation mode, without gradients."""
    model.eval()
    with torch.no_grad(), autocast():
        losses = [mf.loss_fn(x.map(to_device).call(model), map_targets(y, to_device)).item()
                  for x, y in held_out]
    model.train()
    return sum(losses) / len(losses)


def _resized(mf: ModelFile, batch_size: int, resize: tuple[int, int], accumulate: int,
             world_size: int, rng: list, losses: list, device: str):
    """The data, random streams and losses of `resize`'s M ranks after its K steps."""
    done, ranks = resize
    # the ranks' streams are equal (one seed, the same draws): rank 0's goes on
    stream = _rng_state(device) if world_size == 1 else rng[0]
    if ranks == 1:
        _set_rng_state(stream, device)
    data = [mf.checked_batches(batch_size, r, ranks) for r in range(ranks)]
    for it in data:
        for _ in range(done * accumulate):
            next(it)
    losses = [losses[r] if r < len(losses) else [] for r in range(ranks)]
    return ranks, data, [stream] * ranks, losses


def _rng_state(device: str) -> tuple:
    """The RNG states a rank's forward draws from: the CPU's, and the GPU's on CUDA (dropout
    there draws from the device's generator)."""
    on_cuda = torch.device(device).type == "cuda"
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if on_cuda else None


def _set_rng_state(state: tuple, device: str) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


class HostStepped:
    """Parameters stepped on the CPU, as karma's host-stepped blocks are, inside the plain loop.

    On the CPU the difference is the kernel: a host-stepped block steps through torch's fused
    CPU kernel by default ([Note: the host optimizer's kernel]), so the reference steps the
    same parameters with the same kernel (`make_optimizer` here is the host's).

    [Note: a reference with host-stepped parameters] A schedule that steps a block on the host
    does the optimizer's arithmetic with the CPU's kernels, whose rounding differs from the
    GPU's foreach kernels (CUDA's `_foreach_addcmul_` rounds v + s*(g*g), the CPU's addcmul_
    v + (s*g)*g), and AdamW turns a last-bit difference in a gradient that is numerically
    noise into a full step. So the GPU reference puts those parameters' arithmetic where the
    schedule puts it: their gradients (accumulated and averaged on the device as the plain
    loop does: an addition rounds alike everywhere) are copied to fp32 masters on the CPU, a
    CPU optimizer made by the model file's make_optimizer steps the masters (per parameter,
    as each block's optimizer does: the same bits whatever the grouping), and the device
    weights are copied from them. With clipping, each gradient's norm is taken where karma
    takes it (runtime/replay/update.py, Updates._grads_to_host_with_norms): on the device before
    the copy, or on the CPU for a gradient summed there over micro-batches; the total and the
    scaling are PyTorch's get_total_norm and clip_grads_with_norm_ over the same list, as
    GradClip does. The hyperparameters of the plain optimizer's param group k (an LR
    schedule's) are copied into the CPU optimizer's before each step, as runtime/params/lr.py
    does for each block.
    """

    def __init__(self, model: torch.nn.Module, make_optimizer, names: Collection[str],
                 shards: int = 1):
        named = dict(model.named_parameters())
        unknown = sorted(set(names) - set(named))
        if unknown:
            raise KeyError(f"host_params names no parameter of the model: {unknown[:3]}")
        chosen = {id(named[n]) for n in names}
        self.params = [p for p in model.parameters() if id(p) in chosen]
        self.masters = [torch.nn.Parameter(p.detach().to("cpu", copy=True))
                        for p in self.params]
        self._master_of = {id(p): m for p, m in zip(self.params, self.masters)}
        self._device_norms: dict[int, torch.Tensor] = {}
        # each master's parts as the ranks of sharded host state hold them (one: the master)
        self._cuts = [[c for c in (Cut.of(m.shape, shards, r) for r in range(shards))
                       if c.stop > c.start] for m in self.masters]
        self._parts = [[torch.nn.Parameter(rows_of(m.detach(), c).clone()) for c in cuts]
                       for m, cuts in zip(self.masters, self._cuts)] if shards > 1 else [
            [m] for m in self.masters]
        self.optimizer = make_optimizer([q for parts in self._parts for q in parts])

    def take_grads(self, norms_on_device: bool) -> None:
        """Move the chosen parameters' gradients to their masters (the plain optimizer then
        skips them); with `norms_on_device`, first take their norms there."""
        self._device_norms = {}
        for p, m in zip(self.params, self.masters):
            if norms_on_device and p.grad is not None:
                self._device_norms[id(p)] = torch.nn.utils.get_total_norm([p.grad])
            m.grad = None if p.grad is None else p.grad.detach().to("cpu", copy=True)
            p.grad = None

    def clip(self, model: torch.nn.Module, max_norm: float) -> float:
        """clip_grad_norm_ over every parameter's final gradient, each norm taken where karma
        takes it; returns the total norm before clipping."""
        holders, norms = [], []
        for p in model.parameters():
            holder = self._master_of.get(id(p), p)
            holders.append(holder)
            if holder.grad is not None:
                norm = self._device_norms.get(id(p))
                norms.append(torch.nn.utils.get_total_norm([holder.grad])
                             if norm is None else norm)
        total = torch.nn.utils.get_total_norm(norms)
        torch.nn.utils.clip_grads_with_norm_(holders, max_norm, total)
        return float(total)

    @torch.no_grad()
    def step(self, driver: torch.optim.Optimizer) -> None:
        for group, source in zip(self.optimizer.param_groups, driver.param_groups):
            group.update(hyperparameters(source))
        for m, cuts, parts in zip(self.masters, self._cuts, self._parts):
            for c, q in zip(cuts, parts):
                if q is not m:
                    q.grad = None if m.grad is None else rows_of(m.grad, c)
        self.optimizer.step()
        for p, m, cuts, parts in zip(self.params, self.masters, self._cuts, self._parts):
            for c, q in zip(cuts, parts):
                if q is not m:
                    rows_of(m.detach(), c).copy_(q)
                    q.grad = None
            p.copy_(m)
            m.grad = None


def host_stepped(schedule) -> dict:
    """train_reference's host_params, host_optimizer and host_shards for a schedule (a
    karma.schedule.Schedule): the parameters of its host-stepped blocks, its host kernel and
    how its host state is cut; {} for None (the plain loop)."""
    if schedule is None:
        return {}
    return {"host_params": tuple(n for b in schedule.blocks if b.optim == "host"
                                 for n in b.params),
            "host_optimizer": schedule.config.host_optimizer,
            "host_shards": schedule.config.world_size if schedule.config.sharded else 1}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model")
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1,
                   help="average the gradients of this many ranks' batches, in one process")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="fp32", choices=DTYPES)
    p.add_argument("--accumulate", type=int, default=1, metavar="N")
    p.add_argument("--clip-grad-norm", type=float, default=None, metavar="X")
    p.add_argument("--schedule", default=None, metavar="FILE",
                   help="step the parameters of this schedule's host-stepped blocks with its "
                        "host optimizer kernel, as karma-run does (default: the plain loop)")
    p.add_argument("--cap-device-memory", default=None, metavar="SIZE",
                   help="on CUDA: emulate a GPU of SIZE, as karma-run --cap-device-memory does")
    args = p.parse_args()
    if args.cap_device_memory is not None:
        from karma.runtime.backends.cuda_backend import cap_device_memory
        from karma.units import parse_size

        cap_device_memory(parse_size(args.cap_device_memory, "--cap-device-memory"))
    mf = load_model_file(args.model)
    host = {}
    if args.schedule is not None:
        from karma.schedule_load import load_schedule

        host = host_stepped(load_schedule(args.schedule))
    mf.make_optimizer([torch.nn.Parameter(torch.zeros(1))])  # import-time costs, as karma-run
    baseline, baseline_data = private_bytes(), data_bytes()
    meter = PrivatePeak(baseline)  # as karma-run measures its peak (runtime/host/peak.py)
    stamps = [time.perf_counter()]
    meter.start()
    try:
        run = train_reference(mf, args.batch_size, args.steps, args.seed, args.world_size,
                              on_step=lambda: stamps.append(time.perf_counter()),
                              device=args.device, dtype=args.dtype,
                              accumulate=args.accumulate, clip_grad_norm=args.clip_grad_norm,
                              **host)
        peak = meter.stop()
    finally:
        meter.close()
    cuda_peak = torch.cuda.max_memory_allocated() if args.device.startswith("cuda") else None
    # step_s[0] includes building the model; the others are one step each, data included
    print(json.dumps({"losses": run.losses, "peak_private_bytes": peak,
                      "step_s": [b - a for a, b in zip(stamps, stamps[1:])],
                      "peak_cuda_bytes": cuda_peak,
                      "baseline_private_bytes": baseline, "baseline_data_bytes": baseline_data}))


if __name__ == "__main__":
    main()
