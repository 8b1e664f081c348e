"""Fixtures of the storage tests."""

import pytest


@pytest.fixture
def env(seaweedfs, monkeypatch):
    """The process environment a user sets: endpoint and credentials in the standard AWS variables."""
    for k, v in seaweedfs.env().items():
        monkeypatch.setenv(k, v)
    return seaweedfs
