"""python -m reco.serve --variant DIR --dataset PATH.pt [--host H] [--port P] [key=value ...]

Settings: the project config's `serve` group (conf/serve/default.yaml, schema reco/serve/config.py)
with `key=value` overrides of its keys (dotted: batching.enabled=true, cpu_affinity=[1]), composed with
Hydra exactly as `python run.py serve.<key>=<value>` would. The process refuses to start, with the
reason on stderr and exit code 2, when the settings, the variant or the dataset cannot be served.

workers > 1: see reco/serve/workers.py (each worker its own SO_REUSEPORT socket on the same port).
SIGTERM/SIGINT stop the server, its workers and its keep-warm spinners, and exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys

from hydra.errors import HydraException

from reco.config import ConfigError, compose
from reco.serve.config import ServeConfig, serve_config
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
    from reco.serve.features import FeatureStore
    from reco.variant import Variant

    v = Variant.load(variant_dir)
    for role in v.artifacts:
        v.verify(role)
    if not os.path.exists(dataset_path):
        raise ServeConfigError(f"--dataset {dataset_path}: file not found (expected a Dataset saved by reco)")
    data = Dataset.load(dataset_path)
    check_same_data(v, data, dataset_path)
    FeatureStore(data, cfg.retrieval)


def settings(overrides: list[str], host: str | None = None, port: int | None = None) -> ServeConfig:
    """The serve settings: the composed project config's `serve` with `serve.<override>` applied.

    Args:
        overrides: `key=value` strings, keys relative to `serve`.
        host: --host, wins over serve.host.
        port: --port, wins over serve.port.
    Returns:
        The typed, range-checked settings; ConfigError (or Hydra's error) names a bad key.
    """
    cfg = serve_config(compose([f"serve.{o}" for o in overrides]).serve)
    return dataclasses.replace(
        cfg, host=host or cfg.host, port=port if port is not None else cfg.port
    ).check()


def pin_threads(cpus: list[int]) -> None:
    """Pin every thread this process has (the model runtime's included) to `cpus`; threads and processes
    started later (executor, spinners) inherit it from the thread that starts them."""
    for tid in os.listdir("/proc/self/task"):
        os.sched_setaffinity(int(tid), cpus)


def _stop(signum: int, frame: object) -> None:
    # Until uvicorn installs its own handlers (model loading) and after it hands them back: a requested
    # stop unwinds through `finally`, which stops the keep-warm spinners.
    raise SystemExit(0)


def main(argv: list[str] | None = None) -> int:
    """Run the server until SIGTERM/SIGINT.

    Args:
        argv: command line (default sys.argv[1:]).
    Returns:
        0 after a requested stop, 1 when a worker died, 2 when the server could not start.
    """
    args = arg_parser("python -m reco.serve", __doc__.splitlines()[0]).parse_args(argv)
    return run_stoppable(_run, args, _stop)


def run_stoppable(run, args: argparse.Namespace, stop) -> int:
    """run(args) with `stop` handling SIGTERM/SIGINT, the previous handlers restored after (both servers)."""
    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return run(args)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def arg_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The command line every server takes (reco's and the Triton backend)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--variant", required=True, help="variant directory (holds variant.json)")
    p.add_argument(
        "--dataset", required=True, help="Dataset .pt file whose train split feeds the feature store"
    )
    p.add_argument("--host", help="bind address (default: serve.host)")
    p.add_argument("--port", type=int, help="port (default: serve.port)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the serve settings")
    return p


def _run(args: argparse.Namespace) -> int:
    from reco.serve.app import create_app
    from reco.serve.workers import run_workers, uvicorn_options
    from reco.variant import ArtifactError

    app = None
    try:
        cfg = settings(args.overrides, args.host, args.port)
        logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(message)s")
        if cfg.workers == 1:
            # Loaded on any core, then pinned: a study starts all its servers at once, and pinned first
            # they queued their loading on the one server core (5 smoke servers: 22 s).
            app = create_app(args.variant, args.dataset, cfg)
            if cfg.cpu_affinity:
                pin_threads(cfg.cpu_affinity)
        else:
            if cfg.cpu_affinity:
                os.sched_setaffinity(0, cfg.cpu_affinity)  # worker processes inherit it
            check_servable(args.variant, args.dataset, cfg)
    except (ConfigError, HydraException, ServeConfigError, ArtifactError, OSError, KeyError, ValueError) as e:
        cause = f" ({str(e.__cause__).splitlines()[0]})" if e.__cause__ else ""
        print(f"reco.serve: cannot start: {type(e).__name__}: {e}{cause}", file=sys.stderr)
        return 2
    from reco.serve.keepwarm import start_keep_warm, stop_keep_warm

    spinners = start_keep_warm(sorted(os.sched_getaffinity(0))) if cfg.keep_warm else []
    try:
        if app is None:
            return run_workers(args.variant, args.dataset, cfg)
        import uvicorn

        uvicorn.run(app, host=cfg.host, port=cfg.port, **uvicorn_options(cfg))
        return 0
    finally:
        stop_keep_warm(spinners)


if __name__ == "__main__":
    sys.exit(main())
