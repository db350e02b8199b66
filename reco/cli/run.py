"""`python run.py experiment=NAME [overrides]`: one experiment, composed once by Hydra (see README).

A user's mistake (a bad override, bad data, a variant graph that cannot run) prints the one clear
message reco builds and exits 2; RECO_TRACEBACK=1 shows the traceback too.
"""

import signal
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from reco import known_warnings
from reco.cli.compose import register
from reco.cli.errors import report, user_errors
from reco.config import CONF_DIR, typed
from reco.experiment import RunContext

register()  # typed schemas into Hydra's ConfigStore before @hydra.main composes


def _terminate(signum: int, frame: object) -> None:
    # SIGTERM unwinds like Ctrl-C: servers, load generators and MLflow runs are closed on the way out.
    raise KeyboardInterrupt(f"signal {signum}")


def run_context() -> RunContext:
    """Where Hydra put this job (output dir, sweep dir) and the user's overrides."""
    hc = HydraConfig.get()
    multirun = hc.mode.name == "MULTIRUN"
    return RunContext(
        out_dir=Path(hc.runtime.output_dir),
        multirun=multirun,
        overrides=[o for o in hc.overrides.task if not o.startswith("experiment=")],
        sweep_dir=str(hc.sweep.dir) if multirun else "",
    )


@hydra.main(version_base="1.3", config_path=str(CONF_DIR), config_name="config")
def main(cfg: DictConfig) -> float | None:
    """One pipeline execution; under `experiment=search` its objective, which Hydra's sweeper reads."""
    from reco.experiment import experiment_config
    from reco.pipeline import join, run

    signal.signal(signal.SIGTERM, _terminate)
    ctx = run_context()
    # before any TorchRec code runs: its warnings go to a file, the sharding plan and progress stay on screen
    noise = ctx.out_dir / "third_party_warnings.log"
    known_warnings.divert(noise)
    try:
        exp = experiment_config(cfg)
        if exp.trainer.distributed.node_rank > 0:  # another host's share of node 0's training
            join(exp)
            return None
        built = run(exp, ctx)
        if "search" in cfg:
            from reco.search import SearchConfig, finish_trial

            return finish_trial(exp, typed(cfg.search, SearchConfig, "search"), built)
    except user_errors() as e:
        sys.exit(report("reco", e))
    finally:
        if line := known_warnings.summary(noise):
            print(line, flush=True)
    return None
