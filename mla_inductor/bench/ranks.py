"""Spawned process groups: run one function on every rank of a local group and collect what each
rank returns.

:func:`spawn` starts ``ranks`` processes (``torch.multiprocessing.spawn``), joins them in a group
through a file in a temporary folder of their own (no port to pick, so no race for one with
other programs on the machine) (NCCL with one GPU per rank, ``cuda:<rank>``, on CUDA; gloo on the CPU,
the CPU's cores split between the ranks), gives the function a 1-D device mesh of every rank and
returns each rank's JSON-serialisable result in rank order. ``bench dist`` (its layer table and
its ``--train`` run) and ``tests/distributed/test_distributed.py`` (gloo and NCCL) run through it.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import tempfile
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist


def device_name(device: torch.device) -> str:
    """The GPU's name (``torch.cuda.get_device_name``) for a CUDA device, else ``"CPU"``."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def _worker(rank: int, fn: Callable, ranks: int, device_type: str, args: tuple,
            timeout_s: Optional[float], folder: str) -> None:
    """One rank: joins the group (rendezvous in ``<folder>/store``), runs ``fn(mesh, device,
    *args)``, writes its result to ``<folder>/rank<rank>.json``, leaves the group once every
    rank is done with it (see the comment at its end) and ends the process with ``os._exit(0)``;
    on an exception it leaves the group and re-raises."""
    from torch.distributed.device_mesh import init_device_mesh

    group = dict(init_method="file://" + os.path.join(folder, "store"), rank=rank,
                 world_size=ranks,
                 timeout=None if timeout_s is None else datetime.timedelta(seconds=timeout_s))
    if device_type == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **group)
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // ranks))
        dist.init_process_group("gloo", **group)
    try:
        result = fn(init_device_mesh(device_type, (ranks,)), device, *args)
        with open(os.path.join(folder, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    except BaseException:
        dist.destroy_process_group()
        raise
    # Leaving: no rank tears the group down while another may still be finishing the barrier,
    # and none closes its connections (by exiting) while another is still destroying the group;
    # then the process ends at once. Leaving through the interpreter's normal shutdown, a gloo
    # rank now and then died with "terminate called without an active exception" (SIGABRT; CI
    # on 2 cores, 2026-12-01).
    _all_reached(folder, "returned", rank, ranks)
    dist.destroy_process_group()
    _all_reached(folder, "destroyed", rank, ranks)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _all_reached(folder: str, point: str, rank: int, ranks: int) -> None:
    """Marks ``point`` reached by ``rank`` (a file in ``folder``) and waits until every rank has
    marked it. A rank that dies instead makes ``torch.multiprocessing.spawn`` stop the others."""
    open(os.path.join(folder, f"{point}{rank}"), "w").close()
    while not all(os.path.exists(os.path.join(folder, f"{point}{r}")) for r in range(ranks)):
        time.sleep(0.005)


def spawn(fn: Callable, ranks: int, device_type: str, args: tuple = (),
          timeout_s: Optional[float] = None) -> list:
    """Runs ``fn(mesh, device, *args)`` on ``ranks`` spawned processes and returns their results.

    Args:
        fn: a module-level function (it is pickled to the ranks), called with a 1-D
            ``DeviceMesh`` of every rank, the rank's ``torch.device`` and ``args``; it returns
            something ``json.dump`` takes.
        ranks: processes to start (one GPU each on CUDA: ``cuda:0`` ... ``cuda:<ranks - 1>``).
        device_type: ``"cuda"`` (NCCL) or ``"cpu"`` (gloo).
        args: further arguments, pickled to every rank.
        timeout_s: the group's collective timeout in seconds (``None``: torch's default).

    Returns:
        The results, ``[rank 0's, rank 1's, ...]``.

    Raises:
        torch.multiprocessing.ProcessRaisedException: a rank raised (the message carries its
            traceback); ``ProcessExitedException`` when a rank died.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        mp.spawn(_worker, args=(fn, ranks, device_type, tuple(args), timeout_s, folder),
                 nprocs=ranks)
        found = []
        for rank in range(ranks):
            with open(os.path.join(folder, f"rank{rank}.json")) as f:
                found.append(json.load(f))
    return found
