"""Object storage: one interface over a local folder and S3 (or any S3-compatible store).

All remote I/O in Kiln goes through this module. boto3 does every S3 call; for MinIO, Ceph or
R2 pass `endpoint_url` (or set `S3_ENDPOINT_URL`, which mosaicml-streaming reads too).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from urllib.parse import urlparse

from kiln_config.base import write_private
from kiln_config.errors import InputError, KilnError

__all__ = ["ObjectInfo", "ObjectTooLarge", "ProbeError", "Storage", "worker_storage"]


class ProbeError(KilnError, OSError):
    """A storage root cannot be listed; the message names the URI and the cause."""


class ObjectTooLarge(ValueError):
    """An object over the size a reader accepts (`ingest.max_bytes`)."""

    def __init__(self, key: str, max_bytes: int):
        super().__init__(f"{key} is over {max_bytes} bytes (ingest.max_bytes)")
        self.key, self.max_bytes = key, max_bytes


@dataclass(frozen=True)
class ObjectInfo:
    """One listed object. `key` is relative to the storage prefix, '/'-separated."""

    key: str
    size: int
    version: str  # S3 ETag, or the local file's mtime in nanoseconds


class Storage:
    """Read, write and list objects under a root URI (a local folder or `s3://bucket/prefix`)."""

    def __init__(self, uri: str, endpoint_url: str | None = None):
        self.uri = uri.rstrip("/") if uri != "/" else uri
        parsed = urlparse(self.uri)
        self.is_s3 = parsed.scheme == "s3"
        if parsed.scheme not in ("", "s3", "file"):
            raise InputError(f"unsupported storage URI scheme {parsed.scheme!r} in {uri!r}")
        if self.is_s3:
            if not parsed.netloc:
                raise InputError(f"S3 URI has no bucket: {uri!r}")
            self.bucket = parsed.netloc
            self.prefix = parsed.path.strip("/")
            self.endpoint_url = endpoint_url or os.environ.get("S3_ENDPOINT_URL") or None
            self._client = None
        else:
            self.path = Path(parsed.path if parsed.scheme == "file" else self.uri)

    # -- helpers -------------------------------------------------------------------------------
    @property
    def client(self):
        if self._client is None:
            import boto3
            from botocore.config import Config

            # botocore retries throttling (SlowDown, 503) and 5xx with exponential backoff and
            # jitter; "adaptive" also rate-limits this client once the store pushes back.
            self._client = boto3.client(
                "s3",
                endpoint_url=self.endpoint_url,
                config=Config(
                    retries={"max_attempts": 10, "mode": "adaptive"},
                    connect_timeout=10,
                    read_timeout=60,
                    max_pool_connections=32,
                ),
            )
        return self._client

    def _s3_key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _local(self, key: str) -> Path:
        # Refuse keys that would escape the root ("..", absolute paths).
        rel = PurePosixPath(key)
        if rel.is_absolute() or ".." in rel.parts:
            raise ValueError(f"key escapes the storage root: {key!r}")
        return self.path.joinpath(*rel.parts)

    def url(self, key: str = "") -> str:
        if self.is_s3:
            return f"s3://{self.bucket}/{self._s3_key(key)}" if key else self.uri
        return str(self._local(key)) if key else str(self.path)

    # -- operations ----------------------------------------------------------------------------
    def probe(self) -> bool:
        """Whether the root holds at least one object, listing at most one key.

        Meant for checks before any work starts: on S3 it uses its own client with one retry
        and short timeouts, so a wrong endpoint, bucket or credential fails in seconds, not
        after the minutes of backoff the I/O client (10 adaptive attempts) would spend.

        Raises:
            ProbeError: the root does not exist, is not a folder, or cannot be listed; the
                message names the URI and the cause.
        """
        if self.is_s3:
            return self._probe_s3()
        if not self.path.exists():
            raise ProbeError(f"{self.uri} does not exist")
        if not self.path.is_dir():
            raise ProbeError(f"{self.uri} is a file, not a folder")
        try:
            for _, _, files in os.walk(self.path, onerror=_raise):
                if files:
                    return True
        except OSError as e:
            raise ProbeError(f"{self.uri} cannot be listed ({e.strerror or e})") from e
        return False

    def _probe_s3(self) -> bool:
        import boto3
        from botocore.config import Config
        from botocore.exceptions import BotoCoreError, ClientError

        client = boto3.client(
            "s3",
            endpoint_url=self.endpoint_url,
            config=Config(
                retries={"max_attempts": 2, "mode": "standard"}, connect_timeout=3, read_timeout=5
            ),
        )
        prefix = f"{self.prefix}/" if self.prefix else ""
        try:
            page = client.list_objects_v2(Bucket=self.bucket, Prefix=prefix, MaxKeys=1)
        except ClientError as e:
            err = e.response.get("Error", {})
            cause = f"{err.get('Code', 'error')}: {err.get('Message') or e}"
            raise ProbeError(f"cannot list {self.uri} ({cause})") from e
        except BotoCoreError as e:  # endpoint unreachable, no credentials, timeouts
            raise ProbeError(f"cannot list {self.uri} ({type(e).__name__}: {e})") from e
        return bool(page.get("KeyCount") or page.get("Contents"))

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every object below `prefix`, sorted by key. S3 listing paginates."""
        out = [o for batch in self.iter_list(prefix) for o in batch]
        out.sort(key=lambda o: o.key)
        return out

    def iter_list(self, prefix: str = "", batch: int = 10_000) -> Iterator[list[ObjectInfo]]:
        """Every object below `prefix`, in batches of up to `batch`, in no particular order:
        a caller that stages the listing never holds more than a batch of it."""
        out: list[ObjectInfo] = []
        if self.is_s3:
            base = self._s3_key(prefix)
            strip = f"{self.prefix}/" if self.prefix else ""
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base):
                for obj in page.get("Contents", []):
                    key = obj["Key"][len(strip) :]
                    if key and not key.endswith("/"):
                        out.append(ObjectInfo(key, obj["Size"], obj["ETag"].strip('"')))
                if len(out) >= batch:
                    yield out
                    out = []
        else:
            top = self._local(prefix) if prefix else self.path
            if top.is_dir():
                for p in top.rglob("*"):
                    if p.is_file():
                        st = p.stat()
                        key = p.relative_to(self.path).as_posix()
                        out.append(ObjectInfo(key, st.st_size, str(st.st_mtime_ns)))
                        if len(out) >= batch:
                            yield out
                            out = []
        if out:
            yield out

    def iter_top_level(self, batch: int = 10_000) -> Iterator[tuple[list[str], list[ObjectInfo]]]:
        """(sub-folder prefixes, objects) directly under the root, the partitions of a
        listing, in batches of up to `batch` objects (with the sub-folders found with them),
        in no particular order."""
        dirs: list[str] = []
        objs: list[ObjectInfo] = []
        if self.is_s3:
            strip = f"{self.prefix}/" if self.prefix else ""
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=strip, Delimiter="/"):
                dirs += [p["Prefix"][len(strip) :] for p in page.get("CommonPrefixes", [])]
                for obj in page.get("Contents", []):
                    key = obj["Key"][len(strip) :]
                    if key and not key.endswith("/"):
                        objs.append(ObjectInfo(key, obj["Size"], obj["ETag"].strip('"')))
                if len(objs) >= batch:
                    yield dirs, objs
                    dirs, objs = [], []
        elif self.path.is_dir():
            with os.scandir(self.path) as entries:
                for e in entries:
                    if e.is_dir():
                        dirs.append(e.name + "/")
                    elif e.is_file():
                        objs.append(ObjectInfo(e.name, *_size_mtime(e.stat())))
                        if len(objs) >= batch:
                            yield dirs, objs
                            dirs, objs = [], []
        if dirs or objs:
            yield dirs, objs

    def exists(self, key: str) -> bool:
        if self.is_s3:
            from botocore.exceptions import ClientError

            try:
                self.client.head_object(Bucket=self.bucket, Key=self._s3_key(key))
                return True
            except ClientError as e:
                if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                    return False
                raise
        return self._local(key).exists()

    def read_bytes(self, key: str, max_bytes: int | None = None) -> bytes:
        """The object's bytes.

        Raises:
            ObjectTooLarge: it is over `max_bytes` (then at most `max_bytes + 1` are read).
        """
        if self.is_s3:
            resp = self.client.get_object(Bucket=self.bucket, Key=self._s3_key(key))
            body, size = resp["Body"], resp.get("ContentLength")
        else:
            body = open(self._local(key), "rb")  # noqa: SIM115 - closed below
            size = os.fstat(body.fileno()).st_size
        try:
            if max_bytes is not None and size is not None and size > max_bytes:
                raise ObjectTooLarge(key, max_bytes)
            # Never `read(max_bytes + 1)`: http.client allocates (and zeroes) the whole amount
            # asked for, 256 MiB by default, for every small image.
            data = body.read() if size is not None or max_bytes is None else body.read(1 << 20)
            while size is None and max_bytes is not None and len(data) <= max_bytes:
                more = body.read(1 << 20)
                if not more:
                    break
                data += more
        finally:
            body.close()
        if max_bytes is not None and len(data) > max_bytes:  # grew since its size was read
            raise ObjectTooLarge(key, max_bytes)
        return data

    def read_range(self, key: str, offset: int, length: int) -> bytes:
        """`length` bytes from `offset`: one member of a tar shard, without reading the rest."""
        if length == 0:
            return b""
        if self.is_s3:
            resp = self.client.get_object(
                Bucket=self.bucket,
                Key=self._s3_key(key),
                Range=f"bytes={offset}-{offset + length - 1}",
            )
            return resp["Body"].read()
        with open(self._local(key), "rb") as f:
            f.seek(offset)
            return f.read(length)

    def open_stream(self, key: str):
        """A readable binary stream over one object (an S3 body streams; nothing is buffered)."""
        if self.is_s3:
            return self.client.get_object(Bucket=self.bucket, Key=self._s3_key(key))["Body"]
        return open(self._local(key), "rb")

    def download(self, key: str, path: Path) -> None:
        """Copy one object to the local file `path`, streamed (S3: in parts)."""
        if self.is_s3:
            self.client.download_file(self.bucket, self._s3_key(key), str(path))
        else:
            shutil.copyfile(self._local(key), path)

    def write_bytes(self, key: str, data: bytes) -> None:
        """Write atomically: readers see the old object or the new one, never a partial one."""
        if self.is_s3:
            self.client.put_object(Bucket=self.bucket, Key=self._s3_key(key), Body=data)
            return
        write_private(self._local(key), data)

    def upload_file(self, key: str, path: Path) -> None:
        """Copy a local file to `key`, atomically as `write_bytes` (S3: multipart when large;
        a reader sees the whole object or none)."""
        if self.is_s3:
            self.client.upload_file(str(path), self.bucket, self._s3_key(key))
            return
        dest = self._local(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=f".{dest.name}.")
        os.close(fd)
        try:
            shutil.copyfile(path, tmp)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def read_text(self, key: str) -> str:
        return self.read_bytes(key).decode("utf-8")

    def write_text(self, key: str, text: str) -> None:
        self.write_bytes(key, text.encode("utf-8"))


def _size_mtime(st: os.stat_result) -> tuple[int, str]:
    return st.st_size, str(st.st_mtime_ns)


def _raise(e: OSError) -> None:
    # os.walk skips unreadable folders silently by default; a probe must report them.
    raise e


_WORKER_STORES: dict[tuple[str, str | None], Storage] = {}


def worker_storage(uri: str, endpoint_url: str | None) -> Storage:
    """One client per worker process and source, reused across images (ingest's and the
    shard step's worker processes)."""
    key = (uri, endpoint_url)
    if key not in _WORKER_STORES:
        _WORKER_STORES[key] = Storage(uri, endpoint_url)
    return _WORKER_STORES[key]
