"""Schema/batch conversion, the DLRM against TorchRec's own, metrics, variant artifacts, training."""

import dataclasses
import json
import pickle

import numpy as np
import pytest
import torch
from conftest import TINY, trainer_config
from sklearn.metrics import roc_auc_score
from torchrec.models.dlrm import DLRM as TorchRecDLRM

from reco.data.schema import Dataset, to_kjt
from reco.data.synthetic import generate
from reco.measure import evaluate
from reco.models.dlrm import DLRM, DLRMConfig, flops_per_candidate
from reco.runtime import load_scorer
from reco.train.loop import train
from reco.train.metrics import auc
from reco.variant import ArtifactError, Variant


def tiny_model(ds, seed=0):
    torch.manual_seed(seed)
    return DLRM(DLRMConfig.from_schema(ds.schema, 16, [32, 16], [64, 32])).eval()


def test_kjt_matches_padded_ids(tiny_data):
    part = tiny_data.test.take(slice(0, 7))
    kjt = to_kjt(part.ids, part.lengths, tiny_data.schema.sparse_names)
    for f, name in enumerate(tiny_data.schema.sparse_names):
        jt = kjt[name]
        assert jt.lengths().tolist() == part.lengths[:, f].tolist()
        expected = [part.ids[b, f, i].item() for b in range(7) for i in range(part.lengths[b, f])]
        assert jt.values().tolist() == expected


def test_synthetic_is_deterministic_and_learnable(tiny_data):
    again = generate(TINY)
    assert again.fingerprint == tiny_data.fingerprint
    s = tiny_data.schema
    for f, feat in enumerate(s.sparse):
        ids = tiny_data.train.ids[:, f, : feat.max_len]
        assert ids.min() >= 0 and ids.max() < feat.cardinality
    assert tiny_data.train.lengths[:, s.index("recent_categories")].max() > 1  # jagged input is real
    assert 0.15 < tiny_data.train.labels.mean() < 0.35
    oracle = auc(tiny_data.test.labels.numpy(), tiny_data.test.oracle.numpy())
    assert oracle > 0.7


def test_forward_plain_equals_kjt_forward_and_torchrec_dlrm(tiny_data):
    m = tiny_model(tiny_data)
    part = tiny_data.test.take(slice(0, 64))
    with torch.no_grad():
        a = m(part.dense, m.kjt(part.ids, part.lengths))
        b = m.forward_plain(part.dense, part.ids, part.mask())
        ref = TorchRecDLRM(
            embedding_bag_collection=m.ebc,
            dense_in_features=len(tiny_data.schema.dense),
            dense_arch_layer_sizes=m.cfg.bottom,
            over_arch_layer_sizes=[*m.cfg.top, 1],
        )
        ours = [x for x in [*m.bottom, *m.top] if isinstance(x, torch.nn.Linear)]
        theirs = [x for x in ref.modules() if isinstance(x, torch.nn.Linear)]
        assert len(ours) == len(theirs)
        for o, t in zip(ours, theirs, strict=True):
            t.weight.copy_(o.weight)
            t.bias.copy_(o.bias)
        c = ref(part.dense, m.kjt(part.ids, part.lengths)).squeeze(1)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a, c, atol=1e-5, rtol=1e-5)


def test_auc_matches_sklearn_with_ties():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, 5000)
    s = np.round(rng.random(5000) + 0.3 * y, 2)  # many ties
    assert auc(y, s) == pytest.approx(roc_auc_score(y, s), abs=1e-12)
    assert auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8])) == pytest.approx(0.75)
    with pytest.raises(ValueError, match="both positive and negative"):
        auc(np.ones(3), np.ones(3))


def test_flops_counts_mlps_and_interaction(tiny_data):
    cfg = tiny_model(tiny_data).cfg
    n = len(cfg.tables) + 1
    mlp = 2 * (3 * 32 + 32 * 16) + 2 * ((16 + n * (n - 1) // 2) * 64 + 64 * 32 + 32 * 1)
    pooling = sum(t.max_len for t in cfg.tables) * 16
    assert flops_per_candidate(cfg) == mlp + 2 * n * n * 16 + pooling


def test_dataset_roundtrip_weights_only(tmp_path, tiny_data):
    tiny_data.save(str(tmp_path / "d.pt"))
    back = Dataset.load(str(tmp_path / "d.pt"))
    assert back.schema == tiny_data.schema
    assert back.compute_fingerprint() == tiny_data.fingerprint
    assert torch.equal(back.test.oracle, tiny_data.test.oracle)


def test_a_dataset_file_reads_as_numpy_without_torch_the_same(tmp_path, tiny_data):
    """What a server reads (Dataset.load_arrays, reco.data.torch_file) equals what torch.load reads, views
    and expanded (stride-0) tensors included; anything but tensors and plain containers is refused."""
    expanded = dataclasses.replace(
        tiny_data,
        train=dataclasses.replace(
            tiny_data.train, lengths=tiny_data.train.lengths[:1].expand_as(tiny_data.train.lengths)
        ),
        val=tiny_data.train.take(slice(5, 50)),  # a view into train's storage at an offset
    )
    expanded.save(str(tmp_path / "d.pt"))
    want, got = Dataset.load(str(tmp_path / "d.pt")), Dataset.load_arrays(str(tmp_path / "d.pt"))
    assert (got.schema, got.fingerprint, got.name) == (want.schema, want.fingerprint, want.name)
    for name, split in want.splits().items():
        for field, t in vars(split).items():
            if t is None:
                assert getattr(got.splits()[name], field) is None
                continue
            a = getattr(got.splits()[name], field)
            assert isinstance(a, np.ndarray) and a.dtype == t.numpy().dtype, (name, field)
            np.testing.assert_array_equal(a, t.numpy(), err_msg=f"{name}.{field}")
    torch.save({"x": torch.zeros(2), "f": np.random.default_rng}, tmp_path / "code.pt")
    with pytest.raises(pickle.UnpicklingError, match="code.pt"):
        Dataset.load_arrays(str(tmp_path / "code.pt"))
    # a tampered view reaching past its storage is refused (as_strided would read whatever lies there)
    from reco.data.torch_file import _rebuild_tensor_v2

    storage = np.arange(4, dtype=np.float32)
    np.testing.assert_array_equal(_rebuild_tensor_v2(storage, 1, (3,), (1,)), [1, 2, 3])
    for offset, size, stride in ((2, (3,), (1,)), (0, (2, 2), (3, 1)), (-1, (1,), (1,)), (0, (2,), (-1,))):
        with pytest.raises(pickle.UnpicklingError, match="reaches past its storage of 4"):
            _rebuild_tensor_v2(storage, offset, size, stride)


def test_variant_roundtrip_and_tamper_detection(tmp_path, tiny_data):
    m = tiny_model(tiny_data)
    v = Variant("b", "train", None, "torch", {}, dir=str(tmp_path / "b"))
    v.save_torch(m)
    v.save()
    back = Variant.load(tmp_path / "b")
    assert back.params == v.params and back.sha256["torch"] == v.sha256["torch"]
    part = tiny_data.test.take(slice(0, 32))
    args = (part.dense.numpy(), part.ids.numpy(), part.mask().numpy())
    with torch.no_grad():
        expected = torch.sigmoid(m.forward_plain(part.dense, part.ids, part.mask())).numpy()
    np.testing.assert_allclose(load_scorer(back)(*args), expected, atol=1e-6)
    with open(tmp_path / "b" / "model.pt", "ab") as f:
        f.write(b"x")
    with pytest.raises(ArtifactError, match="SHA-256 mismatch"):
        Variant.load(tmp_path / "b").load_torch()
    meta = json.loads((tmp_path / "b" / "variant.json").read_text())
    assert meta["name"] == "b"
    with pytest.raises(ArtifactError, match="no variant.json"):
        Variant.load(tmp_path / "missing")


def test_training_learns_and_early_stopping_restores_best(tmp_path, tiny_data):
    m = tiny_model(tiny_data)
    cfg = trainer_config(
        epochs=3, batch_size=512, lr=3e-3, patience=0, progress=False, checkpoint_dir=str(tmp_path)
    )
    seen = []
    res = train(m, tiny_data, cfg, on_epoch=lambda e, row: seen.append(row))
    assert len(seen) == len(res.history) >= 1
    assert res.best_val_auc == max(r["val_auc"] for r in res.history)
    assert (tmp_path / "best.pt").exists()
    v = Variant("t", "train", None, "torch", {}, dir=str(tmp_path / "v"))
    v.save_torch(m)
    metrics = evaluate(load_scorer(v), tiny_data.test)
    assert metrics["auc"] > 0.6, metrics
    assert metrics["oracle_auc"] > metrics["auc"] - 0.02


def test_an_epoch_that_falls_early_stops_training_at_its_check(tiny_data):
    """trainer.stop_check_fraction: an epoch that ends training unless it improves is validated after that
    fraction of its rows too. Its loss turned to gradient ascent after epoch 1, epoch 2 falls at once:
    training stops at the check and keeps epoch 1. A check that lets the epoch go on changes nothing: the
    same optimizer steps, the same curve and weights as without it."""
    from reco.train.loop import check_rows, epoch_rows

    cfg = trainer_config(epochs=3, batch_size=512, lr=3e-3, patience=0, progress=False, checkpoint_dir=None)
    cfg = dataclasses.replace(cfg, stop_check_fraction=0.3, stop_check_margin=0.005)
    n = epoch_rows(cfg, tiny_data)
    k = check_rows(cfg, n)
    assert k % 512 == 0 and 0.3 * n <= k < n
    calls = []

    def ascent_after_epoch_1(logits, part, rows):
        calls.append(len(rows))
        loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, part.labels)
        return loss if sum(calls) <= n else -100 * loss

    m = tiny_model(tiny_data)
    res = train(m, tiny_data, cfg, loss_fn=ascent_after_epoch_1)
    assert sum(calls) == n + k  # epoch 1, then epoch 2 up to its check
    assert [r.get("epoch_fraction") for r in res.history] == [None, k / n]
    assert res.best_epoch == 0 and res.history[1]["val_auc"] < res.best_val_auc - 0.005

    def trained(fraction: float | None) -> tuple[list, dict]:
        m = tiny_model(tiny_data)
        c = dataclasses.replace(cfg, stop_check_fraction=fraction, stop_check_margin=1.0)  # never stops
        return train(m, tiny_data, c).history, m.state_dict()

    (plain, w0), (checked, w1) = trained(None), trained(0.3)
    assert [r["val_auc"] for r in plain] == [r["val_auc"] for r in checked]
    assert [r["train_loss"] for r in plain] == pytest.approx([r["train_loss"] for r in checked], rel=1e-9)
    assert all(torch.equal(w0[key], w1[key]) for key in w0)


def test_artifact_names_stay_inside_the_variant_directory(tmp_path, tiny_data):
    """A variant.json naming '../x' or '/etc/x' as an artifact is refused, not followed."""
    model = DLRM(DLRMConfig.from_schema(tiny_data.schema, embedding_dim=8, bottom=[8], top=[8]))
    v = Variant("t", "train", None, "torch", {}, dir=str(tmp_path / "v"))
    v.save_torch(model)
    v.save()
    (tmp_path / "outside.pt").write_bytes((tmp_path / "v" / "model.pt").read_bytes())
    for bad in ("../outside.pt", str(tmp_path / "outside.pt"), ".."):
        rec = json.loads((tmp_path / "v" / "variant.json").read_text())
        rec["artifacts"]["torch"] = bad
        (tmp_path / "v" / "variant.json").write_text(json.dumps(rec))
        with pytest.raises(ArtifactError, match="plain file name inside the variant directory"):
            Variant.load(tmp_path / "v").load_torch()


def test_a_damaged_variant_record_is_an_artifact_error(tmp_path):
    """A kill mid-write used to leave an empty variant.json and a bare JSONDecodeError; now the pipeline
    gets an ArtifactError naming the file (and rebuilds the variant)."""
    (tmp_path / "v").mkdir()
    (tmp_path / "v" / "variant.json").write_text("")
    with pytest.raises(ArtifactError, match=r"variant\.json: not a valid variant record"):
        Variant.load(tmp_path / "v")
