"""What the report reads: one VariantResult per variant and the StudyContext they were measured in.

The pipeline fills these; the report only reads them (nothing here measures anything).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from reco.loadtest.outcome import LoadOutcome, StudyOutcome
from reco.stats import Estimate
from reco.stats.gauc import GAUC
from reco.stats.graded import GradedQuality
from reco.stats.topk import TopKQuality
from reco.variant import Variant


@dataclass
class VariantResult:
    """One variant as the report sees it."""

    variant: Variant  # lineage (name/parent/step), params, size_mb, flops_per_candidate, metrics (auc, ...)
    load: LoadOutcome | None = None  # None: not load-tested (load test disabled, or the variant failed)
    # (absolute, relative) ΔAUC vs the baseline on the same test rows with DeLong CIs (reco.stats.auc_delta);
    # None for the baseline itself and when accuracy was not compared.
    auc_delta: tuple[Estimate, Estimate] | None = None
    quality: TopKQuality | None = None  # its served top-k (reco.serve.quality); None: not measured
    graded: GradedQuality | None = None  # that top-k graded by the planted P(click); None: no ground truth
    gauc: GAUC | None = None  # per-user AUC on the test split (reco.stats.gauc); None: not measured
    status: str = "ok"  # "ok" | "failed" (the variant could not be built or measured)
    error: str = ""  # why it failed


@dataclass
class Machine:
    """The machine the study ran on, for the report's setup section."""

    cpu: str  # reco.cpu.cpu_model: the model name with its family, model and vector extension
    cores: int
    versions: dict[str, str] = field(default_factory=dict)  # e.g. {"Python": "3.11.7", "torch": "2.13.0"}

    @classmethod
    def from_tags(cls, tags: dict[str, str]) -> Machine:
        """Build from reco.tracking.environment_tags() (keys `machine.cpu`, `machine.cores`, `machine.<lib>`).

        Args:
            tags: the environment tags logged to the MLflow parent run.
        Returns:
            Machine with every other `machine.*` tag as a version.
        """
        cores = tags.get("machine.cores", "")
        versions = {
            k.removeprefix("machine."): v
            for k, v in tags.items()
            if k.startswith("machine.") and k not in ("machine.cpu", "machine.cores")
        }
        return cls(tags.get("machine.cpu", "unknown"), int(cores) if cores.isdigit() else 0, versions)

    def line(self) -> str:
        """'Intel Xeon · 2 cores · python 3.11.7 · torch 2.13.0'."""
        return " · ".join([self.cpu, f"{self.cores} cores", *(f"{k} {v}" for k, v in self.versions.items())])


@dataclass(frozen=True)
class ReferenceRanking:
    """A ranker that is not a variant, in *What users see* to show what each measure rewards: the same
    requests' candidates ranked by training popularity, or by the true P(click) (the oracle)."""

    name: str
    quality: TopKQuality  # logged measures of its top-k, agreement with the baseline's
    graded: GradedQuality | None = None  # None: no planted click model
    gauc: GAUC | None = None  # its scores of the test rows, grouped by user


@dataclass
class StudyContext:
    """The yardsticks and setup every variant is judged against."""

    experiment: str
    baseline: str  # name of the baseline variant (the reference of every ratio and ΔAUC)
    max_auc_drop: float  # accuracy gate: relative ΔAUC limit as a fraction (0.005 = 0.5 %)
    max_error_rate: float  # latency gate: error rate above this at the common load fails
    study: StudyOutcome | None = None  # None: no load test (the gate checks accuracy only)
    machine: Machine | None = None
    commit: str = ""  # git commit the study ran from
    targets: dict[str, float] = field(default_factory=dict)  # e.g. {"e2e_speedup": 3.4, "qps_gain": 2.9}
    # the variant the headline targets are judged on (reco.report.targets); None: the best is selected
    headline: str | None = None
    # quality gate, relative limits as fractions: Δexpected clicks@k where the data has a planted click
    # model and the top-k was measured, else ΔGAUC; None: that measure does not gate
    max_clicks_drop: float | None = None
    max_gauc_drop: float | None = None
    planted: bool = False  # the data carries a planted click model: the oracle-graded measures apply
    look_confidence: float | None = None  # quality.look_confidence where quality.looks are set
    references: list[ReferenceRanking] = field(default_factory=list)  # rows of *What users see*, no gate
    retrieval: str = ""  # the candidates' source as served (FeatureStore.retrieval_name's wording)
    front: dict | None = None  # the served two-tower stage's index front (reco.pipeline._measure_front)
    # the baseline's own test AUC with its DeLong CI: a CI holding 0.5 means the data decide nothing
    baseline_auc: Estimate | None = None

    @property
    def slo_p99_ms(self) -> float | None:
        return self.study.slo_p99_ms if self.study else None

    @property
    def common_rate_qps(self) -> float | None:
        return self.study.common_rate_qps if self.study else None

    @property
    def keep_warm(self) -> bool | None:
        """Whether the servers kept themselves warm between requests; None without a load test."""
        return self.study.keep_warm if self.study else None
