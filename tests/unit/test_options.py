"""The Checkpointer's options as objects (Retention, Durable, Nodes), and the keyword shorthands
that earlier releases documented: each way gives the same options, an option given both ways or
an unknown keyword is refused, and an error names what the caller wrote."""

from __future__ import annotations

import pytest
import torch

import fastpersist as fp
from fastpersist.options import Durable, Nodes, Retention, from_shorthands


def test_shorthands_build_the_same_options_as_the_objects(tmp_path):
    by_keywords = from_shorthands(None, str(tmp_path / "d"), None, {
        "keep": 3, "keep_every": 10, "abandoned": "delete", "durable_every": 5, "durable_keep": 2,
        "durable_bandwidth": 1e6, "node": "n1", "redundancy": 1})
    by_objects = from_shorthands(Retention(3, 10, "delete"), Durable(str(tmp_path / "d"), 5, 2, 1e6),
                                 Nodes("n1", 1), {})
    assert by_keywords == by_objects
    assert from_shorthands(None, None, None, {}) == from_shorthands(Retention(), None, Nodes(), {})


@pytest.mark.parametrize("objects,shorthand", [
    ({"retention": Retention(keep=2)}, {"keep": 3}),
    ({"nodes": Nodes(redundancy=1)}, {"node": "a"}),
    ({"durable": "DURABLE"}, {"durable_every": 2}),
])
def test_an_option_given_both_ways_is_refused(tmp_path, objects, shorthand):
    args = {"retention": None, "durable": None, "nodes": None, **objects}
    if args["durable"] == "DURABLE":
        args["durable"] = Durable(str(tmp_path))
    with pytest.raises(TypeError, match="were both given"):
        from_shorthands(args["retention"], args["durable"], args["nodes"], shorthand)


def test_errors_name_what_the_caller_wrote(tmp_path):
    with pytest.raises(ValueError, match="keep_every"):
        fp.Checkpointer(str(tmp_path / "r"), keep_every=0)
    with pytest.raises(ValueError, match=r"Retention\(every=...\)"):
        Retention(every=0)
    with pytest.raises(TypeError, match="durable_keep"):
        fp.Checkpointer(str(tmp_path / "r"), durable=str(tmp_path / "d"), durable_keep=1.5)
    with pytest.raises(ValueError, match="abandoned must be one of"):
        Retention(abandoned="sometimes")
    with pytest.raises(TypeError, match="unexpected keyword argument 'kep'"):
        fp.Checkpointer(str(tmp_path / "r"), kep=3)
    with pytest.raises(TypeError, match="node must be a string"):
        Nodes(node=3)  # type: ignore[arg-type]


def test_a_checkpointer_built_from_option_objects_applies_them(tmp_path):
    keep_two = fp.Retention(keep=2)
    durable = fp.Durable(str(tmp_path / "durable"), every=2)
    with fp.Checkpointer(str(tmp_path / "r"), mode="sync", retention=keep_two, durable=durable) as ck:
        assert ck.retention is keep_two
        for step in range(1, 5):
            ck.save(step, {"w": torch.full((10,), float(step))})
    assert [i.step for i in fp.open(str(tmp_path / "r")).list()] == [3, 4]
    drained = [i.step for i in fp.open(str(tmp_path / "durable")).list() if i.committed]
    assert drained == [1, 3]  # the first, then every second step
