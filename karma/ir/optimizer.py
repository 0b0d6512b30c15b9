"""The model file's optimizer, measured: what its state and its step's temporaries cost."""

from __future__ import annotations

import torch

from karma.errors import ModelFileError
from karma.ir.graph import OptimizerProfile
from karma.ir.measure import LiveBytes
from karma.modelfile import ModelFile, user_frame


def optimizer_profile(mf: ModelFile) -> OptimizerProfile:
    """Step the model file's optimizer on a small parameter and count what it allocates.

    A first step creates the state; a second one, under a counting dispatch mode, shows the
    temporaries. Any optimizer works, with no table of known ones.
    """
    param = torch.nn.Parameter(torch.randn(64, 64, generator=torch.Generator().manual_seed(0)))
    try:
        opt = mf.make_optimizer([param])
        param.grad = torch.ones_like(param)
        opt.step()
        state = [v for v in opt.state.get(param, {}).values() if isinstance(v, torch.Tensor)]
        live = LiveBytes(known=[param, param.grad, *state])
        with live, torch.no_grad():
            opt.step()
    except Exception as e:  # noqa: BLE001 - user code
        raise ModelFileError(
            f"{mf.path}: make_optimizer(params) failed on a test parameter: "
            f"{type(e).__name__}: {e}{user_frame(e, mf.path)}") from e
    nbytes = param.numel() * param.element_size()
    return OptimizerProfile(
        state_factor=sum(1 for v in state if v.shape == param.shape),
        temp_factor=round(live.peak / nbytes, 3),
    )
