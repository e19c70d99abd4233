"""Skeletons written from templates (fastpersist.format.template) are the skeletons pickling
gives: the same bytes, storage keys, storages and tensor index, save after save, however the
numbers change, and no template is used once the structure changes."""

from __future__ import annotations

import ctypes
import io
import math
import pickle
import random
import struct
import zipfile
from collections import OrderedDict
from typing import Any

import pytest
import torch

from fastpersist.checkpointer import Checkpointer
from fastpersist.errors import UnsaveableObjectError
from fastpersist.format.template import Templates
from fastpersist.objects.write import Prepared, prepare


def _same(a: Prepared, b: Prepared) -> None:
    assert a.skeleton == b.skeleton
    assert a.keys == b.keys
    assert [s._cdata for s in a.storages] == [s._cdata for s in b.storages]
    assert a.sizes == b.sizes
    assert a.tensors == b.tensors


def _check(templates: Templates, obj: Any, name: str = "r") -> Prepared:
    got = prepare(name, obj, templates)
    _same(got, prepare(name, obj))
    return got


def _nan(payload: int) -> float:
    return struct.unpack(">d", struct.pack(">Q", 0x7FF8000000000000 | payload))[0]


def test_numbers_change_bytes_follow():
    base = torch.randn(4, 5)
    templates = Templates()
    numbers: list[Any] = [0, 1, -1, 255, 256, 65535, 65536, 2**31 - 1, 2**31, -(2**31) - 1, 2**64, -(2**100),
                          0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, _nan(1), 1e-310]
    for i, x in enumerate(numbers):
        state = {"step": x if isinstance(x, int) else i, "lr": x if isinstance(x, float) else float(i),
                 "w": base, "view": base[1], "nested": [(x, "s"), {"a": x}], "flag": True}
        _check(templates, state)
    # the structure is the same apart from int/float types, which decide it too
    assert templates.hits >= len(numbers) - 4


@pytest.mark.parametrize("change", [
    "int_to_float", "bool_to_int", "key", "dtype", "shape", "stride", "offset", "shares_storage",
    "requires_grad", "parameter", "string", "alias", "length", "ordered", "device_none",
])
def test_a_changed_structure_is_pickled(change):
    a, b, c0 = torch.randn(6), torch.randn(6), torch.randn(6)
    shared = {"x": 1}

    def state(changed: bool) -> dict[str, Any]:
        c = changed
        t1 = c0.view(torch.int32) if c and change == "dtype" else c0  # the same storage, other bytes
        t2 = a.view(2, 3) if c and change == "shape" else a.view(3, 2)
        if c and change == "stride":
            t2 = a.view(2, 3).t()
        t3 = a[1:] if c and change == "offset" else a[:5]
        t4 = a if c and change == "shares_storage" else b
        t5 = torch.nn.Parameter(b.clone()) if c and change == "parameter" else b
        d = {"x": 1}
        return {
            "n": 1.0 if c and change == "int_to_float" else 1,
            "flag": 1 if c and change == "bool_to_int" else True,
            ("k2" if c and change == "key" else "k"): 0,
            "t": [t1, t2, t3, t4, t5],
            "g": b.requires_grad_(False).clone().requires_grad_(c and change == "requires_grad"),
            "s": "other" if c and change == "string" else "name",
            "pair": [shared, shared] if c and change == "alias" else [shared, d],
            "list": [1, 2, 3] if c and change == "length" else [1, 2],
            "od": OrderedDict(x=1) if c and change == "ordered" else {"x": 1},
            "none": "None" if c and change == "device_none" else None,
        }

    templates = Templates()
    _check(templates, state(False))
    _check(templates, state(False))
    assert templates.hits == 1
    _check(templates, state(True))
    assert templates.hits == 1, "a changed structure must not be written from the old template"
    _check(templates, state(True))
    assert templates.hits == 2


def _random_state(rng: random.Random, storages: list[torch.Tensor], depth: int = 0) -> Any:
    kind = rng.choice(["dict", "list", "tuple", "od", "leaf", "leaf", "tensor"] if depth < 4 else ["leaf", "tensor"])
    if kind == "tensor":
        base = rng.choice(storages)
        start = rng.randrange(base.numel() - 4)
        return base[start : start + rng.randrange(1, 4)]
    if kind == "leaf":
        return rng.choice([rng.randrange(-(2**40), 2**40), rng.random() * 10 - 5, "s", None, True, False,
                           -0.0, rng.randrange(300)])
    n = rng.randrange(4)
    if kind in ("dict", "od"):
        items = [(rng.choice([f"k{i}", i]), _random_state(rng, storages, depth + 1)) for i in range(n)]
        d = dict(items) if kind == "dict" else OrderedDict(items)
        if kind == "od" and rng.random() < 0.5:
            d._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]
        return d
    items = [_random_state(rng, storages, depth + 1) for _ in range(n)]
    return items if kind == "list" else tuple(items)


def _renumber(obj: Any, rng: random.Random) -> Any:
    """The same structure with new numbers (ints stay ints, floats floats)."""
    t = type(obj)
    if t is int:
        return rng.choice([rng.randrange(-(2**70), 2**70), rng.randrange(256), -1])
    if t is float:
        return rng.choice([rng.random(), -0.0, 0.0, math.nan, 1e300])
    if t is dict:
        return {k: _renumber(v, rng) for k, v in obj.items()}
    if t is OrderedDict:
        out = OrderedDict((k, _renumber(v, rng)) for k, v in obj.items())
        vars(out).update({k: _renumber(v, rng) for k, v in vars(obj).items()})
        return out
    if t is list:
        return [_renumber(v, rng) for v in obj]
    if t is tuple:
        return tuple(_renumber(v, rng) for v in obj)
    return obj


def test_random_structures_and_numbers():
    rng = random.Random(1234)
    storages = [torch.randn(16), torch.arange(20, dtype=torch.int64), torch.ones(8, dtype=torch.bfloat16)]
    templates = Templates()
    for _ in range(60):
        state = {"root": _random_state(rng, storages)}
        for _ in range(4):
            _check(templates, state)
            state = _renumber(state, rng)
    assert templates.hits > 60


def test_the_unpickled_state_equals_when_strings_are_shared_differently():
    """Equal strings are equal whether or not they are one object: a template made where they
    were one object writes a skeleton that loads as the state."""
    a = "".join(["na", "me"])
    b = "".join(["na", "me"])
    assert a is not b
    templates = Templates()
    prepare("r", {"x": a, "y": a, "n": 1}, templates)
    got = prepare("r", {"x": a, "y": b, "n": 2}, templates)
    assert templates.hits == 1
    with zipfile.ZipFile(io.BytesIO(got.skeleton)) as z:
        assert pickle.loads(z.read("data.pkl")) == {"x": "name", "y": "name", "n": 2}


def test_structures_that_change_every_save_stop_being_walked():
    templates = Templates()
    losses: list[float] = []
    for i in range(Templates.GIVE_UP + 10):
        losses.append(float(i))
        _check(templates, {"losses": list(losses), "w": torch.ones(2)})
    assert templates.hits == 0
    assert templates.misses == Templates.GIVE_UP, "after GIVE_UP misses in a row no walk is made"


class Sub(torch.Tensor):
    pass


def test_states_without_templates():
    """A float key, an object of another type, a tensor subclass or attribute: pickled, never
    templated (and correct)."""
    tagged = torch.ones(2)
    tagged.note = 1.5  # type: ignore[attr-defined]
    for state in [{1.5: 1}, {"c": 1 + 2j}, {"s": torch.ones(2).as_subclass(Sub)}, {"t": tagged},
                  {"t": torch.ones(2, dtype=torch.complex64).conj()}]:
        templates = Templates()
        for _ in range(3):
            _check(templates, state)
        assert templates.hits == 0


@pytest.mark.parametrize("mode", ["sync", "snapshot", "overlap"])
def test_checkpoints_written_from_templates_load_exactly(tmp_path, mode):
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    expected = {}
    with Checkpointer(str(tmp_path / "ck"), mode=mode, keep=10) as ck:
        if mode == "overlap":
            ck.protect(opt)
        for step in range(6):
            model(torch.randn(3, 4)).sum().backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            ck.save(step, {"model": model, "opt": opt, "sched": sched, "step": step, "loss": step / 3})
            expected[step] = (model.state_dict(), opt.state_dict(), sched.state_dict())
            expected[step] = pickle.loads(pickle.dumps(expected[step]))  # noqa: S301 - a deep copy
        ck.wait()
        assert sum(m.templated for m in ck.history) >= 3  # skeletons written from templates, not pickled
        for step in range(6):
            got = ck.load(step)
            assert got["step"] == step and got["loss"] == step / 3
            m, o, s = expected[step]
            assert m.keys() == got["model"].keys()
            assert all(torch.equal(m[k], got["model"][k]) for k in m)
            assert got["model"]._metadata == m._metadata
            assert got["opt"]["param_groups"] == o["param_groups"]
            assert got["sched"] == s
            for i, st in o["state"].items():
                assert all(torch.equal(v, got["opt"]["state"][i][k]) for k, v in st.items())


def test_tensor_attributes_are_structure():
    """torch.compile marks optimizer state with an attribute; such a state still gets a
    template, and a changed mark is a changed structure. A float attribute gets none."""
    t = torch.ones(3)
    t._dynamo_static_input_type = "guarded"  # type: ignore[attr-defined]
    templates = Templates()
    for step in range(3):
        _check(templates, {"exp_avg": t, "step": step})
    assert templates.hits == 2
    t._dynamo_static_input_type = "unguarded"  # type: ignore[attr-defined]
    _check(templates, {"exp_avg": t, "step": 5})
    assert templates.hits == 2
    f = torch.ones(3)
    f.scale = 0.5  # type: ignore[attr-defined]
    templates = Templates()
    for _ in range(3):
        _check(templates, {"f": f})
    assert templates.hits == 0


def test_memory_viewed_as_two_dtypes_is_refused_after_a_template_too():
    """Pickling refuses two storages over one memory viewed as different dtypes; a template
    learnt from independent tensors does not let such a state through."""
    memory = (ctypes.c_float * 4)()
    a, b = torch.frombuffer(memory, dtype=torch.float32), torch.zeros(4, dtype=torch.int32)
    templates = Templates()
    prepare("r", {"a": a, "b": b}, templates)
    prepare("r", {"a": a, "b": b}, templates)
    assert templates.hits == 1
    alias = torch.frombuffer(memory, dtype=torch.int32)  # another storage object, the same memory
    assert alias.untyped_storage()._cdata != a.untyped_storage()._cdata
    with pytest.raises(UnsaveableObjectError, match="different types"):
        prepare("r", {"a": a, "b": alias}, templates)


def test_a_state_nested_deeper_than_the_walk_goes_is_pickled():
    deep: Any = 1
    for _ in range(400):
        deep = [deep]
    templates = Templates()
    for _ in range(2):
        _check(templates, {"x": deep})
    assert templates.hits == 0
