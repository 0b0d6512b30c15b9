"""The Hugging Face zoo: unmodified models from configs (examples/hf_*.py, tiny sizes) train
under karma-run with a plan at half of keep_all's peak, bitwise as the plain loop does.

Needs transformers (a dev dependency); skipped without it.
"""

from __future__ import annotations

import functools

import pytest

from karma.runtime.checkpoints.export import model_state_dict
from karma.testing.exactness import assert_bitwise_equal, load_with_env, plan, reference_train, run
from tests.conftest import EXAMPLES

pytest.importorskip("transformers")

ZOO = ["hf_llama", "hf_qwen2", "hf_mistral", "hf_neox", "hf_bert", "hf_t5", "hf_vit",
       "hf_mixtral", "hf_gpt2"]
TINY = {"KARMA_HF": "tiny", "KARMA_HF_GPT2": "tiny"}


STEPS = 3


@functools.cache
def zoo_case(name: str):
    """(model file, its plan at half of keep_all, the plain loop's (state_dict, losses) after
    STEPS steps), made once a session (tests/test_chaos.py trains it under chaos too)."""
    mf = load_with_env(EXAMPLES / f"{name}.py", TINY)
    schedule = plan(mf, "ilp", 0.5)
    return mf, schedule, reference_train(mf, schedule.config.batch_size, STEPS, schedule=schedule)


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n == ZOO[0] else pytest.mark.slow)
                                  for n in ZOO])
def test_zoo_model_trains_bitwise_at_half_of_keep_all(name, tmp_path):
    mf, schedule, (ref_sd, ref_losses) = zoo_case(name)
    assert any(b.act != "keep" or b.weights == "streamed" for b in schedule.blocks)
    report = run(schedule, mf, STEPS, checkpoint_dir=tmp_path)
    assert report.losses == ref_losses
    assert_bitwise_equal(model_state_dict(tmp_path / f"step_{STEPS}"), ref_sd)
