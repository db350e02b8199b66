"""Entry point: `python run.py experiment=NAME [overrides]` (see README; the code is reco/cli/run.py)."""

from reco.cli.run import main

if __name__ == "__main__":
    main()
