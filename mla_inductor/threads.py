"""CPU thread counts for the tools' runs (the demo and the numerics command).

On the CPU the tools default to one thread: their ops are small, and OpenMP barriers spin when
other processes share the cores. Measured on a 2-core machine: a demo step took 0.07 s with 1
thread and 0.05 s with 2 when idle, but 0.1 s against 1.8 s with 2 when other jobs were running;
``python -m mla_inductor.numerics`` took 39 s with one thread and 130 s with two on a busy
machine. On a GPU run torch's own count stays.
"""

from __future__ import annotations

import contextlib

import torch


def default_threads(device) -> int:
    """1 for a run on the CPU, torch's current count (``torch.get_num_threads()``) otherwise."""
    return 1 if torch.device(device).type == "cpu" else torch.get_num_threads()


@contextlib.contextmanager
def cpu_threads(count: int):
    """Sets torch's intra-op CPU thread count to ``count`` inside the block and restores the
    previous count after it.

    Raises:
        ValueError: for ``count < 1``.
    """
    if count < 1:
        raise ValueError(f"the CPU thread count must be >= 1, got {count}")
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
