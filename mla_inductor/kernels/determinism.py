"""PyTorch's deterministic mode for a block of the PyTorch backends' work (the ``index_add_``
accumulations of the reference and emulate backwards), so that a backward traced with the mode on
stays deterministic when it runs with the mode off."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def deterministic_mode(on: bool):
    """PyTorch's deterministic mode for the block when ``on`` (and not already on), restored
    after it: an ``index_add_`` (dkv's, dk's) is then deterministic on CUDA too (PyTorch's list of ops
    that act deterministically under ``torch.use_deterministic_algorithms(True)``); on a CPU it
    always is. Lets a backward traced with the mode on stay deterministic when it runs with
    the mode off."""
    if not on or torch.are_deterministic_algorithms_enabled():
        yield
        return
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False, warn_only=warn_only)
