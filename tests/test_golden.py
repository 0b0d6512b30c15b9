"""The golden schedules in schedules/ are exactly what karma-plan produces today."""

from __future__ import annotations

import importlib.util

import pytest

from karma.schedule_load import load_schedule
from tests.conftest import ROOT


def _golden_module():
    spec = importlib.util.spec_from_file_location("golden", ROOT / "schedules" / "golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_golden_schedules_regenerate_identically():
    golden = _golden_module()
    problems = golden.check()
    assert not problems, "\n\n".join(problems) + (
        "\n\nIf the change is intended, run: .venv/bin/python schedules/golden.py")


def test_golden_readme_lists_every_case_and_files_load():
    golden = _golden_module()
    readme = (ROOT / "schedules" / "README.md").read_text()
    for name, env, argv in golden.CASES:
        assert golden.command(env, argv, "schedules/" + name) in readme
        s = load_schedule(ROOT / "schedules" / name)
        assert s.strategy == "ilp" and s.status == "optimal"
        assert s.predicted.peak_device_bytes <= s.config.capacity_bytes
