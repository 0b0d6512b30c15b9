"""Shared test helpers: load example model files with their size chosen by environment."""

from __future__ import annotations

import os
import signal
from contextlib import contextmanager
from pathlib import Path

import pytest

from karma.modelfile import ModelFile, load_model_file
from karma.testing.exactness import SMALL_ENV

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
MODELS = Path(__file__).resolve().parent / "models"



def load_example(name: str, monkeypatch: pytest.MonkeyPatch, **env: str) -> ModelFile:
    """Load examples/NAME.py with its small size (or the environment given)."""
    for key, value in {**SMALL_ENV.get(name, {}), **env}.items():
        monkeypatch.setenv(key, value)
    return load_model_file(EXAMPLES / f"{name}.py")


@contextmanager
def environment(env: dict[str, str]):
    """Set `env` in os.environ for the block, then restore what was there."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture(scope="session", autouse=True)
def _karma_cache(tmp_path_factory):
    """Measurements (karma/calibrate) go to a cache of this session's own, shared with the
    commands the tests start, never to the user's ~/.cache/karma: the machine is measured
    once a session and each small model's blocks once."""
    with environment({"XDG_CACHE_HOME": str(tmp_path_factory.mktemp("xdg-cache"))}):
        yield


@pytest.fixture
def restore_environment_and_signals():
    """karma-run (its main, called in this process) sets the schedule's KARMA_* variables
    and its signal handlers; undo both."""
    saved = dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGXFSZ)}
    yield
    os.environ.clear()
    os.environ.update(saved)
    for s, handler in handlers.items():
        signal.signal(s, handler)


@pytest.fixture
def example(monkeypatch):
    return lambda name, **env: load_example(name, monkeypatch, **env)


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


__all__ = ["EXAMPLES", "MODELS", "ROOT", "load_example", "os"]
