"""python -m reco.serve --variant DIR --dataset PATH.pt [--host H] [--port P] [--config FILE] [key=value ...]

Settings come from conf/serve/default.yaml (or --config, YAML or JSON) with `key=value` overrides
(dotted keys: batching.enabled=true, cpu_affinity=[1]). The process refuses to start, with the reason on
stderr and exit code 2, when the variant or dataset cannot be served.

workers > 1: that many worker processes, each with its own SO_REUSEPORT listening socket on the same
port, so the kernel spreads connections over them (uvicorn's own workers share one socket, and on an
idle-ish server one worker ends up accepting nearly every connection). /metrics aggregates all workers
(prometheus_client multiprocess mode).
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import shutil
import signal
import sys
import tempfile

from reco.serve.app import check_same_data, load_settings, serve_worker
from reco.serve.features import ServeConfigError


def check_servable(variant_dir: str, dataset_path: str, settings: dict) -> None:
    """Fail fast (before worker processes exist) on a missing variant/dataset or a schema without keys."""
    from reco.data.schema import Dataset
    from reco.serve.features import FeatureStore
    from reco.variant import Variant

    v = Variant.load(variant_dir)
    for role in v.artifacts:
        v.verify(role)
    if not os.path.exists(dataset_path):
        raise ServeConfigError(f"--dataset {dataset_path}: file not found (expected a Dataset saved by reco)")
    data = Dataset.load(dataset_path)
    check_same_data(v, data, dataset_path)
    FeatureStore(data, settings.get("retrieval", {}))


def uvicorn_options(settings: dict) -> dict:
    return {
        "loop": "uvloop",
        "http": "httptools",
        "access_log": False,
        "log_level": settings["log_level"],
        "timeout_graceful_shutdown": 5,
    }


def run_workers(variant: str, dataset: str, settings: dict) -> int:
    """Start settings['workers'] worker processes and supervise them until SIGTERM/SIGINT or one dies."""
    prom_dir = tempfile.mkdtemp(prefix="reco-prom-")
    # prometheus_client reads this at its first import, which happens in each (spawned) worker.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = prom_dir
    spec = json.dumps({"variant": variant, "dataset": dataset, "settings": settings})
    ctx = mp.get_context("spawn")
    args = (spec, settings["host"], int(settings["port"]), uvicorn_options(settings))
    procs = [
        ctx.Process(target=serve_worker, args=args, name=f"reco-serve-{i}")
        for i in range(int(settings["workers"]))
    ]
    stopping = False

    def stop(signum: int, frame: object) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.is_alive():
                p.terminate()  # SIGTERM: uvicorn finishes in-flight requests and exits

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    try:
        for p in procs:
            p.start()
        # Wait until any worker exits; a worker dying on its own takes the server down (no silent half capacity).
        while all(p.is_alive() for p in procs) and not stopping:
            mp.connection.wait([p.sentinel for p in procs], timeout=1.0)
        crashed = not stopping
        if crashed:
            stop(signal.SIGTERM, None)
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
        return 1 if crashed else 0
    finally:
        shutil.rmtree(prom_dir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reco.serve", description=__doc__.splitlines()[0])
    p.add_argument("--variant", required=True, help="variant directory (holds variant.json)")
    p.add_argument(
        "--dataset", required=True, help="Dataset .pt file whose train split feeds the feature store"
    )
    p.add_argument("--host", help="bind address (default: serve.host)")
    p.add_argument("--port", type=int, help="port (default: serve.port)")
    p.add_argument("--config", help="settings file, YAML or JSON (default: conf/serve/default.yaml)")
    p.add_argument("overrides", nargs="*", help="key=value settings overrides")
    args = p.parse_args(argv)

    from reco.serve.app import create_app
    from reco.variant import ArtifactError

    app = None
    try:
        settings = load_settings(args.config, args.overrides)
        settings["host"] = args.host or settings["host"]
        settings["port"] = args.port if args.port is not None else settings["port"]
        logging.basicConfig(
            level=str(settings["log_level"]).upper(), format="%(asctime)s %(name)s %(message)s"
        )
        if settings.get("cpu_affinity"):
            os.sched_setaffinity(0, [int(c) for c in settings["cpu_affinity"]])  # workers inherit it
        if int(settings["workers"]) < 1:
            raise ServeConfigError(f"serve.workers: expected >= 1, got {settings['workers']}")
        if int(settings["workers"]) == 1:
            app = create_app(args.variant, args.dataset, settings)
        else:
            check_servable(args.variant, args.dataset, settings)
    except (ServeConfigError, ArtifactError, OSError, KeyError, ValueError) as e:
        print(f"reco.serve: cannot start: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    from reco.serve.keepwarm import start_keep_warm, stop_keep_warm

    spinners = start_keep_warm(sorted(os.sched_getaffinity(0))) if settings["keep_warm"] else []
    try:
        if app is None:
            return run_workers(args.variant, args.dataset, settings)
        import uvicorn

        uvicorn.run(app, host=settings["host"], port=int(settings["port"]), **uvicorn_options(settings))
        return 0
    finally:
        stop_keep_warm(spinners)


if __name__ == "__main__":
    sys.exit(main())
