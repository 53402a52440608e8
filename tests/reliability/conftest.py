"""Shared fixtures of the reliability tests (the live-server helpers of tests/server)."""

from tests.server.conftest import tiny_llama  # noqa: F401 - re-exported fixture
