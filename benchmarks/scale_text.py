"""The fixed prose of ``SCALE.md``: what the simulator is, its model's parameters, the hooks the
library lacks. (Numbers live in the tables :mod:`benchmarks.scale_report` renders.)"""

from __future__ import annotations

from objckpt._retry import RetryPolicy
from objckpt.testing.scale import NetworkModel, StoreProfile

SIMULATOR = [
    "## The simulator",
    "",
    "Code: `objckpt/testing/scale/` (the simulator), `benchmarks/scale.py` (the scenarios), "
    "`benchmarks/scale_report.py` (these tables), `tests/scale/` (CI: counts at 8 and 64 ranks before "
    "and after each fix, and the simulator's own validation).",
    "",
    "**Real** (objckpt's code, unmodified, called as a job calls it): `SaveSession` (handshake, "
    "receipts gather, `Coordinator.commit` with its verification, manifest create-if-absent, pointer "
    "compare-and-swap, retention/GC), `RestoreSession` (rank 0 resolves, broadcasts the manifest, every "
    "rank validates it, the agreement rounds), `ShardWriter` (with `key_spreading`), "
    "`coordination.exchange.read_shared` with its `plan_shared` and `check_received` (replicated state read once), `Reader.read_shard` "
    "(CRC32C-verified streams), the store's public methods with its retry policy (tenacity, jitter, "
    "deadline) and `get_stream`'s resume loop, `MemoryStore` holding every byte, the library's "
    "gathers and broadcasts carrying the sessions' values as JSON between threads (every sender's value "
    "and every receiver's copy JSON round-tripped).",
    "",
    "**Simulated**: the store's performance (rate limits with 503 SlowDown, latency, bandwidth) and time "
    "itself (a virtual clock per rank); collective costs; what a rank writes and reads (a torch-free "
    "mirror of `CheckpointManager`'s layout: `shard-NN.bin` x 7 + `replicated.bin`; before the fix a "
    "restore reads its own shards and every `replicated.bin`, 8 reads in flight); sizes (`byte_scale`). "
    "No collective uses the `ThreadWorld` barrier (it wakes every thread through one condition: ~110 s "
    "per collective at 16,384 threads here): each is one rendezvous where a waiting thread blocks on an "
    "event of its own that the completing arrival sets (a gather's senders leave once they have sent, "
    "rank 0 waits for the last; a broadcast's receivers wait for the source; measured: one `agree` in "
    "~20 s at 16,384 threads); a failing rank or a timeout breaks the world, every waiting rank raising. "
    "The read-once exchange (`Comm.all_gather_bytes`, one collective per restore) gives every rank the "
    "same list, its cost the gloo transport's rounds (`exchange_rounds` under `EXCHANGE_BUDGET`). "
    "Beyond 4,096 ranks, a save runs 4 ranks per `ThreadWorld` thread (a read-once restore one thread "
    "per rank: its exchange is a collective of every rank): "
    "the sessions still see N ranks and the coordinator verifies N ranks' receipts, every rank's I/O runs "
    "on its own thread and timeline, but a thread's other ranks contribute its first rank's values to "
    "the handshake and staging verdicts (their own receipts, and listings, to the commit). Every rank "
    "parses the manifest it receives (`Manifest.decode`): the real parse runs once per distinct bytes object and every rank's clock is charged "
    "its measured CPU (W real parses of a manifest that grows with W are O(W^2) here). Likewise in a "
    "read-once restore's `read_shared`, every rank plans from the W receipts (`plan_shared`) and "
    "CRC32C-checks the shards it received (`check_received`): each runs for real once per distinct "
    "object (every rank plans from the same receipts object and receives the very same gathered "
    "objects) and every rank's clock is charged its measured CPU (a derived quantity; the counts are "
    "the same either way, tested).",
    "",
    "**Virtual clock**: a request costs its latency plus its bytes at the connection's and the host "
    "NIC's bandwidth; a 503 costs its latency and the retry policy's own backoff sleep, which the "
    "simulation turns into virtual time by replacing the `time` module seen by `tenacity`, "
    "`tenacity.nap`, `objckpt.store._reads`, `objckpt.store._budget` and the sessions (and patching `ThreadPoolExecutor` so pool "
    "threads inherit their submitter's clock); no simulated thread sleeps for real (tested). Simulated "
    "threads run one at a time, earliest virtual time first (a baton handed over within a 0.25 s lag), "
    "so requests reach the rate limiter in time order. Charged CPU: the coordinator's `commit` (thread "
    "CPU minus the in-memory store's), every manifest parse, and read-once's CRC32C checks and plan.",
    "",
    "**Real time at thousands of threads**: tenacity builds a `Retrying`, and with it a "
    "`threading.local`, for every request; CPython frees a `threading.local` by walking every live "
    "thread (measured here: 0.8 us at 0 threads, 0.76 ms at 4,096, 2.4 ms at 16,384), so inside the "
    "simulation tenacity's `threading.local` is a dict keyed by thread (the same semantics, tested), and "
    "the simulated ranks run on daemon threads (starting or joining a non-daemon thread walks every live "
    "one). Neither changes a request.",
]


def model_table() -> list[str]:
    s3, gcs, net, retry = StoreProfile.s3(), StoreProfile.gcs(), NetworkModel(), RetryPolicy()
    assert s3.partition_limits is not None and gcs.bucket_limits is not None
    return [
        "### Model parameters (`objckpt/testing/scale/model.py`)",
        "",
        "| parameter | S3 profile | GCS profile | source |",
        "|---|---|---|---|",
        f"| writes per second (PUT, POST, DELETE) | {s3.partition_limits.write_per_s:,.0f} per key-range partition "
        f"| ~{gcs.bucket_limits.write_per_s:,.0f} per bucket | s3_rates, gcs_rates |",
        f"| reads per second (GET, HEAD, LIST) | {s3.partition_limits.read_per_s:,.0f} per partition (LIST assumed a read) "
        f"| ~{gcs.bucket_limits.read_per_s:,.0f} per bucket (listing is a read) | s3_rates, gcs_rates |",
        f"| counting | fixed {s3.window_s:g} s windows; a refused request uses no capacity | same | assumed |",
        f"| adaptation | a partition throttling for {s3.split_after_s / 60 if s3.split_after_s else 0:g} min splits at "
        f"the median of its recent keys | the bucket limit doubles per {gcs.ramp_period_s / 60 if gcs.ramp_period_s else 0:g} "
        "min above half its limit | s3_split_time, gcs_rates |",
        "| initial partitions | `data/` cut at the 256 spreading prefixes (see the header) | one bucket | s3_503, assumed |",
        "| DeleteObjects | 1 request, 1 write unit per key | same | assumed |",
        f"| request latency | {net.request_latency_s * 1000:g} ms (small requests: tens of ms) | same | s3_503 |",
        f"| LIST page latency / 503 latency | {net.list_latency_s * 1000:g} ms / {net.error_latency_s * 1000:g} ms | same | assumed |",
        f"| bandwidth | {net.connection_bandwidth / 1e6:g} MB/s per connection, {net.host_bandwidth / 1e9:g} GB/s per "
        f"host and direction, {net.ranks_per_host} ranks per host | same | assumed |",
        f"| collectives | {net.collective_latency_s * 1e6:g} us per tree level + {net.collective_bandwidth / 1e9:g} GB/s | same | assumed |",
        f"| retry policy | the library's default: {retry.deadline:g} s deadline per request, backoff {retry.initial_backoff:g} s "
        f"doubling to {retry.max_backoff:g} s with full jitter, at most {retry.max_attempts:,} tries | same | `objckpt/_retry.py` |",
        "| AIMD pacing (`Store.pacing`) | *after*: the library's `Pacer`, one per simulated rank, told the "
        "rank's virtual requests in flight (`Pacer.feedback`); *before*: off | same | `objckpt/store/pacing.py` |",
    ]


HOOKS = [
    "## Hooks the library lacks (worked around here)",
    "",
    "- **An injectable clock/sleep** (`RetryPolicy(sleep=, monotonic=)`, and for `Store.get_stream`'s "
    "resume loop and the sessions' timestamps): the simulator replaces the `time` module inside "
    "tenacity, `objckpt.store._reads`, `objckpt.store._budget` and the sessions instead.",
    "- **AIMD pacing with virtual concurrency** (added: `Pacer.epoch` and `Pacer.feedback(epoch, "
    "throttled=, in_flight=)`): `Pacer.acquire`/`release` count real requests in flight and wait on a "
    "real condition variable, while a simulated rank issues its concurrent requests as virtual lanes of "
    "one thread. The simulator now counts each rank's lanes in flight itself, waits for a slot on the "
    "rank's virtual clock and reports every try's answer to a real `Pacer` per rank (one Pacer per store "
    "object would be shared by every simulated rank, so the store's own `pacing` stays off). Not "
    "covered: retention's pool of 16 HEADs counts as 1 in flight.",
    "- **Timing hooks on `SaveSession`** (commit and retention durations and request counts): the "
    "simulator subclasses `SaveSession` to time `commit` and `retain`.",
]
