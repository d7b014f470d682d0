"""Batches loaded ahead of the step that uses them, on their own CUDA stream."""

from __future__ import annotations

import torch
from torch.profiler import record_function


class Prefetch:
    """`load(item)` for the items ahead of the one in use, in a worker thread on its own CUDA stream.

    A small drafter's step is short: reading its samples from disk, padding them, the first epoch's
    target argmax and the copy to the GPU would otherwise leave the device idle for much of each
    step. The consumer's stream waits on an event recorded after each load, so kernels never read a
    batch before its copy ends. Without CUDA the loads run inline: a CPU's cores are the compute.
    """

    def __init__(self, load, items, device: torch.device, ahead: int = 2):
        self.load, self.items, self.ahead = load, iter(items), ahead
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.pool = None
        if self.cuda:
            from concurrent.futures import ThreadPoolExecutor

            self.pool = ThreadPoolExecutor(1, thread_name_prefix="specdec-prefetch")

    def _load_on_stream(self, item):
        with torch.cuda.stream(self.stream):
            out = self.load(item)
            done = torch.cuda.Event()
            done.record(self.stream)
        return out, done

    def __iter__(self):
        if not self.cuda:
            yield from (self.load(item) for item in self.items)
            return
        queue = []
        try:
            while True:
                while len(queue) < self.ahead:
                    item = next(self.items, None)
                    if item is None:
                        break
                    queue.append(self.pool.submit(self._load_on_stream, item))
                if not queue:
                    return
                with record_function("train: wait for batch"):  # the step outran the loads
                    out, done = queue.pop(0).result()
                current = torch.cuda.current_stream()
                current.wait_event(done)
                for t in _tensors(out):
                    t.record_stream(current)  # its memory came from the worker's stream
                yield out
        finally:
            for f in queue:
                f.cancel()
            self.pool.shutdown(wait=True)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (tuple, list)):
        for y in x:
            yield from _tensors(y)
