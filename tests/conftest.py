"""Fixtures every kind of test uses. What tests share that is not a fixture lives in
`tests/helpers/`; the unit and integration directories have a conftest of their own."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    from appliance.models.tiny import init_tiny
    return init_tiny(tmp_path_factory.mktemp("model") / "tiny-llama", seed=0)
