r"""
A whole step (`static_step.py`) captured as a CUDA graph: on a GPU a step's few thousand small kernels cost more to
launch from Python than to run (a 12-node tree step of the 135M default took 40-70 ms on an H200, where its
weights take well under a millisecond to read), so each tree's step is recorded once and replayed as one launch.

A graph replays the same kernels on the same memory, so its inputs are static buffers: the tensors the step was
captured with. A call copies the new values into them where they are other tensors (the state the last replay
returned: the root, the hidden state, the lengths), and the caches stay where they are, written in place: a graph
replays only over the caches it was captured over, which `StaticSteps` lends from decode to decode. Its outputs are
the graph's own tensors, overwritten by the next replay. Capturing runs the step a few times first, on the caches
beyond their used length, where a step writes anyway; the state it is captured with is left as it was.
"""

from typing import Callable

import torch
from torch.utils._pytree import tree_leaves

WARM_UP_RUNS = 1  # eager runs before capturing, on a side stream as capturing asks: cuBLAS sets up in the first


def capture(step: Callable, args: tuple, pool=None) -> tuple[tuple, Callable[[], None], object]:
    """Record `step(*args)` as a CUDA graph -> (its outputs, a function that replays it, its memory pool, which
    another graph may share: `pool`)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(WARM_UP_RUNS):
            step(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        outputs = step(*args)
    return outputs, graph.replay, graph.pool()


class CapturedStep:
    """`step` replayed from a graph captured over `args`: called with arguments of the same shapes, it returns the
    graph's outputs (overwritten by the next call)."""

    def __init__(self, step: Callable, args: tuple, pool=None):
        self.inputs = tensors(args)
        self.outputs, self.replay, self.pool = capture(step, args, pool)

    def __call__(self, *args) -> tuple:
        for static, new in zip(self.inputs, tensors(args), strict=True):
            if static.data_ptr() != new.data_ptr():  # the caches' views are the memory captured: nothing to copy
                static.copy_(new)
        self.replay()
        return self.outputs


def tensors(args: tuple) -> list[torch.Tensor]:
    """The tensors of nested arguments, in order (an absent n-gram chain is None)."""
    return [leaf for leaf in tree_leaves(args) if leaf is not None]
