"""impl="auto" picks per shape from a table (kernels/auto_table.py): the default takes the chunked path on CUDA, a
measured table named by GRPOFLOW_AUTO_TABLE changes the choice per shape and pass, a bad table file is an error
naming the file, and CPU tensors never read the table.

No GPU here: the CUDA side of the dispatch (kernels.logprobs.auto_impl) is driven with stand-ins that answer
is_cuda, shape and requires_grad as a CUDA tensor would; which kernel then runs is the GPU check's business."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

from grpoflow.kernels.auto_table import DEFAULT_TABLE, ENV, AutoTableError, active_table, choose, load_table
from grpoflow.kernels.logprobs import auto_impl, token_logprobs, token_logprobs_reference

V = 151936


def cuda_like(n: int, d: int, v: int, trainable: bool = False, grad: bool = True):
    """(hidden, weight) stand-ins for CUDA tensors of hidden [n, d] and weight [v, d]."""
    h = SimpleNamespace(is_cuda=True, shape=(n, d), requires_grad=grad)
    w = SimpleNamespace(is_cuda=True, shape=(v, d), requires_grad=trainable)
    return h, w


def write(tmp_path, table) -> str:
    path = tmp_path / "auto_table.json"
    path.write_text(table if isinstance(table, str) else json.dumps(table))
    return str(path)


def measured() -> dict:
    """A table as the GPU check writes it: chunked wins the small round's training pass, triton the large one;
    the no-grad forward the other way round."""
    row = {"V": V, "dtype": "bfloat16", "head": "frozen"}
    return {
        "source": "test",
        "device": "H200",
        "entries": [
            {**row, "N": 2048, "D": 896, "fwd": "triton", "fwd_bwd": "chunked"},
            {**row, "N": 16384, "D": 4096, "fwd": "chunked", "fwd_bwd": "triton"},
        ],
    }


def test_the_default_table_takes_the_chunked_path_on_cuda_for_every_shape(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert active_table() is DEFAULT_TABLE
    for n, d, v in ((1, 64, 300), (2048, 896, V), (16384, 4096, V), (100000, 8192, 262144)):
        for trainable in (False, True):
            with torch.no_grad():
                assert auto_impl(*cuda_like(n, d, v, trainable), torch.bfloat16) == "chunked"
            assert auto_impl(*cuda_like(n, d, v, trainable), torch.float32) == "chunked"


def test_a_measured_table_changes_the_choice_per_shape_and_pass(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, write(tmp_path, measured()))
    # training pass (grad enabled, hidden needs a gradient): nearest measured shape's fwd_bwd choice
    assert auto_impl(*cuda_like(2048, 896, V), torch.bfloat16) == "chunked"
    assert auto_impl(*cuda_like(3000, 1024, V), torch.bfloat16) == "chunked"  # nearer the small shape
    assert auto_impl(*cuda_like(16384, 4096, V), torch.bfloat16) == "triton"
    assert auto_impl(*cuda_like(12000, 3584, V), torch.bfloat16) == "triton"  # nearer the large one
    # no-grad forward (old and reference log-probs): the fwd column
    with torch.no_grad():
        assert auto_impl(*cuda_like(2048, 896, V), torch.bfloat16) == "triton"
        assert auto_impl(*cuda_like(16384, 4096, V), torch.bfloat16) == "chunked"
    assert auto_impl(*cuda_like(16384, 4096, V, grad=False), torch.bfloat16) == "chunked"
    # a dtype or head the table has no entry for falls back to the nearest entry of any
    assert auto_impl(*cuda_like(2048, 896, V, trainable=True), torch.float32) == "chunked"


def test_the_table_file_is_reread_when_it_changes(tmp_path, monkeypatch):
    path = write(tmp_path, measured())
    monkeypatch.setenv(ENV, path)
    assert auto_impl(*cuda_like(2048, 896, V), torch.bfloat16) == "chunked"
    table = measured()
    table["entries"][0]["fwd_bwd"] = "triton"
    write(tmp_path, table)
    os.utime(path, (1, 1))  # a new modification time even within the file system's resolution
    assert auto_impl(*cuda_like(2048, 896, V), torch.bfloat16) == "triton"


@pytest.mark.parametrize(
    "content, says",
    [
        ("{not json", "not a readable JSON table"),
        ({"entries": []}, "non-empty list 'entries'"),
        ({"entries": [{"N": 2048, "D": 896, "V": V, "dtype": "bfloat16", "fwd": "triton"}]}, "entries[0].fwd_bwd"),
        ({"entries": [{"N": 0, "D": 896, "V": V, "dtype": "bfloat16", "fwd": "x", "fwd_bwd": "x"}]}, "entries[0].N"),
        (
            {"entries": [{"N": 1, "D": 1, "V": 1, "dtype": "bfloat16", "fwd": "triton", "fwd_bwd": "cublas"}]},
            "entries[0].fwd_bwd must be one of",
        ),
        ({"entries": [{"N": 1, "D": 1, "V": 1, "dtype": "bf16", "head": "lora", "fwd": "triton"}]}, "entries[0].head"),
    ],
)
def test_a_bad_table_file_is_an_error_naming_the_file(tmp_path, monkeypatch, content, says):
    path = write(tmp_path, content)
    monkeypatch.setenv(ENV, path)
    with pytest.raises(AutoTableError) as err:
        auto_impl(*cuda_like(2048, 896, V), torch.bfloat16)
    assert path in str(err.value) and says in str(err.value)


def test_a_missing_table_file_names_the_file_and_the_variable(tmp_path, monkeypatch):
    monkeypatch.setenv(ENV, str(tmp_path / "nowhere.json"))
    with pytest.raises(AutoTableError, match=r"nowhere\.json: no such file \(set by GRPOFLOW_AUTO_TABLE\)"):
        auto_impl(*cuda_like(2048, 896, V), torch.bfloat16)


def test_cpu_tensors_never_read_the_table(tmp_path, monkeypatch):
    """auto on CPU is the chunked path whatever the table says, even a broken one: the values match the reference."""
    monkeypatch.setenv(ENV, write(tmp_path, "{broken"))
    g = torch.Generator().manual_seed(0)
    h = torch.randn(16, 32, generator=g, requires_grad=True)
    w = torch.randn(50, 32, generator=g)
    y = torch.randint(0, 50, (16,), generator=g)
    assert auto_impl(h, w, torch.float32) == "chunked"
    logp, _ = token_logprobs(h, w, y)
    ref, _ = token_logprobs_reference(h, w, y)
    assert torch.allclose(logp, ref, atol=1e-5)


def test_choose_and_load_table_agree_with_the_file(tmp_path):
    table = load_table(write(tmp_path, measured()))
    assert choose(2048, 896, V, "bfloat16", "frozen", "fwd_bwd", table) == "chunked"
    assert choose(16384, 4096, V, "bfloat16", "frozen", "fwd", table) == "chunked"
    with pytest.raises(ValueError, match="mode='bwd'"):
        choose(1, 1, 1, "bfloat16", "frozen", "bwd", table)
