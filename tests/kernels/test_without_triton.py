"""triton is a Linux-only dependency (pyproject.toml): without it ``impl="auto"`` runs the chunked path even for
CUDA tensors, and ``impl="triton"`` fails with an error that names the package and the config key's other choices.

Absence is simulated the way Python itself marks a module as unimportable: ``sys.modules["triton"] = None`` makes
``import triton`` raise ImportError and ``importlib.util.find_spec("triton")`` return None."""

import json
import sys

import pytest
import torch

from grpoflow.kernels import logprobs
from grpoflow.kernels.auto_table import ENV
from grpoflow.kernels.logprobs import route, token_logprobs


@pytest.fixture
def no_triton(monkeypatch):
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.delitem(sys.modules, "grpoflow.kernels.triton_logprobs", raising=False)
    logprobs.triton_available.cache_clear()
    yield
    logprobs.triton_available.cache_clear()


def test_auto_routes_cuda_to_the_table_with_triton_and_to_chunked_without(tmp_path, monkeypatch):
    """With triton, a CUDA call takes the table's choice (here a table that says triton); without it, chunked."""
    args = (2048, 896, 151936, torch.bfloat16, "frozen", "fwd_bwd")
    entry = {"N": 2048, "D": 896, "V": 151936, "dtype": "bfloat16", "fwd": "triton", "fwd_bwd": "triton"}
    path = tmp_path / "auto_table.json"
    path.write_text(json.dumps({"source": "test", "entries": [entry]}))
    monkeypatch.setenv(ENV, str(path))
    assert route(True, True, *args) == "triton"
    assert route(True, False, *args) == "chunked"
    assert route(False, True, *args) == "chunked"


def test_triton_available_follows_the_import(no_triton):
    assert logprobs.triton_available() is False


def test_triton_impl_without_triton_names_the_package_and_the_alternatives(no_triton):
    h, w, y = torch.randn(4, 8), torch.randn(16, 8), torch.randint(0, 16, (4,))
    with pytest.raises(ImportError, match="needs the triton package.*impl='chunked' or 'auto'"):
        token_logprobs(h, w, y, impl="triton")
    logp, _ = token_logprobs(h, w, y, impl="auto")  # CPU: chunked, triton or not
    assert logp.shape == (4,)


def test_the_trainer_check_refuses_triton_when_it_is_not_installed(no_triton):
    from grpoflow.tasks.grpo.batch import check_logprob_impl

    with pytest.raises(ValueError, match="grpo.logprob_impl=triton needs the triton package"):
        check_logprob_impl("triton", torch.device("cuda", 0))
    check_logprob_impl("auto", torch.device("cuda", 0))
