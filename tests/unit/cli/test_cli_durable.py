"""The command line and the durable tier: `ls ROOT --durable LOCATION` (which tier holds each
step), and `ls`/`inspect`/`verify`/`convert` of a durable tier in a directory or in S3
(moto's in-process server), with their errors on one line naming the URL."""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import fastpersist as fp
from fastpersist.cli import main
from helpers import REPO

pytest.importorskip("obstore")
boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")

BUCKET = f"fp-cli-{secrets.token_hex(4)}"  # moto's buckets are process-global: one of this module's own
SRC = os.path.join(REPO, "src")


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    """moto's S3 server in this process on a free port, a bucket in it, and the environment
    that points the S3 client at it (set for the module, passed on to subprocesses)."""
    from moto.server import ThreadedMotoServer

    werkzeug = logging.getLogger("werkzeug")  # one access-log line per request on stderr: not wanted
    level = werkzeug.level
    werkzeug.setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    env = {"AWS_ENDPOINT_URL": f"http://{host}:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_REGION": "us-east-1"}
    try:
        with pytest.MonkeyPatch.context() as mp:
            for k, v in env.items():
                mp.setenv(k, v)
            mp.delenv("AWS_ENDPOINT_URL_S3", raising=False)
            mp.delenv("AWS_SESSION_TOKEN", raising=False)
            client().create_bucket(Bucket=BUCKET)
            yield env
    finally:
        server.stop()
        werkzeug.setLevel(level)


def client() -> Any:
    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], region_name="us-east-1")


def _state(step: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(step)
    return {"model": {"w": torch.randn(200, 300, generator=g), "b": torch.arange(50, dtype=torch.float64) * step},
            "step": step}


def _save(local: str, durable: str, steps: list[int], **kwargs: Any) -> dict[int, dict[str, Any]]:
    """Save ``steps`` with a Checkpointer draining to ``durable``, each drain waited for (so
    local retention may delete a drained step at the next commit)."""
    states = {}
    with fp.Checkpointer(local, durable=durable, mode="sync", **kwargs) as ck:
        for s in steps:
            states[s] = _state(s)
            h = ck.save(s, states[s])
            h.durable.result(timeout=120)
    return states


@pytest.fixture(scope="module", params=["dir", "s3"])
def tiers(request, tmp_path_factory) -> tuple[str, str, dict[int, dict[str, Any]]]:
    """Local keep=2, a drain every 2 steps, steps 1, 2, 3: step 1 only in the durable tier
    (drained, then deleted locally), step 2 only local (not drained), step 3 in both."""
    top = tmp_path_factory.mktemp(f"tiers-{request.param}")
    if request.param == "s3":
        request.getfixturevalue("s3")
        durable = f"s3://{BUCKET}/tiers"
    else:
        durable = str(top / "durable")
    local = str(top / "local")
    states = _save(local, durable, [1, 2, 3], keep=2, durable_every=2)
    assert sorted(n for n in os.listdir(local) if n.startswith("step-")) == ["step-00000002", "step-00000003"]
    return local, durable, states


@pytest.fixture(scope="module")
def run(s3, tmp_path_factory) -> tuple[str, dict[int, dict[str, Any]]]:
    """s3://ckpts/run: steps 1, 2, 3 drained (local keep=1: only 3 is still local)."""
    local = str(tmp_path_factory.mktemp("run") / "local")
    states = _save(local, f"s3://{BUCKET}/run", [1, 2, 3], keep=1)
    return f"s3://{BUCKET}/run", states


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    capsys.readouterr()
    status = main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def _table(out: str) -> dict[int, list[str]]:
    return {int(line.split()[0]): line.split() for line in out.splitlines()[1:] if line.strip()}


# ---------------------------------------------------------------------------------------- ls


def test_ls_with_durable_shows_each_steps_tier(tiers, capsys):
    local, durable, _ = tiers
    status, out, err = _cli(capsys, "ls", local, "--durable", durable)
    assert status == 0, err
    assert out.splitlines()[0].split()[:3] == ["step", "state", "tier"]
    rows = _table(out)
    assert {s: r[1:3] for s, r in rows.items()} == {1: ["committed", "durable"], 2: ["committed", "local"],
                                                    3: ["latest", "local+durable"]}

    status, out, err = _cli(capsys, "ls", local, "--durable", durable, "--json")
    assert status == 0, err
    doc = json.loads(out)
    where = durable if durable.startswith("s3://") else os.path.abspath(durable)
    assert doc["root"] == os.path.abspath(local) and doc["durable"] == where
    got = {c["step"]: c for c in doc["checkpoints"]}
    assert {s: (c["tier"], c["state"]) for s, c in got.items()} == {
        1: ("durable", "committed"), 2: ("local", "committed"), 3: ("local+durable", "latest")}
    assert got[1]["path"] == got[1]["durable_path"] == f"{where}/step-00000001"
    assert got[2]["path"] == os.path.join(os.path.abspath(local), "step-00000002") and got[2]["durable_path"] is None
    assert got[3]["path"] == os.path.join(os.path.abspath(local), "step-00000003")
    assert got[3]["durable_path"] == f"{where}/step-00000003"
    assert got[1]["bytes"] == got[3]["bytes"] > 200 * 300 * 4 and got[1]["files"] >= 1

    # without --durable: the local root alone, as before (no tier column, no tier field)
    status, out, _ = _cli(capsys, "ls", local)
    assert status == 0 and "tier" not in out.splitlines()[0] and sorted(_table(out)) == [2, 3]
    status, out, _ = _cli(capsys, "ls", local, "--json")
    assert all("tier" not in c for c in json.loads(out)["checkpoints"])


def test_ls_tensors_of_the_latest_across_tiers(tiers, capsys):
    local, durable, _ = tiers
    status, out, err = _cli(capsys, "ls", local, "--durable", durable, "--tensors", "--json")
    assert status == 0, err
    latest = json.loads(out)["latest"]
    assert latest["step"] == 3 and {t["key"] for t in latest["tensors"]} == {"model.w", "model.b"}


def test_ls_of_the_durable_tier_alone(tiers, capsys):
    _, durable, _ = tiers
    status, out, err = _cli(capsys, "ls", durable)
    assert status == 0, err
    rows = _table(out)
    assert sorted(rows) == [1, 3] and rows[3][1] == "latest" and rows[1][1] == "committed"
    header = out.splitlines()[0].split()
    if durable.startswith("s3://"):  # an s3:// URL is a durable tier
        assert header[:3] == ["step", "state", "tier"] and rows[1][2] == rows[3][2] == "durable"
        doc = json.loads(_cli(capsys, "ls", durable, "--json")[1])
        assert doc["root"] == durable and [c["tier"] for c in doc["checkpoints"]] == ["durable", "durable"]
        assert doc["checkpoints"][0]["path"] == f"{durable}/step-00000001"
    else:  # a directory named alone is a root like any other
        assert "tier" not in header
        status, out, err = _cli(capsys, "inspect", os.path.join(durable, "step-00000001"), "--json")
        assert status == 0 and json.loads(out)["step"] == 1, err


def test_ls_of_an_empty_prefix_and_a_url_with_durable(s3, tmp_path, capsys):
    status, out, err = _cli(capsys, "ls", f"s3://{BUCKET}/nothing-here")
    assert status == 0 and out.strip() == f"no checkpoints in s3://{BUCKET}/nothing-here", err
    status, out, err = _cli(capsys, "ls", f"s3://{BUCKET}/a", "--durable", f"s3://{BUCKET}/b")
    assert status == 2 and out == "" and f"s3://{BUCKET}/a" in err and "--durable" in err


def test_ls_s3_in_a_subprocess(run, s3):
    """`python -m fastpersist`, the S3 endpoint and credentials from its environment only."""
    url, _ = run
    env = dict(os.environ, **s3, PYTHONPATH=os.path.abspath(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "fastpersist", "ls", url, "--json"], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert [(c["step"], c["state"], c["tier"]) for c in doc["checkpoints"]] == [
        (1, "committed", "durable"), (2, "committed", "durable"), (3, "latest", "durable")]


# ------------------------------------------------------------------------------------ verify


def test_verify_a_durable_checkpoint(run, capsys):
    url, _ = run
    status, out, err = _cli(capsys, "verify", url, "-q")  # the tier: its latest checkpoint
    assert status == 0, err
    assert out.startswith("OK step 3:") and "every checksum matches" in out
    status, out, err = _cli(capsys, "verify", f"{url}/step-00000001", "--json")
    assert status == 0, err
    doc = json.loads(out)
    assert doc["ok"] and doc["step"] == 1 and doc["kind"] == "directory" and doc["problems"] == []
    assert doc["path"] == f"{url}/step-00000001"
    manifest = fp.open(url).manifest(1)
    assert doc["bytes_verified"] == sum(f.size for f in manifest.files)  # every object downloaded and checked


def _flip(get: Any, put: Any, manifest: dict[str, Any]) -> tuple[str, int]:
    """Flip a byte inside the largest storage's first extent; returns (file name, offset)."""
    storages = manifest["objects"]["replicated"]["storages"]
    e = max(storages, key=lambda s: s["nbytes"])["extents"][0]
    name = manifest["files"][e["file"]]["name"]
    data = bytearray(get(name))
    at = e["offset"] + 100
    data[at] ^= 0xFF
    put(name, bytes(data))
    return name, at


@pytest.fixture
def damaged_s3(s3, tmp_path) -> tuple[str, dict[int, dict[str, Any]]]:
    prefix = f"damaged-{os.path.basename(str(tmp_path))}"
    url = f"s3://{BUCKET}/{prefix}"
    return url, _save(str(tmp_path / "local"), url, [1])


def _damage_s3(url: str) -> str:
    prefix = url.split("/", 3)[3]
    c = client()
    key = f"{prefix}/step-00000001"
    manifest = json.loads(c.get_object(Bucket=BUCKET, Key=f"{key}/manifest.json")["Body"].read())
    name, _ = _flip(lambda n: c.get_object(Bucket=BUCKET, Key=f"{key}/{n}")["Body"].read(),
                    lambda n, b: c.put_object(Bucket=BUCKET, Key=f"{key}/{n}", Body=b), manifest)
    return f"{url}/step-00000001/{name}"


def test_verify_finds_a_flipped_byte_in_s3(damaged_s3, capsys):
    url, _ = damaged_s3
    assert _cli(capsys, "verify", url, "-q")[0] == 0  # intact first
    obj = _damage_s3(url)
    status, out, err = _cli(capsys, "verify", url, "-q")
    assert status == 1, err
    assert f"FAILED {obj}: object 'replicated' storage" in out and "problem(s) in step 1" in out
    assert tempfile.gettempdir() not in out  # the private fetched copy is never named
    status, out, _ = _cli(capsys, "verify", f"{url}/step-00000001", "--json")
    doc = json.loads(out)
    assert status == 1 and not doc["ok"] and [p["path"] for p in doc["problems"]] == [obj]
    assert "checksum" in doc["problems"][0]["message"]


def test_verify_finds_a_flipped_byte_in_a_durable_directory(tmp_path, capsys):
    durable = str(tmp_path / "durable")
    _save(str(tmp_path / "local"), durable, [1])
    step = os.path.join(durable, "step-00000001")
    assert _cli(capsys, "verify", durable, "-q")[0] == 0  # the tier's directory is a root: its latest
    manifest = json.load(open(os.path.join(step, "manifest.json")))

    def put(name: str, data: bytes) -> None:
        with open(os.path.join(step, name), "wb") as f:
            f.write(data)

    name, at = _flip(lambda n: open(os.path.join(step, n), "rb").read(), put, manifest)
    status, out, err = _cli(capsys, "verify", step, "-q")
    assert status == 1, err
    assert f"FAILED {os.path.join(step, name)}: object 'replicated' storage" in out


def test_verify_of_a_durable_checkpoint_with_an_object_missing(damaged_s3, capsys):
    url, _ = damaged_s3
    c = client()
    prefix = url.split("/", 3)[3]
    manifest = json.loads(c.get_object(Bucket=BUCKET, Key=f"{prefix}/step-00000001/manifest.json")["Body"].read())
    name = max(manifest["files"], key=lambda f: f["size"])["name"]
    c.delete_object(Bucket=BUCKET, Key=f"{prefix}/step-00000001/{name}")
    status, out, err = _cli(capsys, "verify", url, "-q")
    assert status == 1  # damage found, reported on stdout or, as an error, on one line of stderr
    assert f"{url}/step-00000001/{name}" in out + err and len(err.splitlines()) <= 1, (out, err)


# ----------------------------------------------------------------------------------- inspect


def test_inspect_a_durable_checkpoint(run, capsys):
    url, states = run
    status, out, err = _cli(capsys, "inspect", url)
    assert status == 0, err
    assert out.startswith(f"step 3 at {url}/step-00000003: format version")
    keys = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith("  model.")}
    assert keys["model.w"][1:4] == ["float32", "[200,", "300]"] and keys["model.b"][1] == "float64"
    status, out, err = _cli(capsys, "inspect", f"{url}/step-00000002/", "--json")
    assert status == 0, err
    doc = json.loads(out)
    assert doc["step"] == 2 and doc["path"] == f"{url}/step-00000002" and doc["roots"] == 1
    assert {t["key"]: t["shape"] for t in doc["tensors"]} == {"model.w": [200, 300], "model.b": [50]}


# ----------------------------------------------------------------------------------- convert


def test_convert_a_durable_checkpoint(run, tmp_path, monkeypatch, capsys):
    url, states = run
    staging = tmp_path / "tmp"
    staging.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging))  # where the fetched copy goes
    for arg, step in ((f"{url}/step-00000001", 1), (url, 3)):
        out_pt = str(tmp_path / f"m{step}.pt")
        status, out, err = _cli(capsys, "convert", arg, out_pt, "-q")
        assert status == 0, err
        assert f"from step {step}" in out
        got = torch.load(out_pt)
        assert got["step"] == step and set(got["model"]) == {"w", "b"}
        for k in ("w", "b"):
            assert torch.equal(got["model"][k], states[step]["model"][k]), k
        assert os.listdir(staging) == []  # the fetched copy is removed


def test_convert_a_damaged_durable_checkpoint_names_the_object(damaged_s3, tmp_path, monkeypatch, capsys):
    url, _ = damaged_s3
    staging = tmp_path / "tmp"
    staging.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(staging))
    _damage_s3(url)
    status, out, err = _cli(capsys, "convert", url, str(tmp_path / "m.pt"), "-q")
    assert status == 1 and out == ""
    assert len(err.splitlines()) == 1 and f"{url}/step-00000001" in err and str(staging) not in err, err
    assert os.listdir(staging) == [] and not os.path.exists(tmp_path / "m.pt")


# ------------------------------------------------------------------------------------ errors


@pytest.mark.parametrize("command", ["verify", "inspect", "convert"])
def test_a_missing_step_is_one_line_naming_the_url(run, command, tmp_path, capsys):
    url, _ = run
    extra = [str(tmp_path / "m.pt")] if command == "convert" else []
    status, out, err = _cli(capsys, command, f"{url}/step-00000099", *extra)
    assert status == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"fastpersist {command}: ")
    assert f"{url}/step-00000099" in err
    status, out, err = _cli(capsys, command, f"s3://{BUCKET}/empty-prefix", *extra)
    assert status == 2 and len(err.splitlines()) == 1 and f"no committed checkpoint in s3://{BUCKET}/empty-prefix" in err
    assert not os.path.exists(tmp_path / "m.pt")


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("command", ["ls", "verify", "inspect", "convert"])
def test_an_unreachable_endpoint_is_one_line_naming_the_url(s3, command, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    url = f"s3://{BUCKET}/run"
    extra = [str(tmp_path / "m.pt")] if command == "convert" else []
    status, out, err = _cli(capsys, command, url, *extra)
    assert status == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith(f"fastpersist {command}: ") and url in err, err
    assert "Traceback" not in err


def test_refused_credentials_are_one_line_naming_the_url(run, monkeypatch, capsys):
    from moto import settings

    url, _ = run
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # moto checks credentials from now on
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY0000000")
    for argv in (["ls", url], ["verify", url], ["inspect", f"{url}/step-00000001"]):
        status, out, err = _cli(capsys, *argv)
        assert status == 2 and out == "", (argv, out, err)
        assert len(err.splitlines()) == 1 and url in err and "credentials were refused" in err, (argv, err)


def test_other_schemes_and_root_options_are_usage_errors(run, tmp_path, capsys):
    url, _ = run
    status, _, err = _cli(capsys, "inspect", "gs://bucket/run")
    assert status == 2 and "gs://bucket/run" in err and "s3://" in err
    status, _, err = _cli(capsys, "verify", url, "--root", str(tmp_path))
    assert status == 2 and "--root" in err
    status, _, err = _cli(capsys, "ls", str(tmp_path), "--durable", f"{url}/step-00000001")
    assert status == 2 and "names a checkpoint" in err
    status, _, err = _cli(capsys, "ls", str(tmp_path), "--durable", str(tmp_path / "missing"))
    assert status == 2 and "no such directory" in err
