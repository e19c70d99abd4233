"""The durable tier in S3-compatible object storage, against real servers the suite starts:
SeaweedFS (``weed mini``: on-disk data, credentials enforced) for the main cases, moto's
in-process server for the many short ones. No mock of the client library."""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time

import pytest
import torch

import fastpersist as fp
from fastpersist.tiers.durable.store import S3Store, StoreAccessError
from fastpersist.errors import ChecksumMismatchError
from helpers import SUPPORT, assert_state_equal, fsdp_mlp, gathered, replicated, run_ranks
from s3servers import skip_reason, start_moto, start_seaweedfs

pytestmark = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")

SMALL = 300_000


@pytest.fixture(scope="module")
def seaweed(tmp_path_factory):
    server = start_seaweedfs(str(tmp_path_factory.mktemp("seaweedfs")))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def moto():
    server = start_moto()
    yield server
    server.stop()


_buckets = iter(range(10**6))


def bucket(server, monkeypatch) -> str:
    """A fresh bucket on ``server``, this process's S3 environment pointed at it; its URL."""
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    name = f"ck-{os.getpid()}-{next(_buckets)}"
    server.new_bucket(name)
    return f"s3://{name}/run"


def committed(url: str) -> list[int]:
    return [i.step for i in fp.open(url).list() if i.committed]


def flip_object_byte(server, url: str, key: str, offset: int) -> None:
    import boto3

    name, prefix = url[len("s3://"):].split("/", 1)
    s3 = boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=server.access_key,
                      aws_secret_access_key=server.secret_key, region_name=server.region)
    data = bytearray(s3.get_object(Bucket=name, Key=f"{prefix}/{key}")["Body"].read())
    data[offset] ^= 0x10
    s3.put_object(Bucket=name, Key=f"{prefix}/{key}", Body=bytes(data))


# ---------------------------------------------------------------------------------------------


def test_create_if_absent_is_honoured(seaweed, moto, monkeypatch):
    for server in (seaweed, moto):
        store = S3Store(bucket(server, monkeypatch))
        assert store.put_new("step-00000001/manifest.json", b"first") is True
        assert store.put_new("step-00000001/manifest.json", b"second") is False
        assert store.get("step-00000001/manifest.json", 100) == b"first"


def _ranks_save(rank: int, world: int, root: str, url: str) -> dict:
    torch.manual_seed(0)
    model, opt = fsdp_mlp(world)
    model(torch.randn(4, 48)).sum().backward()
    opt.step()
    ck = fp.Checkpointer(root, mode="snapshot", durable=url)
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 9, "big": replicated(9, SMALL)}
    h = ck.save(9, state)
    ck.close()
    return {"drained": h.durable.result(0), "state": gathered(state)}


def test_drained_by_every_rank_and_loaded_bit_exact_at_another_world_size(seaweed, tmp_path, monkeypatch):
    url = bucket(seaweed, monkeypatch)
    root = str(tmp_path / "ck")
    results = run_ranks(tmp_path, 2, _ranks_save, root, url)
    assert [r["drained"] for r in results] == [True, True]
    shutil.rmtree(root)  # the local tier is gone (new machines)
    assert committed(url) == [9]
    loaded = gathered(fp.open(url).load())
    want = results[0]["state"]
    assert loaded.keys() == want.keys()
    for k, v in want.items():
        assert_state_equal(loaded[k], v)
    w = fp.open(url).load(keys=["model.0.weight"])["model.0.weight"]
    assert_state_equal(w, want["model.0.weight"], layout=False)  # a view of its own bytes
    assert fp.open(url).verify() == []
    # a Checkpointer on the empty local root falls back to the durable tier
    ck = fp.Checkpointer(root, mode="sync", durable=url)
    assert gathered(ck.load())["step"] == 9
    ck.close()


_KILL_CHILD = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {tests!r})
    import fastpersist as fp
    from helpers import replicated
    ck = fp.Checkpointer({root!r}, mode="sync", durable={url!r}, durable_bandwidth=12e6)
    for step in (1, 2, 3):
        h = ck.save(step, replicated(step, 6_000_000))
        print("committed", step, flush=True)
        h.durable.result(120)
        print("drained", step, flush=True)
    ck.close()
""")


@pytest.mark.parametrize("trial", [*range(3), *(pytest.param(t, marks=pytest.mark.long) for t in range(3, 15))])
def test_drain_killed_at_a_random_instant_never_looks_complete(seaweed, tmp_path, monkeypatch, trial):
    url = bucket(seaweed, monkeypatch)
    root = str(tmp_path / "ck")
    code = _KILL_CHILD.format(tests=SUPPORT, root=root, url=url)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    rng = random.Random(trial)
    target = rng.choice([1, 2])
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.split() == ["committed", str(target)]:
            break
    # the drain of `target` moves ~18 MB (upload + read-back) at 12 MB/s: kill somewhere in it
    time.sleep(rng.uniform(0.0, 1.4))
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    steps = committed(url)
    assert set(steps) <= set(range(1, target + 1))
    for s in steps:  # whatever looks committed is whole and exact
        assert fp.open(url).verify(s) == []
        assert_state_equal(fp.open(url).load(s), replicated(s, 6_000_000))
    # the next job drains again, and cleans what the killed drain left behind
    ck = fp.Checkpointer(root, mode="sync", durable=url)
    assert ck.save(7, replicated(7, SMALL)).durable.result(120) is True
    ck.close()
    leftovers = [i.step for i in fp.open(url).list() if not i.committed]
    assert leftovers == [] and committed(url)[-1] == 7


class PausingS3Store(S3Store):
    """Real uploads; the first multipart upload pauses after its first part until released."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        self.paused = threading.Event()
        self.resume = threading.Event()

    def put_file(self, key, chunks, size):  # type: ignore[no-untyped-def]
        def paced():
            for i, chunk in enumerate(chunks):
                yield chunk
                if i == 1 and not self.paused.is_set():
                    self.paused.set()
                    self.resume.wait(60)
        super().put_file(key, paced(), size)


def test_server_stopped_mid_upload_and_restarted_loses_nothing(seaweed, tmp_path, monkeypatch):
    url = bucket(seaweed, monkeypatch)
    store = PausingS3Store(url)
    ck = fp.Checkpointer(str(tmp_path / "ck"), mode="sync", durable=store)
    h = ck.save(1, replicated(1, 40_000_000))  # files of several 8 MiB parts
    assert store.paused.wait(60)
    seaweed.stop()  # the server goes down with the upload half done
    store.resume.set()
    time.sleep(1.0)
    seaweed.start()
    assert h.durable.result(180) is True  # retried until the server came back
    ck.close()
    assert_state_equal(fp.open(url).load(1), replicated(1, 40_000_000))


def test_wrong_credentials_fail_the_drain_clearly_and_training_goes_on(seaweed, tmp_path, monkeypatch):
    url = bucket(seaweed, monkeypatch)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    ck = fp.Checkpointer(str(tmp_path / "ck"), mode="sync", durable=url)
    h1 = ck.save(1, replicated(1, SMALL))
    with pytest.raises(StoreAccessError, match="credentials were refused") as err:
        h1.durable.result(120)
    assert seaweed.endpoint in str(err.value) and url in str(err.value)
    assert ck.save(2, replicated(2, SMALL)).result() is not None  # training and local saves go on
    ck.close()
    assert_state_equal(fp.open(str(tmp_path / "ck")).load(), replicated(2, SMALL))


def test_damaged_object_is_named_and_latest_falls_back(moto, tmp_path, monkeypatch, caplog):
    url = bucket(moto, monkeypatch)
    ck = fp.Checkpointer(str(tmp_path / "ck"), mode="sync", durable=url)
    for s in (1, 2):
        ck.save(s, replicated(s, SMALL)).durable.result(60)
    ck.close()
    m = fp.open(url).manifest(2)
    extent = m.objects["replicated"].storages[0].extents[0]
    name = m.files[extent.file].name
    flip_object_byte(moto, url, f"step-00000002/{name}", extent.offset + 3)
    with pytest.raises(ChecksumMismatchError, match=f"{url}/step-00000002/{name}"):
        fp.open(url).load(2)
    with caplog.at_level(logging.WARNING, logger="fastpersist"):
        assert_state_equal(fp.open(url).load(), replicated(1, SMALL))
    assert any("step 2 cannot be loaded" in r.getMessage() for r in caplog.records)
    problems = fp.open(url).verify(2)
    assert problems and name in str(problems[0])


def test_retention_on_both_tiers_keeps_the_latest_durable_step(moto, tmp_path, monkeypatch):
    url = bucket(moto, monkeypatch)
    root = str(tmp_path / "ck")
    ck = fp.Checkpointer(root, mode="sync", keep=1, durable=url, durable_keep=2, durable_every=2)
    handles = []
    for s in range(1, 8):
        handles.append(ck.save(s, replicated(s, SMALL)))
        handles[-1].durable.result(60)  # each drain ends before the next save: none is skipped for room
    ck.close()
    assert [h.durable.result(0) for h in handles] == [True, False, True, False, True, False, True]
    assert [i.step for i in fp.open(root).list()] == [7]
    assert committed(url) == [5, 7]
    assert fp.open(url).latest_step() == 7
    assert not [k for k in S3Store(url).list() if not k.startswith(("step-00000005/", "step-00000007/"))]


def test_fallback_fetches_through_the_first_root_and_leaves_nothing(moto, tmp_path, monkeypatch):
    url = bucket(moto, monkeypatch)
    root = tmp_path / "ck"
    ck = fp.Checkpointer(str(root), mode="sync", durable=url, keep=1)
    ck.save(1, replicated(1, SMALL)).durable.result(60)
    ck.save(2, replicated(2, SMALL)).durable.result(60)
    ck.close()
    assert [i.step for i in fp.open(str(root)).list()] == [2]
    seen: list[str] = []
    real_mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: seen.append(kw.get("dir")) or real_mkdtemp(**kw))
    ck = fp.Checkpointer(str(root), mode="sync", durable=url)
    assert_state_equal(ck.load(1), replicated(1, SMALL))  # only in the durable tier
    ck.close()
    assert seen == [str(root)]
    assert not [n for n in os.listdir(root) if "fastpersist-tmp" in n]
