"""The MLflow tracker on a real sqlite store."""

from __future__ import annotations

from mlflow import MlflowClient

from reco.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, Tracker


def test_experiments_open_in_the_model_training_view(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    Tracker(uri, "fresh", artifact_root=str(tmp_path / "a"))
    old = client.create_experiment("made_before", artifact_location=(tmp_path / "b").as_uri())
    assert EXPERIMENT_KIND_TAG not in client.get_experiment(old).tags
    Tracker(uri, "made_before")  # an experiment from before the tag existed is tagged on next use
    for name in ("fresh", "made_before"):
        assert client.get_experiment_by_name(name).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
