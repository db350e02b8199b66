"""What MLflow's UI shows from the link a run prints, in a real browser (issue 47, finding 1).

    python -m bench.mlflow_view [--uri sqlite:///mlruns/mlflow.db] [--experiment smoke]
                                [--screenshot experiments/mlflow_view/runs_table.png]

Starts `mlflow ui` on the store, opens the newest execution's printed link (reco.pipeline.runs_table_url,
on this UI's port) in headless Chromium, saves a screenshot and reads the rendered page (--dump-dom):
which variants are rows with no click, each row's gate, the order of the metric columns, and whether
the GenAI sidebar (Sessions, Judges, Prompts) is shown. Exits 1 when a variant is not a visible row or
the decision columns do not come first. Needs `chromium` (Debian: apt-get install chromium).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from mlflow.tracking import MlflowClient

from reco.pipeline import decision_columns, runs_table_url
from reco.serve.process import free_port
from reco.tracking import latest_variant_runs

# Chromium renders the React app in virtual time: the runs search and the table need a few seconds.
VIRTUAL_TIME_MS = 25000
WINDOW = "1600,1000"
GENAI_ONLY = ("Sessions", "Judges", "Prompts")  # sidebar entries of the GenAI view, not of model training


def start_ui(uri: str, port: int, timeout_s: float = 120.0) -> subprocess.Popen:
    """`mlflow ui` on 127.0.0.1:port, returned once it answers."""
    mlflow = Path(sys.executable).parent / "mlflow"
    cmd = [str(mlflow), "ui", "--backend-store-uri", uri, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            return proc
        except OSError:
            time.sleep(1)
    stop(proc)
    raise RuntimeError(f"mlflow ui on port {port} did not answer within {timeout_s:.0f} s")


def stop(proc: subprocess.Popen) -> None:
    """End the UI and the workers it started (its own process group)."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=20)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)


def chromium(url: str, flag: str, profile: Path) -> str:
    """Run headless Chromium on `url` with `flag` (--dump-dom or --screenshot=<png>); its stdout."""
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        raise SystemExit("chromium not found: apt-get install chromium")
    cmd = [
        exe,
        "--headless",
        "--no-sandbox",  # as root in a container
        "--disable-gpu",
        f"--user-data-dir={profile}",  # a fresh profile: what a first visit shows
        f"--virtual-time-budget={VIRTUAL_TIME_MS}",
        f"--window-size={WINDOW}",
        flag,
        url,
    ]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180).stdout


def table_rows(dom: str) -> dict[int, dict[str, str]]:
    """The runs table's rendered rows: {row index: {"name": run name, "gate": gate cell}}. AG Grid draws a
    row twice (the pinned run-name part and the scrolling metric part) under one `row-index`."""
    rows: dict[int, dict[str, str]] = {}
    starts = list(re.finditer(r'role="row" row-index="(\d+)"', dom))
    for m, nxt in zip(starts, [*starts[1:], None], strict=True):
        part = dom[m.end() : nxt.start() if nxt else len(dom)]
        row = rows.setdefault(int(m.group(1)), {})
        name = re.search(r'href="#/experiments/\d+/runs/\w+"><span[^>]*>([^<]+)</span>', part)
        gate = re.search(r'col-id="metrics.`gate`"[^>]*><div[^>]*><span[^>]*>([^<]*)</span>', part)
        if name:
            row["name"] = name.group(1)
        if gate:
            row["gate"] = gate.group(1)
    return rows


def metric_header(dom: str) -> list[str]:
    """The metric columns' ids left to right as drawn: AG Grid keeps header cells in DOM order and places
    them by their `left` offset."""
    cells = re.findall(r'col-id="(metrics\.`[^`]+`)" aria-sort[^>]*style="left: (\d+)px', dom)
    return [col for col, _ in sorted(set(cells), key=lambda c: int(c[1]))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--uri", default="sqlite:///mlruns/mlflow.db")
    ap.add_argument("--experiment", default="smoke")
    ap.add_argument("--screenshot", type=Path, default=Path("experiments/mlflow_view/runs_table.png"))
    args = ap.parse_args()

    parent, variants = latest_variant_runs(args.uri, args.experiment)
    client = MlflowClient(tracking_uri=args.uri)
    exp_id = client.get_experiment_by_name(args.experiment).experiment_id
    k = int(client.get_run(parent).data.params.get("quality.k", 10))
    port = free_port()
    url = runs_table_url(f"http://127.0.0.1:{port}", exp_id, view=parent)
    proc = start_ui(args.uri, port)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            args.screenshot.parent.mkdir(parents=True, exist_ok=True)
            chromium(url, f"--screenshot={args.screenshot.resolve()}", Path(tmp) / "shot")
            dom = chromium(url, "--dump-dom", Path(tmp) / "dom")
    finally:
        stop(proc)

    rows = table_rows(dom)
    shown = {r.get("name"): r.get("gate", "") for r in rows.values()}
    print(f"MLflow UI, link: {url}")
    print(f"{'variant':<32} {'row visible':>11} {'gate':>6}")
    for name in variants:
        print(f"{name:<32} {'yes' if name in shown else 'NO':>11} {shown.get(name, '-'):>6}")
    header = metric_header(dom)
    expected = [c for c in decision_columns(k) if c.startswith("metrics.") and c in header]
    genai = [w for w in GENAI_ONLY if f">{w}<" in dom]
    print(f"rows visible without a click: {sum(n in shown for n in variants)} of {len(variants)} variants")
    print(f"metric columns, left to right: {', '.join(c[9:-1] for c in header)}")
    print(f"GenAI sidebar entries shown: {', '.join(genai) or 'none'}")
    print(f"screenshot: {args.screenshot}  (rerun: python -m bench.mlflow_view --uri {args.uri})")
    ok = all(n in shown for n in variants) and header[: len(expected)] == expected and not genai
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
