"""The S3 test servers themselves (tests/s3servers.py): they start, obstore talks to them, and they
behave as the durable tier's tests will assume — credentials, create-if-absent puts, multipart
uploads, ranged reads, a server going down and coming back with its data.

One server per kind for the whole module (the ``server`` fixture is module-scoped and
parametrised: every seaweedfs test runs, then the moto ones).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pytest

obstore = pytest.importorskip("obstore")

from obstore.exceptions import (  # noqa: E402
    AlreadyExistsError,
    GenericError,
    PermissionDeniedError,
    PreconditionError,
)
from obstore.store import S3Store  # noqa: E402
from s3servers import KINDS, S3Server, skip_reason, start_seaweedfs, start_server  # noqa: E402

if TYPE_CHECKING:
    from obstore.store import RetryConfig  # in the stubs only

MiB = 1024 * 1024
NO_RETRY: RetryConfig = {"max_retries": 0}  # an error at once, not after object_store's 10 retries (~3 s)


@pytest.fixture(scope="module", params=KINDS)
def server(request, tmp_path_factory) -> Iterator[S3Server]:
    reason = skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    srv = start_server(request.param, tmp_path_factory.mktemp(request.param))
    yield srv
    srv.close()


@pytest.fixture
def bucket(server: S3Server) -> str:
    return server.new_bucket()


@pytest.fixture
def store(server: S3Server, bucket: str) -> S3Store:
    return server.store(bucket, retry_config=NO_RETRY)


def test_server_answers_on_loopback(server: S3Server) -> None:
    assert server.endpoint.startswith("http://127.0.0.1:")
    assert server.running and server.port in server.ports
    assert server.client().list_buckets()["ResponseMetadata"]["HTTPStatusCode"] == 200
    env = server.env()
    assert env["AWS_ENDPOINT_URL"] == server.endpoint
    assert env["AWS_ALLOW_HTTP"] == "true"
    assert env["AWS_REGION"] == env["AWS_DEFAULT_REGION"] == server.region


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc")
def test_seaweedfs_listens_on_loopback_only(server: S3Server) -> None:
    """Every TCP socket weed listens on is on 127.0.0.1 and one of the ports it was given."""
    if server.kind != "seaweedfs":
        pytest.skip("weed's own process")
    inodes = set()
    for fd in os.listdir(f"/proc/{server.pid}/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/{server.pid}/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:["):-1])
    listening = []  # (address hex, port) of the process's sockets in LISTEN state
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:
                    addr, port = fields[1].split(":")
                    listening.append((addr, int(port, 16)))
    assert listening
    assert {addr for addr, _ in listening} == {"0100007F"}, listening  # 127.0.0.1, no [::]
    assert {port for _, port in listening} <= set(server.ports), (listening, server.ports)
    assert server.port in {port for _, port in listening}


def test_put_get_round_trip(store: S3Store) -> None:
    obstore.put(store, "a/b.bin", b"hello durable tier")
    assert bytes(obstore.get(store, "a/b.bin").bytes()) == b"hello durable tier"
    assert obstore.head(store, "a/b.bin")["size"] == 18
    listed = [m["path"] for batch in obstore.list(store, prefix="a") for m in batch]
    assert listed == ["a/b.bin"]


def test_missing_object_raises_file_not_found(store: S3Store) -> None:
    # obstore raises the builtin FileNotFoundError for a missing object, not its own
    # obstore.exceptions.NotFoundError (which is no FileNotFoundError): catch FileNotFoundError
    with pytest.raises(FileNotFoundError):
        obstore.get(store, "no/such/object")
    with pytest.raises(FileNotFoundError):
        obstore.head(store, "no/such/object")


def test_missing_bucket_is_refused(server: S3Server) -> None:
    # seaweedfs runs with -s3.autoCreateBucket=false: like AWS, not a bucket made on the fly
    missing = server.store("fp-no-such-bucket", retry_config=NO_RETRY)
    with pytest.raises(FileNotFoundError):
        obstore.put(missing, "x", b"1")


def test_wrong_credentials(server: S3Server, bucket: str) -> None:
    """seaweedfs refuses a wrong secret and an unknown key id; moto accepts any credentials."""
    obstore.put(server.store(bucket), "k", b"v")
    wrong_secret = server.store(bucket, secret_access_key="not-the-secret", retry_config=NO_RETRY)
    unknown_key = server.store(bucket, access_key_id="FPUNKNOWNKEY", retry_config=NO_RETRY)
    if server.kind == "seaweedfs":
        for bad in (wrong_secret, unknown_key):
            with pytest.raises(PermissionDeniedError, match="SignatureDoesNotMatch|InvalidAccessKeyId"):
                obstore.get(bad, "k")
            with pytest.raises(PermissionDeniedError):
                obstore.put(bad, "k2", b"v")
        with pytest.raises(FileNotFoundError):  # nothing was written by the refused puts
            obstore.head(server.store(bucket), "k2")
    else:  # moto does not check signatures (unless its IAM emulation is switched on)
        assert bytes(obstore.get(wrong_secret, "k").bytes()) == b"v"
        assert bytes(obstore.get(unknown_key, "k").bytes()) == b"v"


def test_create_if_absent(store: S3Store) -> None:
    """PUT with If-None-Match: * — both servers honour it (412, which obstore maps)."""
    obstore.put(store, "commit/marker", b"first", mode="create")
    with pytest.raises(AlreadyExistsError):
        obstore.put(store, "commit/marker", b"second", mode="create")
    assert bytes(obstore.get(store, "commit/marker").bytes()) == b"first"


def test_create_if_absent_race_has_one_winner(store: S3Store) -> None:
    # (seaweedfs makes a losing racer wait about 1 s on its lock: two rounds, not more)
    for round_ in range(2):
        key = f"race/{round_}"
        barrier = threading.Barrier(4)

        def one(i: int) -> int | None:
            barrier.wait()
            try:
                obstore.put(store, key, str(i).encode(), mode="create")
                return i
            except AlreadyExistsError:
                return None

        with ThreadPoolExecutor(4) as pool:
            winners = [w for w in pool.map(one, range(4)) if w is not None]
        assert len(winners) == 1, winners
        assert bytes(obstore.get(store, key).bytes()) == str(winners[0]).encode()


def test_update_if_match(store: S3Store) -> None:
    first = obstore.put(store, "u", b"1")
    obstore.put(store, "u", b"2", mode={"e_tag": first["e_tag"]})
    with pytest.raises(PreconditionError):
        obstore.put(store, "u", b"3", mode={"e_tag": first["e_tag"]})
    assert bytes(obstore.get(store, "u").bytes()) == b"2"


def test_multipart_upload_and_ranged_read(store: S3Store) -> None:
    data = os.urandom(20 * MiB)
    result = obstore.put(store, "big.bin", data, chunk_size=5 * MiB)
    assert result["e_tag"].strip('"').endswith("-4")  # four parts: it was a multipart upload
    assert obstore.head(store, "big.bin")["size"] == len(data)
    for start, end in ((0, 1), (5 * MiB - 10, 5 * MiB + 10), (7 * MiB + 3, 13 * MiB), (len(data) - 5, len(data))):
        assert bytes(obstore.get_range(store, "big.bin", start=start, end=end)) == data[start:end]
    parts = obstore.get_ranges(store, "big.bin", starts=[0, 10 * MiB], ends=[100, 10 * MiB + 100])
    assert [bytes(p) for p in parts] == [data[:100], data[10 * MiB:10 * MiB + 100]]
    assert bytes(obstore.get(store, "big.bin").bytes()) == data


def test_multipart_complete_if_none_match(server: S3Server, bucket: str) -> None:
    """CompleteMultipartUpload with If-None-Match: * (obstore's mode="create" is single-PUT only)."""
    import botocore.exceptions

    client = server.client()

    def upload() -> None:
        up = client.create_multipart_upload(Bucket=bucket, Key="mp")["UploadId"]
        etag = client.upload_part(Bucket=bucket, Key="mp", UploadId=up, PartNumber=1, Body=b"p" * 1024)["ETag"]
        client.complete_multipart_upload(Bucket=bucket, Key="mp", UploadId=up, IfNoneMatch="*",
                                         MultipartUpload={"Parts": [{"ETag": etag, "PartNumber": 1}]})

    upload()
    with pytest.raises(botocore.exceptions.ClientError, match="PreconditionFailed"):
        upload()


def test_from_url_with_env(server: S3Server, bucket: str, monkeypatch: pytest.MonkeyPatch) -> None:
    for k in [k for k in os.environ if k.startswith("AWS_")]:
        monkeypatch.delenv(k)
    for k, v in server.env().items():
        monkeypatch.setenv(k, v)
    via_url = S3Store.from_url(f"s3://{bucket}/runs/r1", retry_config=NO_RETRY)
    obstore.put(via_url, "step-1/manifest", b"m")
    assert bytes(obstore.get(via_url, "step-1/manifest").bytes()) == b"m"
    # the URL's path is the store's prefix; a store without one sees the full key
    assert bytes(obstore.get(server.store(bucket), "runs/r1/step-1/manifest").bytes()) == b"m"
    assert bytes(obstore.get(S3Store(bucket), "runs/r1/step-1/manifest").bytes()) == b"m"


def test_server_down_then_back_with_its_data(server: S3Server, bucket: str, store: S3Store) -> None:
    obstore.put(store, "kept", b"before the outage")
    port, endpoint = server.port, server.endpoint
    server.stop()
    try:
        assert not server.running
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=2).close()
        with pytest.raises(GenericError, match="error sending request"):  # connection refused
            obstore.put(store, "during", b"x")
        with pytest.raises(GenericError):
            obstore.get(store, "kept")
    finally:
        server.start()
    assert (server.port, server.endpoint) == (port, endpoint)
    assert bytes(obstore.get(store, "kept").bytes()) == b"before the outage"
    with pytest.raises(FileNotFoundError):
        obstore.head(store, "during")
    obstore.put(store, "after", b"y")
    assert bytes(obstore.get(store, "after").bytes()) == b"y"


def test_seaweedfs_start_failure_is_reported(tmp_path) -> None:
    reason = skip_reason("seaweedfs")
    if reason:
        pytest.skip(reason)
    with pytest.raises(RuntimeError, match="was not ready .* within") as info:
        start_seaweedfs(tmp_path, timeout=0.001)
    assert "--- its log ---" in str(info.value)
    for pid in os.listdir("/proc"):  # the weed it started was ended, not left running
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    assert str(tmp_path).encode() not in f.read()
            except OSError:
                pass


def test_skip_reason() -> None:
    reason = skip_reason("seaweedfs")
    assert reason is None or "weed" in reason or "Linux" in reason
    with pytest.raises(ValueError):
        skip_reason("minio")
