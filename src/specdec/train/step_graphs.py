"""What a training step recorded as a CUDA graph needs (specdec.shape_graphs.ShapeGraphs records
the whole step: forward, backward, gradient clipping, the optimizer's update), and `train`
provides: inputs of one shape per graph (batches padded to length buckets), an optimizer that
runs inside a graph (`capturable=True`) and whose state already exists (its first step runs as
it is), and its learning rate held in a device tensor the scheduler fills between steps (a float
would be recorded as a constant).
"""

from __future__ import annotations

import torch


def hold_lr(opt: torch.optim.Optimizer, device: torch.device | None) -> None:
    """Each parameter group's learning rate as a float, or with `device` as a tensor there: a step
    replayed as a graph reads it from that tensor, which the scheduler fills in place between
    steps (from host floats, so without a sync). Also after loading a checkpoint of either kind."""
    for g in opt.param_groups:
        lr = float(g["lr"])
        g["lr"] = lr if device is None else torch.tensor(lr, dtype=torch.float32, device=device)
