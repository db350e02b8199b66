"""HTTP recommendation service: any Variant behind POST /recommend (see reco.serve.app).

Run: `python -m reco.cli.serve --variant DIR --dataset PATH.pt [--port 8000] [key=value ...]`;
from code: `reco.serve.process.start_server(...)`.
"""
