import pytest

from reco.data.synthetic import SyntheticConfig, generate


@pytest.fixture(scope="session")
def tiny_data():
    """~1 s: 20k rows, same feature layout as the default synthetic e-commerce data."""
    return generate(
        SyntheticConfig(
            n_rows=20_000,
            n_users=2_000,
            n_items=1_000,
            n_categories=50,
            n_brands=100,
            latent_dim=8,
            max_recent=4,
            seed=0,
        )
    )
