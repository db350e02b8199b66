"""Declared dependencies match what the code imports, and `make` installs the locked versions."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Installed by the Makefile before pyproject (torchrec --no-deps would otherwise pull CUDA FBGEMM).
MAKEFILE_INSTALLED = {"torchrec", "fbgemm-gpu-cpu"}
# Imported by reco but installed only in another venv (`make triton-venv`): module -> distribution.
OTHER_VENV = {"pytriton": "nvidia-pytriton"}
# Declared without a direct import, each for a reason.
NOT_IMPORTED = {
    "tensordict": "torchrec's run-time dependency (torchrec is installed --no-deps)",
    "torchmetrics": "torchrec's run-time dependency",
    "pyre-extensions": "torchrec's run-time dependency",
    "iopath": "torchrec's run-time dependency",
    "onnxscript": "the dynamo ONNX exporter (accelerate.exporter=dynamo) imports it inside torch",
    "uvicorn": "imported by reco.serve; [standard] brings uvloop it picks up itself",
    "hydra-joblib-launcher": "a Hydra plugin (hydra_plugins namespace): hydra/launcher=joblib loads it",
    "hydra-optuna-sweeper": "a Hydra plugin (hydra_plugins namespace): experiment=search's sweeper",
    "hydra-submitit-launcher": "a Hydra plugin (hydra_plugins namespace): hydra/launcher=submitit_local loads it",
    "hiredis": "redis-py's C reply parser: redis picks it up itself when installed",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = meta["dependencies"] + [r for extra in meta["optional-dependencies"].values() for r in extra]
    return {_norm(re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0]) for r in reqs}


def imported_distributions(paths: list[Path]) -> dict[str, str]:
    """{distribution(s): first file importing it} for every third-party top-level import under `paths`;
    a module several distributions provide (mlflow: mlflow, mlflow-skinny, ...) is one key 'a|b|c'."""
    dists = packages_distributions()
    local = {f.stem for f in (ROOT / "tests").glob("*.py")}
    found: dict[str, str] = {}
    for root in paths:
        for f in sorted(root.rglob("*.py")):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.Import):
                    mods = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    mods = [node.module]
                else:
                    continue
                for m in mods:
                    top = m.split(".")[0]
                    if (
                        top in sys.stdlib_module_names
                        or top in local
                        or top in ("reco", "bench", "__future__")
                    ):
                        continue
                    names = dists.get(top) or [OTHER_VENV.get(top, top)]
                    key = "|".join(sorted({_norm(d) for d in names}))
                    found.setdefault(key, str(f.relative_to(ROOT)))
    return found


def test_every_import_is_declared():
    runtime = imported_distributions([ROOT / "reco", ROOT / "loadtest"])
    tests = imported_distributions([ROOT / "tests"])
    known = declared() | MAKEFILE_INSTALLED
    missing = {d: f for d, f in {**tests, **runtime}.items() if not set(d.split("|")) & known}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_every_declaration_is_used():
    used = {
        d
        for key in imported_distributions([ROOT / "reco", ROOT / "bench", ROOT / "loadtest", ROOT / "tests"])
        for d in key.split("|")
    }
    tools = {"pytest-timeout", "pytest-xdist", "ruff", "setuptools", "deptry", "import-linter"}
    unused = declared() - used - set(NOT_IMPORTED) - tools
    assert not unused, f"declared in pyproject.toml but never imported (nor explained): {sorted(unused)}"


def test_orjson_is_pinned_past_its_cve():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pin = next(r for r in meta["dependencies"] if r.startswith("orjson"))
    assert ">=3.9.15" in pin, pin  # CVE-2024-27454: unbounded recursion on deeply nested input


def test_make_installs_from_the_lock():
    make = (ROOT / "Makefile").read_text()
    lock = (ROOT / "requirements.lock").read_text()
    assert "-c requirements.lock" in make
    pins = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)$", lock, flags=re.M))
    for d in declared() | MAKEFILE_INSTALLED:
        assert any(_norm(k) == d for k in pins), f"{d} is not pinned in requirements.lock"


def test_a_server_of_an_onnx_variant_imports_no_training_stack():
    """A server (and anything else that composes the config) starts without torchrec, mlflow or
    scipy.stats: ~6 s of imports per process, paid by every server a study or a test starts."""
    code = (
        "import sys; import reco.serve.app; from reco.cli.serve import settings; settings([]); "
        "print(sorted(m for m in ('torchrec', 'fbgemm_gpu', 'mlflow', 'scipy.stats') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_a_server_of_an_onnx_variant_starts_without_torch(untuned_int8, data, tmp_path):
    """A server of an ONNX variant, started as a study starts it (its settings as a file), loads the
    variant and the dataset, builds its feature store and warms ONNX Runtime up without importing torch:
    ~1.3 s of CPU less per server start (more on a busy machine), of which the suite makes dozens."""
    from reco.cli.serve import settings
    from reco.serve.config import write_settings

    data.save(str(tmp_path / "data.pt"))
    write_settings(settings([]), tmp_path / "settings.json")
    code = (
        "import sys; from pathlib import Path; from reco.cli.serve import settings; "
        "from reco.serve.app import create_app; "
        f"create_app({untuned_int8.dir!r}, {str(tmp_path / 'data.pt')!r}, "
        f"settings([], file=Path({str(tmp_path / 'settings.json')!r}))); "
        "print(sorted(m for m in ('torch', 'torchrec', 'fbgemm_gpu', 'mlflow') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout + out.stderr
