"""A whole training step (forward, backward, gradient clipping, the optimizer's update) recorded as
one CUDA graph per batch shape and replayed.

A small drafter's step is hundreds of short kernels. Compiled, they are fewer and fused, but each
is still launched from Python, with autograd and the compiled functions' own bookkeeping between
them, and the GPU waits on the host. Replaying the step as one graph leaves the host one copy per
input and one launch per step, whichever kernels (eager or compiled) the step runs.

What a recorded step needs, and `train` provides: inputs of one shape per graph (batches padded
to length buckets), an optimizer that runs inside a graph (`capturable=True`) and whose state
already exists (its first step runs as it is), and its learning rate held in a device tensor the
scheduler fills between steps (a float would be recorded as a constant).
"""

from __future__ import annotations

from typing import Callable

import torch

from ..errors import SpecdecError


class StepGraphs:
    """`step(inputs) -> stats` (a small tensor) recorded once per input shape, then replayed.

    `warm(inputs)` runs before a shape's recording, on the recording stream, with the same inputs:
    it must run the step's forward and backward but leave the weights alone. It compiles what is
    compiled for that shape and lets cuBLAS and the allocator set up outside the recording.
    All graphs share one memory pool: they never run at once, and nothing a graph leaves behind is
    read after the next replay except the stats, which are copied out.
    """

    def __init__(self, step: Callable[[tuple], torch.Tensor], warm: Callable[[tuple], None], device):
        self.step, self.warm = step, warm
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple, torch.Tensor]] = {}

    @staticmethod
    def key(inputs: tuple) -> tuple:
        return tuple(None if t is None else (tuple(t.shape), t.dtype) for t in inputs)

    def __call__(self, inputs: tuple) -> torch.Tensor:
        key = self.key(inputs)
        if key not in self.graphs:
            self.graphs[key] = self._record(inputs)
        graph, static, stats = self.graphs[key]
        for s, t in zip(static, inputs):
            if s is not None:
                s.copy_(t)
        graph.replay()
        return stats.clone()  # the next replay of any graph may reuse the pool's memory

    def _record(self, inputs: tuple):
        static = tuple(None if t is None else t.clone() for t in inputs)  # outside the pool
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self.warm(static)
        torch.cuda.current_stream().wait_stream(self.stream)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the prefetch thread keeps loading batches (and syncing) while this records.
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                stats = self.step(static)
        except RuntimeError as e:
            raise SpecdecError(
                f"recording a training step as a CUDA graph failed for batch shape {self.key(inputs)}: {e}. "
                "Train without --cuda-graphs; --resume continues from the last checkpoint") from e
        return graph, static, stats


def hold_lr(opt: torch.optim.Optimizer, device: torch.device | None) -> None:
    """Each parameter group's learning rate as a float, or with `device` as a tensor there: a step
    replayed as a graph reads it from that tensor, which the scheduler fills in place between
    steps (from host floats, so without a sync). Also after loading a checkpoint of either kind."""
    for g in opt.param_groups:
        lr = float(g["lr"])
        g["lr"] = lr if device is None else torch.tensor(lr, dtype=torch.float32, device=device)
