"""Fixtures shared by the test modules (shared helpers that are not fixtures live in
``shardwise.testing``, importable by rank processes too)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """One intra-op thread while the test runs. The models of the tests are tiny: a second
    thread only adds barrier waits, which become stalls of tens of milliseconds per op (and
    seconds per test) when other processes share the cores. Use it per module with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
