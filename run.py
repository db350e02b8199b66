"""Entry point: `python run.py experiment=NAME [overrides]` (see README)."""

import hydra
from omegaconf import DictConfig

from reco.config import register

register()  # the config groups' schemas must be in Hydra's ConfigStore before @hydra.main composes


@hydra.main(version_base="1.3", config_path="conf", config_name="config")
def main(cfg: DictConfig) -> None:
    from reco.pipeline import run

    run(cfg)


if __name__ == "__main__":
    main()
