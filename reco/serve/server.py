"""Run reco's server in this process until SIGTERM/SIGINT: `serve(variant_dir, dataset_path, settings)`.

The entry point is `python -m reco.cli.serve` (it composes or reads the typed settings); this module
only serves them. workers > 1: see reco/serve/workers.py (each worker its own SO_REUSEPORT socket on
the same port). SIGTERM/SIGINT stop the server, its workers and its keep-warm spinners, and return 0.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from reco.serve.config import FeatureSource, ServeConfig
from reco.serve.features import ServeConfigError
from reco.serve.recommend import check_same_data


def check_servable(variant_dir: str, dataset_path: str, cfg: ServeConfig) -> None:
    """Fail fast (before worker processes exist) on a missing variant/dataset or a schema without keys.

    Args:
        variant_dir: the variant directory.
        dataset_path: the Dataset file.
        cfg: the serve settings.
    Raises:
        ServeConfigError / ArtifactError naming what is wrong.
    """
    from reco.data.schema import Dataset
    from reco.serve.auth import check_expected_digest, shared_secret
    from reco.serve.features import FeatureStore
    from reco.variant import Variant

    check_expected_digest(variant_dir, cfg)
    shared_secret(cfg)
    v = Variant.load(variant_dir)
    for role in v.artifacts:
        v.verify(role)
    if not os.path.exists(dataset_path):
        raise ServeConfigError(f"--dataset {dataset_path}: file not found (expected a Dataset saved by reco)")
    data = Dataset.load_arrays(dataset_path)
    check_same_data(v, data, dataset_path)
    store = FeatureStore(data, cfg.retrieval)
    if cfg.features == FeatureSource.redis:
        from reco.serve.redis_features import RedisFeatures

        RedisFeatures(store, data.fingerprint, cfg.redis)  # raises when Redis lacks this dataset's rows


def pin_threads(cpus: list[int], model_cpus: list[int] | None = None) -> None:
    """Pin every thread this process has (the model runtime's included) to `cpus`, the rank threads that
    already exist (the warm-up's) to `model_cpus` when given; threads and processes started later
    (executor, spinners) inherit it from the thread that starts them, a rank thread pins itself
    (reco.serve.app.pin_model_thread)."""
    from reco.serve.app import RANK_THREAD

    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cpus)
    if model_cpus:
        for t in threading.enumerate():
            if t.name.startswith(RANK_THREAD) and t.native_id is not None:
                os.sched_setaffinity(t.native_id, model_cpus)


def _stop(signum: int, frame: object) -> None:
    # Until uvicorn installs its own handlers (model loading) and after it hands them back: a requested
    # stop unwinds through `finally`, which stops the keep-warm spinners.
    raise SystemExit(0)


def run_stoppable(run: Callable[[], int], stop) -> int:
    """run() with `stop` handling SIGTERM/SIGINT, the previous handlers restored after (both servers)."""
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve(variant_dir: str, dataset_path: str, cfg: ServeConfig) -> int:
    """Serve the variant with `cfg` until SIGTERM/SIGINT.

    Returns:
        0 after a requested stop, 1 when a worker died, 2 when the server could not start (reason on stderr).
    """
    return run_stoppable(lambda: _run(variant_dir, dataset_path, cfg), _stop)


def _run(variant_dir: str, dataset_path: str, cfg: ServeConfig) -> int:
    from reco.serve.app import create_app
    from reco.serve.auth import exposed_without_secret
    from reco.serve.workers import run_server, run_workers, uvicorn_options
    from reco.variant import ArtifactError

    app = None
    try:
        logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
        if warning := exposed_without_secret(cfg):
            logging.getLogger("reco.serve").warning(warning)
        if cfg.workers == 1:
            # Loaded on any core, then pinned: a study starts all its servers at once, and pinned first
            # they queued their loading on the one server core.
            app = create_app(variant_dir, dataset_path, cfg)
            if cfg.cpu_affinity:
                pin_threads(cfg.cpu_affinity, cfg.model_cpu_affinity)
        else:
            if cfg.cpu_affinity:
                os.sched_setaffinity(0, cfg.cpu_affinity)  # worker processes inherit it
            check_servable(variant_dir, dataset_path, cfg)
    except (ServeConfigError, ArtifactError, OSError, KeyError, ValueError) as e:
        cause = f" ({str(e.__cause__).splitlines()[0]})" if e.__cause__ else ""
        print(f"reco.serve: cannot start: {type(e).__name__}: {e}{cause}", file=sys.stderr)
        return 2
    from reco.serve.keepwarm import start_keep_warm, stop_keep_warm

    spinners = start_keep_warm(sorted(os.sched_getaffinity(0))) if cfg.keep_warm else []
    try:
        if app is None:
            return run_workers(variant_dir, dataset_path, cfg)
        import uvicorn

        options = uvicorn_options(cfg, app.state.service.metrics.count_refused)
        run_server(uvicorn.Config(app, host=cfg.host, port=cfg.port, **options))
        return 0
    finally:
        stop_keep_warm(spinners)
