"""Where the library's random draws come from when the caller gives no generator."""

from __future__ import annotations

import torch


def generator_or_seeded_zero(generator: torch.Generator | None, device: torch.device | str = "cpu") -> torch.Generator:
    """``generator``, or without one a fresh generator on ``device`` seeded 0: what the library's draws (a
    policy's sketch, a design's sample or tie-breaking jitter) come from when no generator is given, so that they
    never depend on torch's global generator, whose state depends on whatever the process ran before."""
    return generator if generator is not None else torch.Generator(device=device).manual_seed(0)
