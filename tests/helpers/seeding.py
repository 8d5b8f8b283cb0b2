"""Checking that a draw given no generator follows none but one seeded 0 (kvcert.seeding)."""

from __future__ import annotations

from typing import Callable

import torch


def assert_seeded_zero_without_a_generator(draw: Callable[[torch.Generator | None], torch.Tensor], name: str = ""):
    """``draw(None)`` equals ``draw`` from a generator seeded 0, twice, whatever torch's global generator holds."""
    seeded_zero = draw(torch.Generator().manual_seed(0))
    torch.manual_seed(123)
    first = draw(None)
    torch.rand(7)  # moves the global generator: the default must not follow it
    assert torch.equal(first, seeded_zero) and torch.equal(draw(None), seeded_zero), name
