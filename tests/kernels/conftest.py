"""Kernels test setup: tests marked ``triton_interpret`` run the Triton kernel on CPU under TRITON_INTERPRET=1.

Triton reads TRITON_INTERPRET when it defines a kernel, its own standard library included, so the variable
must be set before triton is first imported; by the time these tests are collected, transformers usually
has imported it. So unless the session started with the variable set, the marked tests are skipped here and
``test_logprobs.py::test_triton_cases_pass_under_the_interpreter`` runs them in a fresh pytest process that
sets it first. The rest of the suite never sees the variable.
"""

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def pytest_configure(config):
    config.addinivalue_line("markers", "triton_interpret: runs the Triton kernel under TRITON_INTERPRET=1 on CPU")


def pytest_collection_modifyitems(config, items):
    if INTERPRET:
        return
    skip = pytest.mark.skip(
        reason="run in a TRITON_INTERPRET=1 process by test_triton_cases_pass_under_the_interpreter"
    )
    for item in items:
        if "triton_interpret" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """One intra-op thread: these tensors are tiny, and on a shared host idle OpenMP threads only spin."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
