"""Big models are planned on the meta device: GPT-2 XL's IR costs little memory."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

import pytest

from tests.conftest import EXAMPLES, ROOT


@pytest.mark.slow
def test_gpt_xl_ir_fits_in_3_gib_of_rss():
    env = {**os.environ, "KARMA_GPT": "xl"}
    proc = subprocess.run(
        [sys.executable, "-m", "karma.cli.plan", str(EXAMPLES / "gpt.py"), "--print-ir",
         "--batch-size", "8", "--json"],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    assert peak_kib < 3 * 1024 * 1024  # ru_maxrss is in KiB on Linux
    doc = json.loads(proc.stdout)
    assert len(doc["blocks"]) == 48 + 2
    params = doc["total_param_bytes"] // 4
    assert 1.55e9 < params < 1.57e9  # GPT-2 XL: about 1.56B parameters
