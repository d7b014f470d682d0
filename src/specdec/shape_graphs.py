"""A function of fixed-shape tensors recorded as one CUDA graph per input shape, then replayed.

Two things run this way: a whole training step (train/step_graphs.py says what a recorded step
needs) and the target's forward pass in online training (capture/run.py). Each is hundreds of
short kernels launched from Python, and the GPU waits on the host between them; replayed, the host
pays one copy per input and one launch. Inputs must come in a few shapes (batches padded to length
buckets), and nothing a graph computes may be read on the host inside it.
"""

from __future__ import annotations

import threading
from typing import Callable

import torch

from .errors import SpecdecError

# One recording at a time in this process: online training records the target's forward in the
# prefetch thread while the main thread may record a training step, and captures that overlap
# would meet in the caching allocator.
_RECORDING = threading.Lock()


class ShapeGraphs:
    """`fn(inputs) -> outputs` (a tensor or a tuple of tensors) recorded once per input shape, then
    replayed; each call returns copies of the outputs.

    `warm(inputs)` (default: `fn` itself) runs before a shape's recording, on the recording stream,
    with the same inputs: it compiles what is compiled for that shape and lets cuBLAS and the
    allocator set up outside the recording; a `fn` with side effects passes one that has none. All
    of one object's graphs share a memory pool, so they must never run at once: one object serves
    one thread. `failure_hint` ends the error raised when a recording fails (what to do instead).
    """

    def __init__(self, fn: Callable[[tuple], torch.Tensor | tuple], device, *,
                 warm: Callable[[tuple], object] | None = None, failure_hint: str = ""):
        self.fn, self.warm, self.failure_hint = fn, warm or fn, failure_hint
        self.stream = torch.cuda.Stream(device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple, torch.Tensor | tuple]] = {}

    @staticmethod
    def key(inputs: tuple) -> tuple:
        return tuple(None if t is None else (tuple(t.shape), t.dtype) for t in inputs)

    def __call__(self, inputs: tuple):
        key = self.key(inputs)
        if key not in self.graphs:
            self.graphs[key] = self._record(inputs)
        graph, static, outputs = self.graphs[key]
        for s, t in zip(static, inputs):
            if s is not None:
                s.copy_(t)
        graph.replay()
        # Copies: the next replay of any of these graphs may reuse the pool's memory.
        if isinstance(outputs, torch.Tensor):
            return outputs.clone()
        return tuple(o.clone() for o in outputs)

    def _record(self, inputs: tuple):
        static = tuple(None if t is None else t.clone() for t in inputs)  # outside the pool
        with _RECORDING:
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                self.warm(static)
            torch.cuda.current_stream().wait_stream(self.stream)
            graph = torch.cuda.CUDAGraph()
            try:
                # thread_local: another thread may sync or launch meanwhile (the prefetch thread
                # loading batches, the main thread replaying steps).
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
                    outputs = self.fn(static)
            except RuntimeError as e:
                raise SpecdecError(f"recording a CUDA graph failed for input shape {self.key(inputs)}: {e}. "
                                   f"{self.failure_hint}".rstrip()) from e
        return graph, static, outputs
