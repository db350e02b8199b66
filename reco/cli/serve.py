"""python -m reco.cli.serve --variant DIR --dataset PATH.pt [--host H] [--port P] [--expect-sha256 HEX] [--settings FILE.json] [key=value ...]

Settings: the project config's `serve` group (conf/serve/default.yaml, schema reco/serve/config.py) with
`key=value` overrides of its keys (dotted: batching.enabled=true, cpu_affinity=[1]), composed with Hydra
exactly as `python run.py serve.<key>=<value>` would; or, from a study, the typed settings as one JSON
file (`--settings`, written by reco.serve.process). The process refuses to start, with the reason on
stderr and exit code 2, when the settings, the variant or the dataset cannot be served.
SIGTERM/SIGINT stop the server and exit 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from reco.cli.compose import compose
from reco.cli.errors import report, user_errors
from reco.serve.config import ServeConfig, read_settings, serve_config


def arg_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """The command line every server takes (reco's and the Triton backend)."""
    p = argparse.ArgumentParser(prog=prog, description=description)
    p.add_argument("--variant", required=True, help="variant directory (holds variant.json)")
    p.add_argument(
        "--dataset", required=True, help="Dataset .pt file whose train split feeds the feature store"
    )
    p.add_argument("--host", help="bind address (default: serve.host)")
    p.add_argument("--port", type=int, help="port (default: serve.port)")
    p.add_argument(
        "--expect-sha256",
        help="SHA-256 of the variant's variant.json, kept outside its directory (serve.expect_sha256)",
    )
    p.add_argument("--settings", type=Path, help="the typed serve settings as one JSON file (from a study)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of the serve settings")
    return p


def settings(
    overrides: list[str],
    host: str | None = None,
    port: int | None = None,
    file: Path | None = None,
    expect_sha256: str | None = None,
) -> ServeConfig:
    """The serve settings: `file` (JSON), or the composed `serve` with `serve.<override>` applied;
    `host` / `port` / `expect_sha256` win over either. Typed once; ConfigError names a bad key or value."""
    if file is not None:
        if overrides:
            raise ValueError("--settings: give either a settings file or key=value overrides, not both")
        cfg = read_settings(file)
    else:
        cfg = serve_config(compose([f"serve.{o}" for o in overrides]).serve)
    given = {"host": host, "port": port, "expect_sha256": expect_sha256}
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return cfg
    cfg = dataclasses.replace(cfg, **given)
    cfg.check("serve")  # the command line's values: their ranges (argparse gave their types)
    return cfg


def start(prog: str, argv: list[str] | None, serve) -> int:
    """Parse the command line, resolve the settings, and run serve(variant, dataset, settings)."""
    args = arg_parser(prog, __doc__.splitlines()[0]).parse_args(argv)
    try:
        cfg = settings(args.overrides, args.host, args.port, args.settings, args.expect_sha256)
    except user_errors() as e:
        return report(f"{prog}: cannot start", e)
    return serve(args.variant, args.dataset, cfg)


def main(argv: list[str] | None = None) -> int:
    """Run reco's server until SIGTERM/SIGINT: 0 after a requested stop, 1 when a worker died, 2 when the
    server could not start."""
    from reco.serve.server import serve

    return start("reco.serve", argv, serve)


if __name__ == "__main__":
    sys.exit(main())
