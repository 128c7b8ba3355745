"""Fixtures for the storage tests.

Each backend test class defines ``make_storage`` (a factory of fresh, empty
locations that do not exist yet); ``storage`` is one such location.
``s3_endpoint`` is a moto S3 server on loopback, one per test module, and
``bucket`` a bucket on it.
"""

from __future__ import annotations

import pytest

from tests.storage.s3_helpers import make_bucket, moto_server


@pytest.fixture(scope="module")
def s3_endpoint():
    with moto_server() as endpoint:
        yield endpoint


@pytest.fixture(scope="module")
def bucket(s3_endpoint):
    return make_bucket(s3_endpoint)


@pytest.fixture
def storage(make_storage):
    return make_storage()
