"""The embedded engine's decode step captured as CUDA graphs.

An eager decode step launches one kernel per operation through Python — about a
thousand for a 28-layer model — so a small model on a fast GPU spends most of a step
launching. A CUDA graph replays the whole captured step with one launch. The step's
shapes depend only on (rows, columns) (see :mod:`qwengyre.engines.kv_slots`), so one
graph per bucket of each (powers of two) serves every step; its inputs are read from
fixed device tensors the engine fills before each replay. Graphs are captured at the
first step that needs them and share one memory pool (they never run concurrently).
A capture that fails raises :class:`GraphCaptureFailed`; the engine then warns and
decodes eagerly, which is slower but computes the same.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class GraphCaptureFailed(RuntimeError):
    """The decode step could not be captured (the engine then decodes eagerly)."""


DecodeForward = Callable[[int, int], torch.Tensor]
"""``forward(rows, columns) -> logits [rows, vocab]``, reading only fixed input tensors."""


class DecodeGraphs:
    """Runs a decode forward through one captured CUDA graph per (rows, columns)."""

    def __init__(self, forward: DecodeForward) -> None:
        self._forward = forward
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def __call__(self, rows: int, columns: int) -> torch.Tensor:
        """The step's logits: the graph is replayed, or captured first (which also runs it)."""
        key = (rows, columns)
        if key not in self._graphs:
            self._graphs[key] = self._capture(rows, columns)
            return self._graphs[key][1]
        graph, logits = self._graphs[key]
        graph.replay()
        return logits

    def clear(self) -> None:
        """Forget every graph (the tensors they captured moved or were freed)."""
        self._graphs.clear()
        self._pool = torch.cuda.graph_pool_handle()

    def __len__(self) -> int:
        return len(self._graphs)

    def _capture(self, rows: int, columns: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # A warm-up run on a side stream first, as capture requires; it computes this very
        # step (the inputs are already in place), and the capture itself runs nothing.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            logits = self._forward(rows, columns)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        try:
            # thread_local: the engine's worker captures while the process's other threads
            # (a cell's server, a weights read) may use CUDA; those calls are not captured.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                captured = self._forward(rows, columns)
        except RuntimeError as exc:
            raise GraphCaptureFailed(
                f"capturing the decode step ({rows} rows, {columns} KV columns) as a CUDA"
                f" graph failed: {exc}"
            ) from exc
        captured.copy_(logits)  # this step's result, for the caller; replays overwrite it
        return graph, captured
