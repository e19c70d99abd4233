"""Overlap mode's guard: protected optimizers' tensors are written from live memory, and
``optimizer.step()`` waits until every checkpoint in flight that reads them has written them."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from fastpersist.objects import dtensor
from fastpersist.saving.capture import guarded_storages

if TYPE_CHECKING:
    from fastpersist.saving.job import SaveJob


class OverlapGuard:
    """Overlap mode's guard: protected optimizers' tensors are written from live memory, and
    ``optimizer.step()`` waits (through a step pre-hook) until every in-flight checkpoint that
    reads them has written them. ``in_flight`` lists the jobs not yet finished; ``after_wait``
    raises a background failure not yet raised."""

    def __init__(self, in_flight: Callable[[], list[SaveJob]], after_wait: Callable[[], None]) -> None:
        self._in_flight = in_flight
        self._after_wait = after_wait
        self._protected: list[torch.optim.Optimizer] = []
        self._hooks: list[Any] = []

    def protect(self, optimizer: torch.optim.Optimizer) -> None:
        if optimizer in self._protected:
            return
        self._protected.append(optimizer)
        self._hooks.append(optimizer.register_step_pre_hook(self._before_step))

    @property
    def protected(self) -> list[torch.optim.Optimizer]:
        return list(self._protected)

    def storages(self) -> set[int]:
        """The storages of the protected optimizers' parameters and state (their local shards)."""
        tensors = []
        for opt in self._protected:
            for group in opt.param_groups:
                tensors += [dtensor.local(p) for p in group["params"] if isinstance(p, torch.Tensor)]
            for st in opt.state.values():
                tensors += [dtensor.local(v) for v in st.values() if isinstance(v, torch.Tensor)]
        return guarded_storages(tensors)

    def _before_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for job in [j for j in self._in_flight() if j.live]:
            t0 = time.perf_counter()
            job.handle.staged.result()
            job.metrics.step_wait_s += time.perf_counter() - t0
        self._after_wait()

    def remove(self) -> None:
        """Remove the step hooks (close())."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._protected.clear()
