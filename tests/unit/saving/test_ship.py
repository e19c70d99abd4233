"""A captured save as a message (fastpersist.saving.ship), without processes: what the encoder
places where, and what the decoder rebuilds over other mappings of the same memory."""

from __future__ import annotations

import collections
import os

import pytest
import torch

from fastpersist.errors import CheckpointError
from fastpersist.io.buffers import ALIGN, SharedMemory, map_shared
from fastpersist.saving.ship import NotPlain, Shipped, decode, encode


class Local:  # a class of the caller's own: the save process may not import it
    pass


def _placed(enc, arena: torch.Tensor) -> None:
    """Copy what the encoder placed into ``arena`` (what Stager.pack does)."""
    for pos, storage in enc.pending:
        n = storage.nbytes()
        arena[pos : pos + n].copy_(torch.empty(0, dtype=torch.uint8).set_(storage, 0, (n,), (1,)))


def test_a_state_round_trips_over_another_mapping_of_the_shared_memory():
    region = SharedMemory(1 << 16)
    live = region.tensor[:4096].view(torch.float32)  # a moved tensor: read in place, not copied
    live.copy_(torch.arange(1024, dtype=torch.float32))
    p = torch.nn.Parameter(torch.randn(3, 5))
    t = torch.randn(10, 7)[:, 2:5]  # a strided view: offset and strides kept
    vars(t)["tag"] = "x"
    shared = torch.ones(6)
    state = {"p": p, "t": t, "live": live, "a": shared[1:], "b": shared[:2], "empty": torch.empty(0),
             "od": collections.OrderedDict(k=1), "dtype": torch.bfloat16, "n": 3, "s": "x"}
    enc = encode(Shipped(5, state, {"r": torch.full((2,), 7.0)}), {region.tensor.untyped_storage().data_ptr():
                                                                    (("r", 1), region.tensor.data_ptr())}, strict=True)
    assert enc.live_used
    assert [pos for pos, _ in enc.pending] == [i * ALIGN for i in range(4)]  # p, t's storage, shared, r: once each
    arena = SharedMemory(enc.pos)
    _placed(enc, arena.tensor)
    # the save process maps the same memory through the descriptors
    out = decode(enc.message, {"a": map_shared(arena.fd, arena.size), ("r", 1): map_shared(region.fd, region.size)})
    got = out.state
    assert out.step == 5 and torch.equal(out.rank_state["r"], torch.full((2,), 7.0))
    assert type(got["p"]) is torch.nn.Parameter and torch.equal(got["p"], p) and got["p"].requires_grad
    assert got["t"].stride() == t.stride() and torch.equal(got["t"], t) and vars(got["t"]) == {"tag": "x"}
    assert torch.equal(got["live"], live) and got["live"].data_ptr() != live.data_ptr()
    live.add_(1)  # the same memory, another mapping: the save process sees the training process's bytes
    assert torch.equal(got["live"], live)
    assert got["a"].untyped_storage().data_ptr() == got["b"].untyped_storage().data_ptr()  # still one storage
    assert got["empty"].numel() == 0 and got["od"] == collections.OrderedDict(k=1) and got["dtype"] is torch.bfloat16


def test_values_the_save_process_might_not_import_are_refused_when_strict():
    with pytest.raises(NotPlain, match="Local"):
        encode(Shipped(1, {"x": Local()}, None), {}, strict=True)
    with pytest.raises(NotPlain, match="lazy view"):
        encode(Shipped(1, {"c": torch.ones(4, dtype=torch.complex64).conj()}, None), {}, strict=True)
    assert encode(Shipped(1, {"x": Local()}, None), {}, strict=False).message  # pickled by reference


def test_a_message_naming_memory_not_mapped_is_refused():
    enc = encode(Shipped(1, {"w": torch.ones(2048)}, None), {}, strict=True)  # 8 KiB
    with pytest.raises(CheckpointError, match="not mapped"):
        decode(enc.message, {})
    small = SharedMemory(4096)
    with pytest.raises(CheckpointError, match="past shared memory"):
        decode(enc.message, {"a": small.tensor})


def test_shared_memory_is_not_a_file_of_dev_shm():
    before = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    mem = SharedMemory(1 << 20)
    assert os.readlink(f"/proc/self/fd/{mem.fd}").startswith("/memfd:")
    assert (set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) == before
    mem.close()
