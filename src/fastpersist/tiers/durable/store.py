"""Where the durable tier keeps its checkpoints: a directory (a shared filesystem) or an
S3-compatible bucket, behind one small interface of whole objects.

A :class:`Store` knows keys (``step-00000012/manifest.json``), never state: it uploads a local
file from an iterator of chunks, puts small objects (the manifest *create-if-absent*, so that
two drains can never both commit a step), reads ranges, lists and deletes. The drain
(:mod:`fastpersist.tiers.durable.drain`) and the durable reader (:mod:`fastpersist.tiers.durable.view`)
are written against it, so both kinds of location behave alike.

* :class:`DirStore`: every object is a file, written under a temporary name, fsync'd and
  renamed (the directory fsync'd); create-if-absent is ``link(2)`` of the temporary file, which
  fails when the name exists. The layout is a one-root checkpoint root, so
  ``fastpersist.open(directory)`` reads it like any other. Its file operations are those of the
  local roots, through a :class:`~fastpersist.storage.backend.FileBackend` it is given (the
  one seam: a fault backend reaches the durable directory as it reaches the roots).
* :class:`S3Store`: an ``s3://bucket/prefix`` URL through ``obstore`` (multipart uploads with
  several parts in flight, conditional puts with ``If-None-Match: *``, ranged gets). The
  endpoint, region and credentials come from the client's standard environment
  (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...), never from a checkpoint.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import os
import re
import secrets
import stat
from datetime import timedelta
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from fastpersist.errors import CheckpointError, CheckpointNotFoundError, CorruptCheckpointError
from fastpersist.io.files import DirectFile
from fastpersist.storage.backend import REAL_FILES, FileBackend

PART_BYTES = 8 << 20  # the size of one uploaded part (at least), and of one read when downloading
UPLOADS_IN_FLIGHT = 4  # parts of one multipart upload in flight (8 and 12 measured no faster here)
READS_IN_FLIGHT = 8  # ranged reads of one object in flight
MAX_PARTS = 10_000  # S3's limit on the parts of one multipart upload


def part_bytes(size: int) -> int:
    """The part size for an object of ``size`` bytes: PART_BYTES, or more (whole MiB) so that
    it fits in MAX_PARTS parts (8 MiB parts would cap an object at 78 GiB)."""
    need = -(-size // MAX_PARTS)
    return max(PART_BYTES, -(-need // (1 << 20)) << 20)
# S3 error codes that mean the credentials (or the signature made with them) were refused
_REFUSED = ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "ExpiredToken", "InvalidToken")


class StoreError(CheckpointError):
    """An operation on the durable location failed (the message names the location and why)."""


class StoreAccessError(StoreError):
    """The durable location refused the credentials: trying again will not help (the drain
    does not retry it; a later step's drain tries anew)."""


class Store:
    """The durable location: whole objects under keys (``/``-separated, relative)."""

    url: str  # as the user gave it (a directory path is made absolute)

    def put_file(self, key: str, chunks: Iterator[bytes], size: int) -> None:
        """Upload ``size`` bytes from ``chunks`` as ``key`` (replacing an object of that key);
        the object is visible whole or not at all."""
        raise NotImplementedError

    def put_new(self, key: str, data: bytes) -> bool:
        """Create ``key`` with ``data`` if it does not exist; False if it did (nothing written)."""
        raise NotImplementedError

    def put(self, key: str, data: bytes) -> None:
        """Create or replace the small object ``key``."""
        raise NotImplementedError

    def get(self, key: str, limit: int) -> bytes:
        """The whole object ``key`` (at most ``limit`` bytes); CheckpointNotFoundError if absent."""
        raise NotImplementedError

    def chunks(self, key: str, size: int) -> Iterator[memoryview]:
        """The first ``size`` bytes of ``key``, in order, in pieces of at most PART_BYTES (each
        a view of its own buffer, which the caller may keep)."""
        raise NotImplementedError

    def list(self, prefix: str = "") -> dict[str, int]:
        """Every object under ``prefix`` (a "directory": ``step-00000012/``): key -> size."""
        raise NotImplementedError

    def delete(self, key: str) -> None:
        """Delete ``key`` (absent: nothing to do)."""
        raise NotImplementedError

    def where(self, key: str = "") -> str:
        """``key``'s location, for messages."""
        return f"{self.url.rstrip('/')}/{key}" if key else self.url


def is_url(location: object) -> bool:
    """Whether ``location`` names object storage (``scheme://...``) rather than a path."""
    return isinstance(location, str) and "://" in location


def open_store(location: str | os.PathLike[str] | Store, backend: FileBackend | None = None) -> Store:
    """The store at ``location``: a Store, a directory path (its files through ``backend``,
    default real files), or an ``s3://bucket/prefix`` URL."""
    if isinstance(location, Store):
        return location
    if not isinstance(location, (str, os.PathLike)):
        raise TypeError(f"durable: expected a directory path or an s3:// URL, got a {type(location).__name__}")
    if is_url(location):
        scheme = str(location).split("://", 1)[0].lower()
        if scheme not in ("s3", "s3a"):
            raise ValueError(f"durable: {location!r}: only directories and s3:// URLs are supported")
        return S3Store(str(location))
    return DirStore(os.fspath(location), backend)


# ---------------------------------------------------------------------------------------------
# a directory


class DirStore(Store):
    """Objects as files under a directory (created at the first write), every file operation
    through ``backend`` (default: real files; the directory is root 0 to it)."""

    def __init__(self, path: str, backend: FileBackend | None = None) -> None:
        self.path = os.path.abspath(path)
        self.url = self.path
        self.backend = backend or REAL_FILES
        if self.backend.exists(self.path) and not self.backend.is_dir(self.path):
            raise ValueError(f"durable: {self.path} is a file, not a directory")

    def file(self, key: str) -> str:
        parts = key.split("/")
        if not key or any(p in ("", ".", "..") for p in parts):
            raise ValueError(f"durable: bad key {key!r}")
        return os.path.join(self.path, *parts)

    def _temp(self, final: str) -> str:
        d, base = os.path.split(final)
        self.backend.makedirs(d)
        return os.path.join(d, f".{base}.fastpersist-tmp-{os.getpid()}-{secrets.token_hex(4)}")

    def _write_temp(self, final: str, chunks: Iterator[bytes], size: int | None) -> str:
        temp = self._temp(final)
        files = self.backend
        file = files.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, "off", 0)
        try:
            written = 0
            for chunk in chunks:
                files.pwrite(file, chunk, written)
                written += memoryview(chunk).nbytes
            if size is not None and written != size:
                raise StoreError(f"{final}: {written} bytes uploaded, {size} expected")
            files.fsync(file)
            _drop_cache(file)  # a read-back then reaches the device, not the cache
        except BaseException:
            file.close()
            with contextlib.suppress(OSError):
                files.unlink(temp)
            raise
        file.close()
        return temp

    def put_file(self, key: str, chunks: Iterator[bytes], size: int) -> None:
        final = self.file(key)
        try:
            temp = self._write_temp(final, chunks, size)
            self.backend.replace(temp, final)
            self.backend.fsync_dir(os.path.dirname(final))
        except OSError as e:
            raise StoreError(f"cannot write {final}: {e.strerror or e}") from e

    def put_new(self, key: str, data: bytes) -> bool:
        final = self.file(key)
        try:
            temp = self._write_temp(final, iter([data]), len(data))
            try:
                self.backend.link(0, temp, final)  # fails if ``final`` exists: create-if-absent
            except FileExistsError:
                return False
            finally:
                self.backend.unlink(temp)
            self.backend.fsync_dir(os.path.dirname(final))
            return True
        except OSError as e:
            raise StoreError(f"cannot write {final}: {e.strerror or e}") from e

    def put(self, key: str, data: bytes) -> None:
        self.put_file(key, iter([data]), len(data))

    def _open(self, path: str) -> DirectFile:
        try:
            return self.backend.open_read(path, "off", follow=True)
        except CheckpointNotFoundError:
            raise
        except CheckpointError as e:  # refused, or not a regular file
            raise StoreError(f"cannot read {path}: {e}") from e

    def get(self, key: str, limit: int) -> bytes:
        path = self.file(key)
        file = self._open(path)
        try:
            data = self.backend.pread(file, 0, limit + 1)
        except OSError as e:
            raise StoreError(f"cannot read {path}: {e.strerror or e}") from e
        finally:
            file.close()
        if len(data) > limit:
            raise StoreError(f"{path} is larger than {limit} bytes")
        return data

    def chunks(self, key: str, size: int) -> Iterator[memoryview]:
        path = self.file(key)
        file = self._open(path)
        try:
            pos = 0
            while pos < size:
                data = self.backend.pread(file, pos, min(PART_BYTES, size - pos))
                if not data:
                    raise CorruptCheckpointError(f"{path} is truncated: {pos} bytes, {size} expected")
                pos += len(data)
                yield memoryview(data)
        finally:
            file.close()

    def list(self, prefix: str = "") -> dict[str, int]:
        out: dict[str, int] = {}
        top = self.file(prefix.rstrip("/")) if prefix.strip("/") else self.path
        try:
            self._walk(top, top, out)
        except OSError as e:
            raise StoreError(f"cannot list {top}: {e.strerror or e}") from e
        return out

    def _walk(self, d: str, top: str, out: dict[str, int]) -> None:
        """The objects under ``d`` into ``out`` (links to directories are not followed)."""
        try:
            names = self.backend.listdir(d)
        except FileNotFoundError:
            if d == top:  # nothing written there yet
                return
            raise
        for name in names:
            p = os.path.join(d, name)
            try:
                st = self.backend.stat(p, follow=False)
                if stat.S_ISDIR(st.st_mode):
                    self._walk(p, top, out)
                    continue
                if ".fastpersist-tmp" in name:
                    continue
                if stat.S_ISLNK(st.st_mode):
                    st = self.backend.stat(p)
                    if stat.S_ISDIR(st.st_mode):
                        continue  # a link to a directory: not walked into
            except FileNotFoundError:
                continue  # deleted since the listing
            out[os.path.relpath(p, self.path).replace(os.sep, "/")] = st.st_size

    def delete(self, key: str) -> None:
        path = self.file(key)
        try:
            self.backend.unlink(path)
        except FileNotFoundError:
            return
        except OSError as e:
            raise StoreError(f"cannot delete {path}: {e.strerror or e}") from e
        d = os.path.dirname(path)
        while d != self.path:  # drop directories left empty (a deleted checkpoint's)
            try:
                self.backend.rmdir(d)
            except OSError:
                break
            d = os.path.dirname(d)


def _drop_cache(file: DirectFile) -> None:
    """Ask the kernel to drop ``file``'s cached pages (a hint; nothing where unsupported)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(file.fd, 0, 0, os.POSIX_FADV_DONTNEED)


# ---------------------------------------------------------------------------------------------
# S3-compatible object storage


class S3Store(Store):
    """An ``s3://bucket/prefix`` location through obstore; the client reads its endpoint and
    credentials from the environment (and allows plain HTTP only to a loopback endpoint or when
    ``AWS_ALLOW_HTTP`` says so)."""

    def __init__(self, url: str) -> None:
        try:
            import obstore  # noqa: F401
            from obstore.store import S3Store as _Client
        except ImportError as e:
            raise ImportError("durable: s3:// locations need the obstore package (pip install obstore)") from e
        self.url = url
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or ""
        client: dict[str, Any] = {"connect_timeout": "10s", "timeout": "300s"}
        if endpoint.startswith("http://"):
            host = endpoint[len("http://"):].split("/", 1)[0].rsplit(":", 1)[0]
            if host in ("127.0.0.1", "localhost", "[::1]") or os.environ.get("AWS_ALLOW_HTTP", "").lower() == "true":
                client["allow_http"] = True
        self.endpoint = endpoint or "the default AWS endpoint"
        retry = {"max_retries": 3, "retry_timeout": timedelta(seconds=60)}
        # The body is not hashed into the request's signature (UNSIGNED-PAYLOAD): that SHA-256
        # pass cost about as much CPU as the rest of an upload, and the drain reads every
        # object back and checks its checksums anyway. AWS_UNSIGNED_PAYLOAD=false signs it.
        options: dict[str, Any] = {} if "AWS_UNSIGNED_PAYLOAD" in os.environ else {"unsigned_payload": True}
        try:
            self._client = _Client.from_url(url, client_options=client, retry_config=retry,  # type: ignore[arg-type]
                                            **options)
        except Exception as e:  # noqa: BLE001 - obstore raises its own types for a bad URL/config
            raise ValueError(f"durable: {url!r}: {e}") from e

    def _fail(self, what: str, key: str, e: BaseException) -> CheckpointError:
        import obstore.exceptions as ox

        if isinstance(e, (FileNotFoundError, ox.NotFoundError)):  # obstore >= 0.12 raises the built-in
            return CheckpointNotFoundError(f"{self.where(key)} does not exist")
        text = str(e)
        code, message = re.search(r"<Code>(.*?)</Code>", text), re.search(r"<Message>(.*?)</Message>", text)
        if code is not None:  # the server's own words, not the first line of an XML document
            reason = f"{code.group(1)}: {message.group(1) if message else ''}".rstrip(": ")
        else:
            reason = text.splitlines()[0][:300] if text else type(e).__name__
        if isinstance(e, (ox.PermissionDeniedError, ox.UnauthenticatedError)) or \
                (code is not None and code.group(1) in _REFUSED):
            return StoreAccessError(f"cannot {what} {self.where(key)} (endpoint {self.endpoint}): the credentials "
                                    f"were refused ({reason})")
        return StoreError(f"cannot {what} {self.where(key)} (endpoint {self.endpoint}): {reason}")

    def put_file(self, key: str, chunks: Iterator[bytes], size: int) -> None:
        import obstore

        try:
            if size <= PART_BYTES:
                obstore.put(self._client, key, b"".join(chunks), use_multipart=False)
            else:
                obstore.put(self._client, key, chunks, chunk_size=part_bytes(size), max_concurrency=UPLOADS_IN_FLIGHT)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise self._fail("upload", key, e) from e

    def put_new(self, key: str, data: bytes) -> bool:
        import obstore
        import obstore.exceptions as ox

        try:
            obstore.put(self._client, key, data, mode="create")
            return True
        except ox.AlreadyExistsError:
            return False
        except Exception as e:  # noqa: BLE001
            if type(e).__name__ == "PreconditionError":  # some servers answer 412 for an existing key
                return False
            raise self._fail("upload", key, e) from e

    def put(self, key: str, data: bytes) -> None:
        import obstore

        try:
            obstore.put(self._client, key, data, use_multipart=False)
        except Exception as e:  # noqa: BLE001
            raise self._fail("upload", key, e) from e

    def get(self, key: str, limit: int) -> bytes:
        import obstore

        try:
            data = bytes(obstore.get(self._client, key).bytes())
        except Exception as e:  # noqa: BLE001
            raise self._fail("read", key, e) from e
        if len(data) > limit:
            raise StoreError(f"{self.where(key)} is larger than {limit} bytes")
        return data

    def chunks(self, key: str, size: int) -> Iterator[memoryview]:
        """Ranged reads of PART_BYTES, READS_IN_FLIGHT at once, yielded in order (one stream
        of back-to-back ranges reads at ~0.6 of what 8 in flight reach: docs/benchmarks-history.md, "Durable tier: drain and restore through S3")."""
        parts = [(pos, min(PART_BYTES, size - pos)) for pos in range(0, size, PART_BYTES)]
        if not parts:
            return
        with ThreadPoolExecutor(min(READS_IN_FLIGHT, len(parts)), thread_name_prefix="fastpersist-get") as ex:
            window: collections.deque[Future[memoryview]] = collections.deque()
            todo = iter(parts)
            try:
                for part in itertools.islice(todo, READS_IN_FLIGHT):
                    window.append(ex.submit(self._range, key, *part))
                while window:
                    data = window.popleft().result()
                    for part in itertools.islice(todo, 1):
                        window.append(ex.submit(self._range, key, *part))
                    yield data
            finally:
                for f in window:
                    f.cancel()

    def _range(self, key: str, pos: int, n: int) -> memoryview:
        import obstore

        try:
            data = obstore.get_range(self._client, key, start=pos, length=n)
        except Exception as e:  # noqa: BLE001
            raise self._fail("read", key, e) from e
        if len(data) != n:
            raise CorruptCheckpointError(f"{self.where(key)} is truncated: {len(data)} bytes read at offset "
                                         f"{pos}, {n} expected")
        return memoryview(data)  # obstore's buffer, not copied

    def list(self, prefix: str = "") -> dict[str, int]:
        import obstore

        out: dict[str, int] = {}
        try:
            for batch in obstore.list(self._client, prefix=prefix or None):
                for meta in batch:
                    out[meta["path"]] = int(meta["size"])
        except Exception as e:  # noqa: BLE001
            raise self._fail("list", prefix, e) from e
        return out

    def delete(self, key: str) -> None:
        import obstore
        import obstore.exceptions as ox

        try:
            obstore.delete(self._client, key)
        except (FileNotFoundError, ox.NotFoundError):
            return
        except Exception as e:  # noqa: BLE001
            raise self._fail("delete", key, e) from e
