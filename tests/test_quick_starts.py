"""The README's three quick starts (a model file with the commands, a model object in your
own loop, a Hugging Face Trainer script), run as they are written there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

COMMANDS = ("plan", "inspect", "run", "export")


def quick_start(name: str) -> str:
    """The code block under `<!-- quick start: NAME -->` in README.md."""
    text = (ROOT / "README.md").read_text()
    found = re.search(rf"<!-- quick start: {name} -->\n```\w+\n(.*?)```", text, re.S)
    assert found, f"README.md has no quick start {name!r}"
    return found[1]


def test_the_quick_starts_fit_in_fifteen_lines():
    for name in ("commands", "library", "trainer"):
        assert len(quick_start(name).splitlines()) <= 15, name


def run(argv: list[str], cwd: Path, path: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if path is not None:
        env["PATH"] = f"{path}{os.pathsep}{env['PATH']}"
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_the_commands_quick_start(tmp_path):
    bin_dir = tmp_path / "bin"  # the commands as installed, whether or not they are
    bin_dir.mkdir()
    for command in COMMANDS:
        script = bin_dir / f"karma-{command}"
        script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m karma.cli.{command} "$@"\n')
        script.chmod(0o755)
    (tmp_path / "examples").symlink_to(ROOT / "examples")
    done = run(["bash", "-e", "-c", quick_start("commands")], tmp_path, bin_dir)
    out = done.stdout + done.stderr
    assert "planning for this machine: cpu" in out
    assert "step 20/20" in out and "resumed from" in out and "step 40/40" in out
    for made in ("gpt.yaml", "gpt.png", "gpt.pt", "ckpt/step_40"):
        assert (tmp_path / made).exists(), made


def test_the_library_quick_start(tmp_path):
    (tmp_path / "train.py").write_text(quick_start("library"))
    run([sys.executable, "train.py"], tmp_path)
    assert (tmp_path / "ckpt" / "step_10" / "meta.json").is_file()


def test_the_trainer_quick_start(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    datasets = '''
import torch

class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        self.ids = torch.randint(0, 512, (n, 32), generator=torch.Generator().manual_seed(seed))
    def __len__(self):
        return len(self.ids)
    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i].clone()}

train, held_out = Tokens(32, 0), Tokens(8, 1)
'''
    check = '''
LlamaForCausalLM.from_pretrained("out/final")
assert trainer.state.global_step == 4
'''
    (tmp_path / "train.py").write_text(datasets + quick_start("trainer") + check)
    run([sys.executable, "train.py"], tmp_path)
