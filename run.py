"""Entry point: `python run.py experiment=NAME [overrides]` (see README)."""

import hydra
from omegaconf import DictConfig


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from reco.pipeline import run

    run(cfg)


if __name__ == "__main__":
    main()
