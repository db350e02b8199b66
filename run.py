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
def main(cfg: DictConfig) -> float | None:
    """One pipeline execution; under `experiment=search` its objective, which Hydra's sweeper reads."""
    from reco.pipeline import run

    signal.signal(signal.SIGTERM, _terminate)
    built = run(cfg)
    if "search" in cfg:
        from reco.search import finish_trial

        return finish_trial(cfg, built)
    return None


if __name__ == "__main__":
    main()
