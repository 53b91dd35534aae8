"""Micro-benchmark: S3Store's large-object put_stream/get against bare boto3 on the same server.

For one object of ``--size`` MiB it times, ``--runs`` times each, interleaved:

* ``put``: ``S3Store.put_stream`` (bounded parallel multipart, per-part CRC32C) vs a bare boto3
  multipart loop (``upload_part`` in a thread pool of the same width and part size, botocore
  defaults otherwise) and, with ``--aio``, the same loop on aioboto3 (asyncio.gather, semaphore);
* ``get``: ``S3Store.get`` (whole object as bytes) and ``S3Store.get_stream`` (chunks,
  CRC32C-verified at the end) vs a bare parallel ranged-GET loop (part-sized ranges in a thread
  pool, joined into one bytes object). Against moto pass ``--store-option read_concurrency=1``
  or use the default server options (``MotoServer.store_options`` sets it): moto copies the
  whole object for every ranged GET.

and prints medians and objckpt/raw ratios (time; < 1 means objckpt was faster).

    .venv/bin/python benchmarks/bench_store.py --server moto --size 256
    .venv/bin/python benchmarks/bench_store.py --server localstack --size 256 --aio
    .venv/bin/python benchmarks/bench_store.py --endpoint http://127.0.0.1:4566 --bucket b
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import boto3  # noqa: E402
from botocore.config import Config  # noqa: E402

from objckpt._crc import crc32c_b64  # noqa: E402
from objckpt.store import PutMode, open_store  # noqa: E402
from objckpt.testing.s3_servers import (  # noqa: E402
    DUMMY_CREDENTIALS,
    LocalStackServer,
    MotoServer,
    create_bucket,
)

MiB = 1024 * 1024


def raw_client(endpoint: str, pool: int) -> object:
    """A plain boto3 client as a user would make one (only endpoint, path style, pool size)."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=pool),
    )


def raw_put(client, bucket: str, key: str, data: bytes, part: int, width: int) -> None:
    up = client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    view = memoryview(data)

    def one(i: int) -> dict:
        body = view[i * part : (i + 1) * part].tobytes()  # what a caller slicing bytes gets
        etag = client.upload_part(Bucket=bucket, Key=key, UploadId=up, PartNumber=i + 1, Body=body)["ETag"]
        return {"PartNumber": i + 1, "ETag": etag}

    n = (len(data) + part - 1) // part
    with ThreadPoolExecutor(width) as pool:
        parts = list(pool.map(one, range(n)))
    client.complete_multipart_upload(Bucket=bucket, Key=key, UploadId=up, MultipartUpload={"Parts": parts})


def raw_get(client, bucket: str, key: str, size: int, part: int, width: int) -> int:
    """Parallel ranged GETs joined into one bytes object, as ``S3Store.get`` returns."""

    def one(i: int) -> bytes:
        end = min(size, (i + 1) * part) - 1
        return client.get_object(Bucket=bucket, Key=key, Range=f"bytes={i * part}-{end}")["Body"].read()

    n = (size + part - 1) // part
    with ThreadPoolExecutor(width) as pool:
        return len(b"".join(pool.map(one, range(n))))


def aio_put(endpoint: str, bucket: str, key: str, data: bytes, part: int, width: int) -> None:
    import aioboto3
    from aiobotocore.config import AioConfig

    async def main() -> None:
        session = aioboto3.Session(
            aws_access_key_id=DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name="us-east-1",
        )
        config = AioConfig(
            s3={"addressing_style": "path"},
            max_pool_connections=width,
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
        )
        async with session.client("s3", endpoint_url=endpoint, config=config) as client:
            up = (await client.create_multipart_upload(Bucket=bucket, Key=key, ChecksumAlgorithm="CRC32C"))[
                "UploadId"
            ]
            sem = asyncio.Semaphore(width)
            view = memoryview(data)

            async def one(i: int) -> dict:
                async with sem:
                    body = view[i * part : (i + 1) * part].tobytes()
                    crc = crc32c_b64(body)
                    resp = await client.upload_part(
                        Bucket=bucket,
                        Key=key,
                        UploadId=up,
                        PartNumber=i + 1,
                        Body=body,
                        ChecksumAlgorithm="CRC32C",
                        ChecksumCRC32C=crc,
                    )
                    return {"PartNumber": i + 1, "ETag": resp["ETag"], "ChecksumCRC32C": crc}

            n = (len(data) + part - 1) // part
            parts = await asyncio.gather(*(one(i) for i in range(n)))
            await client.complete_multipart_upload(
                Bucket=bucket, Key=key, UploadId=up, MultipartUpload={"Parts": list(parts)}
            )

    asyncio.run(main())


def timed(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds): on a small shared machine the client's CPU
    competes with the server's, so both matter."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--server",
        choices=["moto", "localstack"],
        default="moto",
        help="start this local server (ignored with --endpoint)",
    )
    ap.add_argument("--endpoint", help="use a running S3-compatible server instead")
    ap.add_argument("--bucket", default="objckpt-bench")
    ap.add_argument("--size", type=int, default=256, help="object size in MiB (default 256)")
    ap.add_argument("--part-size", type=int, default=16, help="MiB (default 16, the store default)")
    ap.add_argument("--width", type=int, default=8, help="parts in flight (default 8)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--aio", action="store_true", help="also time an aioboto3 multipart put")
    ap.add_argument(
        "--store-option",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="extra S3Store option, e.g. payload_signing=false",
    )
    args = ap.parse_args(argv)

    size, part, width = args.size * MiB, args.part_size * MiB, args.width
    data = os.urandom(size)
    crc = crc32c_b64(data)
    with ExitStack() as stack:
        if args.endpoint:
            endpoint, server_name = args.endpoint, args.endpoint
        else:
            srv = stack.enter_context(MotoServer() if args.server == "moto" else LocalStackServer())
            endpoint, server_name = srv.endpoint_url, f"{args.server} (started in {srv.startup_seconds:.1f}s)"
        create_bucket(endpoint, args.bucket)
        options = (
            dict(srv.store_options)
            if not args.endpoint
            else {
                "endpoint_url": endpoint,
                "access_key_id": DUMMY_CREDENTIALS["AWS_ACCESS_KEY_ID"],
                "secret_access_key": DUMMY_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            }
        )
        options.update(part_size=str(part), max_in_flight=str(width))
        options.update(dict(o.split("=", 1) for o in args.store_option))
        store = stack.enter_context(open_store(f"s3://{args.bucket}/bench", **options))
        client = raw_client(endpoint, pool=max(width, 10))
        stack.callback(client.close)

        times: dict[str, list[tuple[float, float]]] = {}

        def record(name: str, fn: Callable[[], object]) -> None:
            times.setdefault(name, []).append(timed(fn))

        def check_get(got: object) -> None:
            assert got == size, f"read {got} bytes, expected {size}"

        # warm-up (connection pools, server code paths) and correctness check, untimed
        store.put_stream("obj", data, mode=PutMode.OVERWRITE)
        assert store.head("obj").size == size
        raw_put(client, args.bucket, "bench/raw", data, part, width)
        for _ in range(args.runs):  # interleaved so drift on a shared machine hits all alike
            record("put objckpt", lambda: store.put_stream("obj", data, mode=PutMode.OVERWRITE))
            record("put raw boto3", lambda: raw_put(client, args.bucket, "bench/raw", data, part, width))
            if args.aio:
                record(
                    "put raw aioboto3", lambda: aio_put(endpoint, args.bucket, "bench/aio", data, part, width)
                )
            record("get objckpt get", lambda: check_get(len(store.get("obj"))))
            record(
                "get objckpt get_stream",
                lambda: check_get(
                    sum(len(c) for c in store.get_stream("obj", expected_size=size, expected_crc32c=crc))
                ),
            )
            record(
                "get raw ranged",
                lambda: check_get(raw_get(client, args.bucket, "bench/raw", size, part, width)),
            )

    med = {k: statistics.median(w for w, _ in v) for k, v in times.items()}
    cpu = {k: statistics.median(c for _, c in v) for k, v in times.items()}
    print(
        f"\nserver: {server_name}; object {args.size} MiB, part {args.part_size} MiB, "
        f"{width} in flight, median of {args.runs} runs"
    )
    shown = {
        k: v for k, v in options.items() if k not in ("access_key_id", "secret_access_key", "endpoint_url")
    }
    print(f"S3Store options: {shown}")
    print(f"{'case':<26}{'median s':>10}{'MiB/s':>9}{'vs raw':>9}{'client cpu s':>14}  all runs s")
    for name, value in med.items():
        base = med["put raw boto3"] if name.startswith("put") else med["get raw ranged"]
        runs = " ".join(f"{w:.2f}" for w, _ in times[name])
        print(
            f"{name:<26}{value:>10.2f}{args.size / value:>9.0f}{value / base:>9.2f}{cpu[name]:>14.2f}  {runs}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
