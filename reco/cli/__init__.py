"""The top floor: every entry point (run.py's main and each `python -m reco.cli.<tool>`) and config
composition. Nothing else in reco imports from here (import-linter's layers contract, pyproject.toml).

Each tool composes (or reads) its configuration once, types it, and hands the typed sections to library
code; a user's mistake prints the one clear message reco builds and exits non-zero (reco.cli.errors).
"""
