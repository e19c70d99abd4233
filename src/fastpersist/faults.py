"""Fault injection for users' own tests: :mod:`fastpersist.storage.faults` under its public name.

``from fastpersist.faults import Fault, FaultyBackend`` (see that module)."""

from fastpersist.storage.faults import Fault, FaultyBackend, HoldWrite, NodeLocal

__all__ = ["Fault", "FaultyBackend", "HoldWrite", "NodeLocal"]
