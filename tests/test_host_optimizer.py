"""The host optimizer's kernel (runtime/params/host_optimizer.py), its threads
(runtime/host/threads.py) and its calibration (calibrate/host_step.py): torch's fused CPU
kernel by default, the same optimizer otherwise; the user's optimizer as given on request;
the choice kept through LR schedules, checkpoints and resumes."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading

import pytest
import torch

from karma.calibrate.host_step import host_step_times
from karma.errors import KarmaError
from karma.reference import train_reference
from karma.runtime.checkpoints.export import model_state_dict
from karma.runtime.host.threads import host_stream_threads, use_threads_here
from karma.runtime.params.host_optimizer import (
    can_fuse,
    fused_version,
    host_make_optimizer,
    is_fused,
    keep_implementation,
)
from karma.runtime.runtime import Runtime
from karma.testing.exactness import assert_bitwise_equal, block_graph, plan, run
from tests.conftest import ROOT
from tests.runtime_helpers import load_small


def params(n: int = 3) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(40, 7, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=3e-3, betas=(0.8, 0.95), weight_decay=0.2, eps=1e-6),
    lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1, lr_decay=0.01),
    lambda ps: torch.optim.AdamW([{"params": ps[:1], "lr": 1e-2}, {"params": ps[1:]}], lr=1e-3),
], ids=["adamw", "adam-amsgrad", "sgd-nesterov", "adagrad", "adamw-groups"])
def test_the_fused_version_is_the_same_optimizer_within_rounding(make):
    plain, fused = params(), params()
    a, b = make(plain), host_make_optimizer(make, "fused")(fused)
    assert type(a) is type(b) and is_fused(b) and not is_fused(a)
    strip = [{k: v for k, v in g.items() if k not in ("params", "fused", "foreach")}
             for g in a.param_groups]
    assert strip == [{k: v for k, v in g.items() if k not in ("params", "fused", "foreach")}
                     for g in b.param_groups]  # every hyperparameter and group kept
    for step in range(4):
        for p, q in zip(plain, fused):
            p.grad = torch.full_like(p, 0.01 * (step + 1)) + p.detach() * 0.1
            q.grad = p.grad.clone()
        a.step()
        b.step()
    for p, q in zip(plain, fused):
        torch.testing.assert_close(q, p, rtol=1e-4, atol=1e-6)


def test_a_chosen_implementation_or_another_class_is_kept_as_given():
    chosen = torch.optim.AdamW(params(), foreach=True)
    assert not can_fuse(chosen) and fused_version(chosen) is chosen

    class Mine(torch.optim.AdamW):
        pass

    assert not can_fuse(Mine(params()))
    assert not can_fuse(torch.optim.RMSprop(params()))
    make = lambda ps: torch.optim.AdamW(ps)  # noqa: E731
    assert host_make_optimizer(make, "as-given") is make
    assert host_make_optimizer(make, "fused") is host_make_optimizer(make, "fused")  # one each
    with pytest.raises(ValueError, match="fused, as-given"):
        host_make_optimizer(make, "fast")


def test_a_restored_state_dict_keeps_the_kernel():
    ps = params()
    fused = fused_version(torch.optim.AdamW(ps))
    saved = torch.optim.AdamW(params()).state_dict()  # written by an as-given run
    assert saved["param_groups"][0]["fused"] is None
    keep_implementation(fused, lambda: fused.load_state_dict(saved))
    assert is_fused(fused)


def test_the_host_stream_sets_only_its_own_threads():
    main = torch.get_num_threads()
    seen = []

    def worker() -> None:
        use_threads_here(1)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert seen == [1] and torch.get_num_threads() == main
    assert host_stream_threads("cpu", 2) == 1 and host_stream_threads("cpu", 1) == 1
    assert host_stream_threads("cuda", 16) == 15


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=3e-3, weight_decay=0.2, fused=True),
    lambda ps: torch.optim.Adam(ps, lr=1e-3, amsgrad=True, fused=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    lambda ps: torch.optim.Adagrad(ps, lr=0.1, fused=True),
], ids=["adamw", "adam-amsgrad", "sgd", "adagrad"])
def test_a_fused_step_is_the_same_on_one_thread_or_two(make):
    """The host stream steps with its own thread count (one on two cores), the reference
    (karma.reference) on the main thread's, a rank on one: the fused kernels are elementwise,
    so where a tensor is split among threads changes no bit (tensors of several of PyTorch's
    grains, split off the vector width)."""
    def stepped(threads: int) -> list[torch.Tensor]:
        ps, out, seen = [], [], []

        def work():
            use_threads_here(threads)
            seen.append(torch.get_num_threads())
            g = torch.Generator().manual_seed(0)
            ps.extend(torch.nn.Parameter(torch.randn(n, generator=g))
                      for n in (100_003, 3 * 65_536 + 5))
            opt = make(ps)
            for _ in range(3):
                for p in ps:
                    p.grad = torch.randn(p.shape, generator=g)
                opt.step()
            out.extend(p.detach() for p in ps)

        t = threading.Thread(target=work)
        t.start()
        t.join()
        assert seen == [threads]  # the OpenMP runtime took the setting
        return out

    one, two = stepped(1), stepped(2)
    assert all(torch.equal(a, b) for a, b in zip(one, two)) and len(one) == 2


def test_host_steps_are_timed_per_block_with_the_host_kernel(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tier = tmp_path / "tier"  # where the steps' masters and gradients are mapped
    tier.mkdir()
    monkeypatch.setenv("KARMA_TIER_DIR", str(tier))
    mf = load_small("gpt")
    graph = block_graph(mf)
    lines: list[str] = []
    seconds = host_step_times(mf, graph, "fused", "cpu", lines.append)
    assert len(seconds) == len(graph.blocks)
    assert all((s > 0) == (b.param_bytes > 0) for s, b in zip(seconds, graph.blocks))
    assert any("fused" in line for line in lines)
    again: list[str] = []
    assert host_step_times(mf, graph, "fused", "cpu", again.append) == seconds  # cached
    assert not again
    assert list(tier.iterdir()) == []


def test_offload_all_steps_fused_and_as_given_is_the_plain_loop(tmp_path):
    """By default every host-stepped block's optimizer is fused and the run is the reference
    that steps them so; as given (karma-run --host-optimizer as-given) the run is the plain
    loop itself, bit for bit, and differs from the fused one."""
    mf = load_small("mlp")
    schedule = plan(mf, "offload_all")
    assert schedule.config.host_optimizer == "fused"
    with Runtime(schedule, model_file=mf, log=lambda line: None) as rt:
        assert all(is_fused(opt) for opt in rt.parts.host_optimizers)
    plain = train_reference(mf, schedule.config.batch_size, 3)
    given = run(schedule, mf, 3, checkpoint_dir=tmp_path / "given", host_optimizer="as-given")
    assert given.losses == plain.losses
    assert_bitwise_equal(model_state_dict(tmp_path / "given" / "step_3"),
                         plain.model.state_dict())
    run(schedule, mf, 3, checkpoint_dir=tmp_path / "fused")
    assert any(not torch.equal(v, plain.model.state_dict()[k])
               for k, v in model_state_dict(tmp_path / "fused" / "step_3").items())
    with pytest.raises(KarmaError, match="--host-optimizer"):
        Runtime(schedule, model_file=mf, host_optimizer="fast", log=lambda line: None)


def test_a_model_file_that_asks_for_an_implementation_gets_it():
    mf = load_small("mlp")
    asked = dataclasses.replace(
        mf, make_optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3, foreach=True))
    with Runtime(plan(mf, "offload_all"), model_file=asked, log=lambda line: None) as rt:
        assert all(not is_fused(opt) and opt.param_groups[0]["foreach"]
                   for opt in rt.parts.host_optimizers)


def test_a_resumed_run_keeps_its_kernel(tmp_path):
    """A checkpoint written as given and resumed with the fused kernel steps with the fused
    kernel (the groups it restores do not carry the kernel), and a state_dict loaded into a
    Runtime likewise."""
    mf = load_small("mlp")
    schedule = plan(mf, "offload_all")
    run(schedule, mf, 1, checkpoint_dir=tmp_path, host_optimizer="as-given")
    run(schedule, mf, 2, checkpoint_dir=tmp_path, resume=True)
    groups = [torch.load(tmp_path / f"step_{k}" / "extras.pt", weights_only=False)
              ["param_groups"] for k in (1, 2)]
    assert [{g["fused"] for block in saved if block for g in block} for saved in groups] == [
        {None}, {True}]
    with Runtime(schedule, model_file=mf, log=lambda line: None, host_optimizer="as-given") \
            as given:
        state = given.state_dict()
    with Runtime(schedule, model_file=mf, log=lambda line: None) as rt:
        rt.load_state_dict(state)
        assert all(is_fused(opt) for opt in rt.parts.host_optimizers)


def test_the_reference_command_steps_a_schedules_host_blocks_as_karma_does(tmp_path):
    """`python -m karma.reference MODEL --schedule FILE` is the loop a run of FILE equals."""
    mf = load_small("mlp")
    schedule = plan(mf, "offload_all")
    path = tmp_path / "s.yaml"
    schedule.save(path)
    report = run(schedule, mf, 2)
    env = {**os.environ, **dict(schedule.model.env), "OMP_NUM_THREADS": "2"}
    ran = subprocess.run(
        [sys.executable, "-m", "karma.reference", str(mf.path), "--batch-size",
         str(schedule.config.batch_size), "--steps", "2", "--schedule", str(path)],
        capture_output=True, text=True, env=env, cwd=ROOT)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert json.loads(ran.stdout.strip().splitlines()[-1])["losses"] == report.losses
