"""Benchmarks that are not library code: each is `python -m bench.<name>` from the project root and
prints a table (they may import anything in reco, reco.cli included; nothing in reco imports them)."""
