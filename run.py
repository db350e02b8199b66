"""Entry point: `python run.py experiment=NAME [overrides]` (see README)."""

import signal

import hydra
from omegaconf import DictConfig

from reco.config import register

register()  # typed schemas into Hydra's ConfigStore before @hydra.main composes


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM unwinds like Ctrl-C: servers, load generators and MLflow runs are closed on the way out.
    raise KeyboardInterrupt(f"signal {signum}")


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from reco.pipeline import run

    signal.signal(signal.SIGTERM, _terminate)
    run(cfg)


if __name__ == "__main__":
    main()
