"""Knowledge distillation into a smaller model of the teacher's family, with a control run that shows what the teacher adds.

Loss per row, with student logit s, teacher logit t, label y, temperature T:
    alpha * BCE(sigmoid(s), y) + (1 - alpha) * soft(s, t)
    soft = T^2 * BCE(sigmoid(s / T), sigmoid(t / T))   (soft_target: probabilities; Hinton et al. 2015:
                                                        T^2 keeps the gradient scale independent of T)
         = (s - t)^2                                   (soft_target: logits; T unused)
With resampled_rows = r > 0, each batch also carries r x its size of re-sampled impressions: a batch row's
user and context with another batch row's item (every item-side feature of the schema swapped), which
have no label; the teacher scores them and the student learns only the soft term on them (weight 1 - alpha).
The labelled split bounds what the control can learn; the teacher can label as many impressions as wanted.
The control is the same student architecture, initialisation, data, budget and seed trained on the
labels alone (alpha = 1); `kd_gain_val_auc` = student AUC - control AUC on the validation split, with a
paired DeLong 95 % CI (`_lo`, `_hi`): both score the same rows, so their noise largely cancels.
With list_loss = listwise or margin_mse, each batch also carries lists_per_batch of the service's
candidate lists for training users, scored once by the teacher, and the loss adds list_weight x the list
term (reco/steps/served_lists.py): the student learns to order what it will serve, not only the logged rows.
The student is the teacher's class with the teacher's architecture settings and the shapes of
`distill.student` (the model's `student_config`, reco.models.protocol).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import torch
from omegaconf import MISSING
from torch import nn

from reco.config import typed
from reco.data.schema import Dataset, Schema, Split
from reco.measure import predict
from reco.models.protocol import ArchConfig, PlainScorer, RankingModel, TableSpec, count_params
from reco.runtime import Scorer
from reco.serve.config import RetrievalConfig
from reco.stats import auc_delta
from reco.steps.prune import row_counts
from reco.steps.registry import StepError, StepRun, child_variant, register, require_artifact
from reco.steps.served_lists import ListError, ListLoss, ListSettings, ServedLists, Unservable
from reco.train.loop import TrainConfig, step_budget, train
from reco.train.metrics import auc
from reco.variant import Variant


class SoftTarget(Enum):
    """What the student matches of the teacher (module docstring)."""

    probabilities = "probabilities"
    logits = "logits"


class TableSource(Enum):
    """Where the student's embedding tables come from."""

    schema = "schema"  # full cardinalities of the dataset's schema
    teacher = "teacher"  # the teacher's (possibly pruned) rows and id maps


@dataclass
class StudentConfig:
    embedding_dim: int = MISSING
    bottom: list[int] = MISSING  # last = embedding_dim (derived in the YAML; DLRM's dot interaction needs it)
    top: list[int] = MISSING
    tables: TableSource = MISSING
    min_count: int = MISSING  # rows of ids seen fewer times in train map to row 0 (0: keep every row)
    min_rows: int = MISSING  # only tables with at least this many rows are thinned by min_count
    # min_count of the user table alone (None: min_count): fewer, better-seen user rows for a wider student
    user_min_count: int | None = MISSING


@dataclass
class DistillConfig:
    """conf/step/distill.yaml (override as distill.<key>, or per variant in the variant graph)."""

    student: StudentConfig = field(default_factory=StudentConfig)
    alpha: float = MISSING  # weight of the hard-label loss; 1 = no teacher
    temperature: float = MISSING
    soft_target: SoftTarget = MISSING
    resampled_rows: float = MISSING  # unlabelled re-sampled impressions per labelled row (0: none)
    epochs: int = MISSING
    rows_per_epoch: int | None = MISSING  # None: the whole train split per epoch
    cache_teacher_logits: bool = MISSING  # each train row's teacher logit computed once, reused later
    control: bool = MISSING  # also train the student without the teacher
    lr: float | None = MISSING  # None: trainer.lr (a small student often wants a larger step)
    list_loss: ListLoss = MISSING  # none | listwise | margin_mse on served candidate lists
    list_users: int = MISSING  # training users whose served lists are distilled
    list_size: int = MISSING  # candidates per list (drawn once from the user's served candidates)
    lists_per_batch: int = MISSING  # lists beside each batch of logged rows
    list_weight: float = MISSING  # weight of the list term
    list_temperature: float = MISSING  # listwise only: softmax temperature
    n_candidates: int = MISSING  # the candidate pool the lists are drawn from (a fixed 500 in conf)
    # serve.retrieval (a RetrievalConfig's keys; untyped here only because a structured field cannot take
    # the YAML's interpolation of another section when Hydra composes)
    retrieval: Any = MISSING

    def check(self, where: str = "") -> None:
        if not 0 <= self.alpha <= 1:
            raise StepError(f"distill: distill.alpha must be in [0, 1], got {self.alpha}")
        if self.temperature <= 0:
            raise StepError(f"distill: distill.temperature must be > 0, got {self.temperature}")
        if self.resampled_rows < 0:
            raise StepError(f"distill: distill.resampled_rows must be >= 0, got {self.resampled_rows}")
        if self.resampled_rows > 0 and self.alpha >= 1:
            raise StepError(
                "distill: distill.resampled_rows > 0 needs alpha < 1 (the re-sampled rows carry only the "
                f"teacher's soft target, weighted 1 - alpha), got alpha {self.alpha}"
            )
        if not self.student.bottom:
            raise StepError("distill: distill.student.bottom must list at least one layer, got []")
        if self.student.user_min_count is not None and self.student.user_min_count < 0:
            raise StepError(
                f"distill: distill.student.user_min_count must be >= 0 or null (null: distill.student."
                f"min_count), got {self.student.user_min_count}"
            )
        self.check_lists()

    def check_lists(self) -> None:
        if self.list_loss is ListLoss.none:
            return
        for key in ("list_users", "list_size", "lists_per_batch"):
            if getattr(self, key) < 1:
                raise StepError(
                    f"distill: distill.{key} must be >= 1 with distill.list_loss="
                    f"{self.list_loss.value}, got {getattr(self, key)}"
                )
        if self.list_size < 2:
            raise StepError(
                f"distill: distill.list_size must be >= 2 (a list orders items), got {self.list_size}"
            )
        if self.list_size > self.n_candidates:
            raise StepError(
                f"distill: distill.list_size={self.list_size} is larger than the candidates the service "
                f"retrieves (distill.n_candidates={self.n_candidates})"
            )
        if self.list_weight <= 0 or self.list_temperature <= 0:
            raise StepError(
                f"distill: distill.list_weight and distill.list_temperature must be > 0, got "
                f"{self.list_weight} and {self.list_temperature}"
            )
        if self.alpha >= 1:
            raise StepError("distill: distill.list_loss needs the teacher: alpha < 1, got alpha 1")

    def lists(self) -> ListSettings:
        retrieval = typed(self.retrieval, RetrievalConfig, "distill.retrieval")
        return ListSettings(self.list_users, self.list_size, self.n_candidates, retrieval)


@register("distill", DistillConfig, trains=True)
def run(parent: Variant | None, data: Dataset, dc: DistillConfig, ctx: StepRun) -> Variant:
    """Train a smaller student on labels + the parent's soft targets, and a no-teacher control.

    Returns:
        The student's torch variant (size_ratio, teacher_auc, control_auc, kd_gain_auc in its metrics).
    """
    assert parent is not None
    dc.check()
    trainer, name = ctx.trainer, ctx.name
    if parent.backend == "onnxruntime":
        raise StepError(
            f"distill: parent variant {parent.name!r} has backend onnxruntime; the teacher must be a torch "
            f"model (distill before accelerate)"
        )
    require_artifact(parent, "torch", "distill")
    teacher = parent.load_torch()
    for p in teacher.parameters():
        p.requires_grad_(False)
    student, loss = train_student(
        teacher, data, dc, trainer, name, what=f"teacher {parent.name!r}, model {parent.model_target}"
    )
    n_t, n_s = count_params(teacher), count_params(student)
    # Validation split only: the test split is read once per variant, by the pipeline, for the report.
    labels = data.val.labels.numpy()
    student_val = predict(torch_scorer(student), data.val)

    v = child_variant(parent, data, dc, ctx, "distill", "torch")
    v.save_torch(student)
    v.metrics.update(
        teacher_val_auc=auc(labels, predict(torch_scorer(teacher), data.val)),
        student_val_auc=auc(labels, student_val),
        teacher_params=float(n_t),
        size_ratio=n_t / n_s,
        teacher_rows_scored=float(loss.rows_scored),
        served_lists=float(loss.lists is not None),  # 0: list_loss had no lists (data not servable)
    )
    if dc.control:
        control = train_control(teacher, data, dc, trainer, name)
        torch.save(control.state_dict(), v.path / "control.pt")
        v.add_artifact("control_torch", "control.pt")  # same model_config as the student
        control_val = predict(torch_scorer(control), data.val)
        gain, _ = auc_delta(labels, control_val, student_val)  # paired: same rows, DeLong CI
        v.metrics.update(
            control_val_auc=auc(labels, control_val),
            kd_gain_val_auc=gain.value,
            kd_gain_val_auc_lo=gain.lo,
            kd_gain_val_auc_hi=gain.hi,
        )
    v.metrics["size_mb_ratio"] = parent.size_mb / v.size_mb if parent.size_mb else float("nan")
    v.save()
    return v


def student_budget(dc: DistillConfig, trainer: TrainConfig) -> TrainConfig:
    """The trainer settings with the distillation's epochs, rows and rate (reco.train.loop.step_budget)."""
    return step_budget(
        trainer, epochs=dc.epochs, max_rows_per_epoch=dc.rows_per_epoch, lr=dc.lr or trainer.lr
    )


def new_student(
    teacher: RankingModel, data: Dataset, dc: DistillConfig, seed: int, what: str
) -> RankingModel:
    """The untrained student of `dc.student` (seeded: the student and its control start identical)."""
    s_cfg, maps = student_config(dc.student, teacher, data)
    student = build_student(teacher, s_cfg, maps, seed)
    n_t, n_s = count_params(teacher), count_params(student)
    if n_s >= n_t:
        raise StepError(
            f"distill: distill.student has {n_s} params, not fewer than the teacher's {n_t} "
            f"({what}); shrink distill.student.embedding_dim, "
            f"distill.student.bottom or distill.student.top"
        )
    return student


def train_student(
    teacher: RankingModel, data: Dataset, dc: DistillConfig, trainer: TrainConfig, name: str, what: str
) -> tuple[RankingModel, KDLoss]:
    """The student trained on labels, the teacher's logits and (list_loss) its served lists."""
    student = new_student(teacher, data, dc, trainer.seed, what)
    lists = None
    if dc.list_loss is not ListLoss.none:
        try:
            lists = ServedLists(teacher, data, dc.lists(), trainer.seed)
        except Unservable as e:
            # the default list loss meets data no service can rank (e.g. Criteo: no user or item key);
            # said on the terminal and in the variant's `served_lists` metric (0), not an error
            print(
                f"distill[{name}]: {e}; distill.list_loss={dc.list_loss.value} has no lists to distil "
                f"here, so the student is trained pointwise",
                flush=True,
            )
        except ListError as e:
            raise StepError(f"distill: {e}") from e
    loss = KDLoss(
        teacher, data.train, dc, student=student, schema=data.schema, seed=trainer.seed, lists=lists
    )
    train(student, data, student_budget(dc, trainer), loss_fn=loss, desc=f"distill[{name}] student")
    return student, loss


def train_control(
    teacher: RankingModel, data: Dataset, dc: DistillConfig, trainer: TrainConfig, name: str
) -> RankingModel:
    """The same student, initialisation, data, budget and seed on the labels alone."""
    control = new_student(teacher, data, dc, trainer.seed, "control")
    train(control, data, student_budget(dc, trainer), desc=f"distill[{name}] control")
    return control


class KDLoss:
    """loss_fn for reco.train.loop.train: (student logits [B], batch, train-row indices [B]) -> scalar."""

    def __init__(
        self,
        teacher: RankingModel,
        train_split: Split,
        dc: DistillConfig,
        *,
        student: RankingModel,
        schema: Schema,
        seed: int,
        lists: ServedLists | None = None,
    ):
        self.teacher, self.student, self.alpha, self.t = teacher.eval(), student, dc.alpha, dc.temperature
        self.lists, self.dc = lists, dc
        self.soft_target, self.resampled = dc.soft_target, dc.resampled_rows
        # NaN = not scored yet; filled lazily, so a row budget smaller than the split costs no more
        # teacher forwards than computing them on the fly.
        self.cache = torch.full((len(train_split),), float("nan")) if dc.cache_teacher_logits else None
        self.rows_scored = 0
        self.item_dense = [i for i, f in enumerate(schema.dense) if f.side == "item"]
        self.item_sparse = [i for i, f in enumerate(schema.sparse) if f.side == "item"]
        if self.resampled > 0 and not self.item_sparse:
            raise StepError(
                "distill: distill.resampled_rows > 0 swaps the item side between rows, but the schema has no "
                "item-side sparse feature (side: item)"
            )
        self.gen = torch.Generator().manual_seed(seed)

    @torch.no_grad()
    def teacher_logits(self, part: Split, rows: torch.Tensor | None = None) -> torch.Tensor:
        if self.cache is None or rows is None:
            self.rows_scored += len(part)
            return self.teacher.forward_plain(part.dense, part.ids, part.mask())
        todo = torch.isnan(self.cache[rows])
        if todo.any():
            sub = part.take(todo)
            self.cache[rows[todo]] = self.teacher.forward_plain(sub.dense, sub.ids, sub.mask())
            self.rows_scored += int(todo.sum())
        return self.cache[rows]

    def soft(self, s: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if self.soft_target is SoftTarget.logits:
            return nn.functional.mse_loss(s, t)
        return self.t**2 * nn.functional.binary_cross_entropy_with_logits(
            s / self.t, torch.sigmoid(t / self.t)
        )

    def resample(self, part: Split) -> Split:
        """round(resampled x len(part)) unlabelled impressions: row i's user and context, row j's item."""
        n = round(self.resampled * len(part))
        i = torch.randint(len(part), (n,), generator=self.gen)
        j = torch.randint(len(part), (n,), generator=self.gen)
        out = part.take(i)
        out.dense[:, self.item_dense] = part.dense[j][:, self.item_dense]
        out.ids[:, self.item_sparse] = part.ids[j][:, self.item_sparse]
        out.lengths[:, self.item_sparse] = part.lengths[j][:, self.item_sparse]
        return out

    def __call__(self, logits: torch.Tensor, part: Split, rows: torch.Tensor) -> torch.Tensor:
        hard = nn.functional.binary_cross_entropy_with_logits(logits, part.labels)
        if self.alpha >= 1:
            return hard
        loss = self.alpha * hard + (1 - self.alpha) * self.soft(logits, self.teacher_logits(part, rows))
        if self.resampled > 0:
            extra = self.resample(part)
            s = self.student(extra.dense, self.student.kjt(extra.ids, extra.lengths)).float()
            loss = loss + (1 - self.alpha) * self.soft(s, self.teacher_logits(extra))
        if self.lists is not None:
            dc = self.dc
            term = self.lists.loss(self.student, dc.list_loss, dc.lists_per_batch, dc.list_temperature)
            loss = loss + dc.list_weight * term
        return loss


def torch_scorer(model: RankingModel) -> Scorer:
    scorer = PlainScorer(model).eval()

    @torch.inference_mode()
    def score(dense, ids, mask):
        return scorer(torch.from_numpy(dense), torch.from_numpy(ids), torch.from_numpy(mask)).numpy()

    return score


# Student architecture ---------------------------------------------------------------------------
def student_config(
    sc: StudentConfig, teacher: RankingModel, data: Dataset
) -> tuple[ArchConfig, dict[str, torch.Tensor]]:
    """The student's Config (the teacher's class's) and its id maps ({feature: [cardinality] int32 id -> row}).

    Tables come from the schema (full cardinality) or the teacher (its pruned rows and maps); then
    ids whose row is seen < min_count (the user table: user_min_count, if set) times in train are folded
    into row 0.
    """
    if sc.tables is TableSource.teacher:
        tables = [TableSpec(t.feature, t.num_rows, t.max_len, t.cardinality) for t in teacher.cfg.tables]
        remapped = list(teacher.cfg.remapped)
    else:
        tables = [TableSpec(f.name, f.cardinality, f.max_len) for f in data.schema.sparse]
        remapped = []
    maps: dict[str, torch.Tensor] = {}
    for i, t in enumerate(tables):
        m = teacher.id_map(t.feature) if t.feature in remapped else None
        base = m.long() if m is not None else torch.arange(t.cardinality)
        if (min_count := table_min_count(sc, t.feature, data.schema)) > 0 and t.num_rows >= sc.min_rows:
            keep = row_counts(data.train, i, base, t.num_rows) >= min_count
            keep[0] = True  # the unknown / pruned-id row
            new_row = torch.where(keep, torch.cumsum(keep.long(), 0) - 1, 0)
            base, t.num_rows = new_row[base], int(keep.sum())
            if t.feature not in remapped:
                remapped.append(t.feature)
        if t.feature in remapped:
            maps[t.feature] = base.to(torch.int32)
    try:
        cfg = teacher.student_config(tables, remapped, sc.embedding_dim, list(sc.bottom), list(sc.top))
    except ValueError as e:
        raise StepError(
            f"distill: distill.student cannot build a {type(teacher).__name__} student "
            f"(embedding_dim {sc.embedding_dim}, bottom {list(sc.bottom)}, top {list(sc.top)}): {e}"
        ) from e
    return cfg, maps


def table_min_count(sc: StudentConfig, feature: str, schema: Schema) -> int:
    """min_count, or user_min_count for the user table when it is set."""
    if feature == schema.user_key and sc.user_min_count is not None:
        return sc.user_min_count
    return sc.min_count


def build_student(
    teacher: RankingModel, cfg: ArchConfig, maps: dict[str, torch.Tensor], seed: int
) -> RankingModel:
    """Same seed -> same initial weights, so the student and the control start identical."""
    torch.manual_seed(seed)
    model = type(teacher)(type(cfg)(**cfg.to_dict()))
    for f, m in maps.items():
        getattr(model, f"idmap_{f}").copy_(m)
    return model
