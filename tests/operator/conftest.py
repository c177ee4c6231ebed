"""Fixtures for the operator tests (helpers live in hi_fixtures.py so tests can import them)."""
from __future__ import annotations

from typing import Any

import pytest
import yaml
from hi_fixtures import CRD_PATH


@pytest.fixture(scope="session")
def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_PATH.read_text())
