"""The model, built on the CPU (or in the host tier), placed on the compute device.

Bring-up builds the model before it knows where each tensor goes; here each parameter and
buffer moves to the device once, and what the host tier lent for building it goes back
(host/tier.py, BuildInTier).
"""

from __future__ import annotations

import torch

from karma.runtime.host.tier import BuildInTier, HostPool


def place_param(p: torch.nn.Parameter, device: torch.device | None, streamed: bool,
                tier: BuildInTier | None = None, pool: HostPool | None = None) -> None:
    """Move a parameter built on the CPU (or in the host tier) to the compute device; a
    streamed one gets no bytes there: its fetches fill it."""
    device = device or torch.device("cpu")
    built_in = tier.adopt(p) if tier is not None else None
    if built_in is None and p.device == device:
        return
    if streamed:  # the host master already holds its values; storage of its own, emptied
        p.data = torch.empty_strided(p.shape, p.stride(), dtype=p.dtype, device=device)
    else:
        p.data = p.data.to(device, copy=True)
    if built_in is not None:
        pool.free(built_in)


def place_buffers(model: torch.nn.Module, device: torch.device, tier: BuildInTier | None,
                  pool: HostPool) -> None:
    """Module buffers (BatchNorm statistics, masks) live on the compute device."""
    for module in model.modules():
        for name, buf in module._buffers.items():  # noqa: SLF001 - as Module._apply does
            if buf is None:
                continue
            built_in = tier.adopt(buf) if tier is not None else None
            if built_in is not None or buf.device != device:
                module._buffers[name] = buf.to(device, copy=True)  # noqa: SLF001
            if built_in is not None:
                pool.free(built_in)
