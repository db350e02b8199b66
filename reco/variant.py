"""A Variant: one servable model plus its lineage, artifacts and measured metrics.

Everything downstream (steps, serving, load tests, tracking, the report) passes Variants along.
On disk a variant is a directory holding `variant.json` and its artifact files; every artifact's
SHA-256 is recorded at save time and checked at load time.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from reco.config import ConfigError

# torch and the model classes are imported where used: a server of an ONNX variant needs neither
if TYPE_CHECKING:
    from reco.models.protocol import RankingModel

Backend = Literal["torch", "torch_compile", "torch_bf16", "onnxruntime", "torchrec_quant"]


class ArtifactError(RuntimeError):
    pass


def _plain_name(name: str, what: str) -> str:
    """Artifact names are bare file names: a recorded '../x' or '/etc/x' must not reach outside."""
    if not name or name != Path(name).name or name in (".", ".."):
        raise ArtifactError(
            f"{what}: file name {name!r} must be a plain file name inside the variant directory"
        )
    return name


def atomic_write(path: str | Path, data: str | bytes) -> Path:
    """Write `data` to `path` so a reader (or a crash) sees the old file or the new one, never half:
    a temporary file in the same directory, fsynced, then renamed over the target."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    raw = data.encode() if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=p.parent, prefix=f".{p.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return p


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


@dataclass
class Variant:
    name: str
    step: str  # "train", "prune", "distill", "accelerate", ...
    parent: str | None  # parent variant name (None for the baseline)
    backend: Backend
    model_config: dict  # model.cfg.to_dict() of the underlying torch model (its Config's fields)
    dir: str = ""
    step_config: dict = field(default_factory=dict)
    artifacts: dict[str, str] = field(default_factory=dict)  # role -> file name inside dir
    sha256: dict[str, str] = field(default_factory=dict)  # role -> hex digest
    params: int = 0
    flops_per_candidate: int = 0
    size_mb: float = 0.0
    # Runtime settings a backend needs (e.g. ONNX Runtime session options, serving batcher hints).
    runtime: dict = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)
    # Per epoch of the step that trained it ({"train_loss", "val_auc", "val_logloss", ...}): the report's
    # learning curve. Empty for steps that do not train and for variants written before it was kept.
    learning_curve: list[dict[str, float]] = field(default_factory=list)
    data_fingerprint: str = ""
    cache_key: str = ""  # content hash of (parent cache key, step config, data): see reco.pipeline
    mlflow_run_id: str = ""
    # The model class (reco.models.protocol), resolved on load through the conf/model/ allow-list. The
    # default is what every variant written before models were configurable holds.
    model_target: str = "reco.models.dlrm.DLRM"

    @property
    def path(self) -> Path:
        return Path(self.dir)

    def artifact(self, role: str) -> Path:
        """The file of `role`; its recorded name must be a plain file name inside the variant directory."""
        if role not in self.artifacts:
            raise ArtifactError(
                f"variant {self.name!r} has no {role!r} artifact (has {sorted(self.artifacts)})"
            )
        return self.path / _plain_name(self.artifacts[role], f"variant {self.name!r} artifact {role!r}")

    @property
    def serving_role(self) -> str:
        # torchrec_quant: quantized tables (reco.runtime.torchrec_quant), not loadable by load_torch
        return {"onnxruntime": "onnx", "torchrec_quant": "qtorch"}.get(self.backend, "torch")

    def add_artifact(self, role: str, file_name: str) -> None:
        """Record a file of this variant with its SHA-256. `size_mb` counts only the file the runtime
        loads (reports, a control model or an ONNX variant's source weights are not served)."""
        self.artifacts[role] = _plain_name(file_name, f"variant {self.name!r} artifact {role!r}")
        self.sha256[role] = sha256_file(self.path / file_name)
        if role == self.serving_role:
            self.size_mb = (self.path / file_name).stat().st_size / 2**20

    def verify(self, role: str) -> Path:
        p = self.artifact(role)
        if not p.exists():
            raise ArtifactError(f"{p}: artifact file missing for variant {self.name!r}")
        got = sha256_file(p)
        if got != self.sha256.get(role):
            raise ArtifactError(
                f"{p}: SHA-256 mismatch for variant {self.name!r} (expected {self.sha256.get(role)}, got {got})"
            )
        return p

    def save(self) -> Path:
        """variant.json, written atomically (a kill mid-write leaves the previous file intact)."""
        return atomic_write(self.path / "variant.json", json.dumps(asdict(self), indent=2, sort_keys=True))

    @staticmethod
    def load(path: str | Path) -> Variant:
        p = Path(path)
        if p.is_dir():
            p = p / "variant.json"
        if not p.exists():
            raise ArtifactError(f"{p}: no variant.json (expected a variant directory written by reco)")
        try:
            v = Variant(**json.loads(p.read_text()))
        except (json.JSONDecodeError, TypeError) as e:
            raise ArtifactError(f"{p}: not a valid variant record ({e})") from None
        v.dir = str(p.parent)
        return v

    # Torch weights ------------------------------------------------------------------------------
    def save_torch(self, model: RankingModel) -> None:
        """The state dict (model.pt) plus what rebuilds the module: model_config and model_target."""
        import torch

        from reco.models.protocol import count_params, target_of

        self.path.mkdir(parents=True, exist_ok=True)
        torch.save(model.state_dict(), self.path / "model.pt")
        self.model_config = model.cfg.to_dict()
        self.model_target = target_of(type(model))
        self.params = count_params(model)
        self.flops_per_candidate = model.cfg.flops_per_candidate()
        self.add_artifact("torch", "model.pt")

    def model_class(self) -> type[RankingModel]:
        """The class `model_target` names, if conf/model/ allows it (a manifest never names arbitrary code)."""
        from reco.models.protocol import resolve

        try:
            return resolve(self.model_target, f"variant {self.name!r} model_target")
        except ConfigError as e:
            raise ArtifactError(f"{self.path / 'variant.json'}: {e}") from None

    def model_cfg(self):
        """The model's Config (e.g. DLRMConfig) rebuilt from the recorded model_config."""
        return self.model_class().Config(**self.model_config)

    def load_torch(self) -> RankingModel:
        """Weights only: no pickled code is executed (torch.load(weights_only=True))."""
        import torch

        model = self.model_class()(self.model_cfg())
        state = torch.load(self.verify("torch"), weights_only=True)
        model.load_state_dict(state)
        return model.eval()
