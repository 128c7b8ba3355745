"""Fixtures for the storage conformance suite.

Each backend test class defines ``make_storage`` (a factory of fresh, empty
locations that do not exist yet); ``storage`` is one such location.
"""

from __future__ import annotations

import pytest


@pytest.fixture
def storage(make_storage):
    return make_storage()
