"""What the recipe runs share: one --work folder, so the tiny model, the task and its warm start are made once."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smoke_work(tmp_path_factory):
    return tmp_path_factory.mktemp("smoke-work")
