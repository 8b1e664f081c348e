"""Issue 25's kernel seams that run here without a GPU: the autocast dtype rule, the device context of every
Triton launch (a stand-in CUDA device and a recording context factory; the launch of the real kernels is
recorded under TRITON_INTERPRET=1), the split-vocabulary merge and grid sizing, the backward's row chunks,
and the chunked 16-bit path (impl "chunked" on CUDA) run on CPU tensors, every dtype against the float32
reference."""

from contextlib import contextmanager
from types import SimpleNamespace

import pytest
import torch

from grpoflow.kernels.chunked_dtype import ChunkedDtypeTokenLogProbs
from grpoflow.kernels.launch import device_context, launch
from grpoflow.kernels.logprobs import token_logprobs, token_logprobs_reference
from grpoflow.kernels.precision import active_autocast_dtype, kernel_dtype
from tests.kernels.test_logprobs import assert_matches_reference, make_inputs, run

# Tolerance per input dtype (max abs error against the float32 reference; logits of a few nats, D <= 80).
# 16-bit: log-probs from 16-bit operands with float32 accumulation (exact products): float32-level; gradients
# pass through G rounded to the dtype and come back in it.
TOL = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4, "grad_atol": 2e-5},
    torch.float16: {"atol": 2e-5, "rtol": 1e-4, "grad_atol": 5e-3},
    torch.bfloat16: {"atol": 2e-5, "rtol": 2e-2, "grad_atol": 4e-2},
}
DTYPES = list(TOL)


@pytest.mark.parametrize(
    "device_type, hidden, autocast, want",
    [
        ("cpu", torch.float32, None, None),  # the CPU path: float32 inside, inputs untouched
        ("cpu", torch.bfloat16, torch.bfloat16, None),  # CPU autocast changes nothing either
        ("meta", torch.bfloat16, None, None),  # nor on other devices: the CPU path's code, as before
        ("cuda", torch.float32, torch.bfloat16, torch.bfloat16),  # full fine-tuning: float32 RMSNorm out, bf16 autocast
        ("cuda", torch.float32, None, torch.float32),  # model.dtype float32, no autocast
        ("cuda", torch.bfloat16, None, torch.bfloat16),  # QLoRA: bf16 hidden, the float32 head is cast to bf16
        ("cuda", torch.float16, torch.bfloat16, torch.bfloat16),
    ],
)
def test_kernel_dtype_rule(device_type, hidden, autocast, want):
    assert kernel_dtype(device_type, hidden, autocast) == want


def test_active_autocast_dtype_reads_the_enabled_state():
    assert active_autocast_dtype("cpu") is None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert active_autocast_dtype("cpu") == torch.bfloat16
        assert active_autocast_dtype("cuda") is None  # enabled for the CPU only
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        assert active_autocast_dtype("cpu") is None
    assert active_autocast_dtype("meta") is None  # torch raises for device types without autocast


def test_cpu_autocast_leaves_the_chunked_cpu_path_as_it_was():
    """On CPU the rule casts nothing: the same bits with and without autocast as with the CPU path itself."""
    h, w, b, y, _ = make_inputs(30, 16, 70, bias=True)
    with torch.no_grad():
        want = token_logprobs(h, w, y, 0.9, b, compute_entropy=True, impl="chunked")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = token_logprobs(h, w, y, 0.9, b, compute_entropy=True)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class RecordingContext:
    """A context factory standing in for torch.cuda.device: records (event, device) in order."""

    def __init__(self):
        self.events = []

    def __call__(self, device):
        @contextmanager
        def ctx():
            self.events.append(("enter", device))
            yield
            self.events.append(("exit", device))

        return ctx()


class StandInKernel:
    """kernel[grid](*args, **meta), recording the launch in the same event list."""

    def __init__(self, events):
        self.events = events

    def __getitem__(self, grid):
        return lambda *args, **meta: self.events.append(("launch", grid, args, meta))


def test_a_launch_runs_inside_its_tensors_device_context():
    cuda1 = SimpleNamespace(type="cuda", index=1)  # a stand-in for torch.device("cuda:1")
    record = RecordingContext()
    launch(StandInKernel(record.events), (4, 2), cuda1, "x", context=record, BLOCK=8)
    assert record.events == [("enter", cuda1), ("launch", (4, 2), ("x",), {"BLOCK": 8}), ("exit", cuda1)]


def test_device_context_defaults_to_torch_cuda_device_and_is_null_on_cpu():
    record = RecordingContext()
    with device_context(torch.device("cpu"), record):
        pass
    assert record.events == []  # no CUDA context for CPU tensors (the interpreter)
    assert isinstance(device_context(torch.device("cuda", 1)), torch.cuda.device)
    assert device_context(torch.device("cuda", 1)).idx == 1


@pytest.mark.triton_interpret
@pytest.mark.parametrize("head_trainable", [False, True])
def test_every_kernel_launch_goes_through_the_device_context(monkeypatch, head_trainable):
    """The real launchers: each launch of forward and backward names the tensors' device."""
    from grpoflow.kernels import triton_logprobs

    seen = []

    def recording_launch(kernel, grid, device, *args, **meta):
        seen.append((kernel, device))
        return launch(kernel, grid, device, *args, **meta)

    monkeypatch.setattr(triton_logprobs, "launch", recording_launch)
    monkeypatch.setattr(triton_logprobs, "G_BUDGET_BYTES", 64 * 300 * 4)  # 64-row chunks: 2 at N=70
    h, w, b, y, up = make_inputs(70, 8, 300, bias=True, head_trainable=head_trainable)
    run("triton", h, w, b, y, 1.0, up)
    kernels = [k for k, _ in seen]
    grad_kernel = triton_logprobs._grad_logits_kernel
    assert kernels == [triton_logprobs._forward_kernel, grad_kernel, grad_kernel]
    assert all(d == h.device for _, d in seen)


SPLIT_CASES = [
    (2048, 151936, 132, (9, 16896)),  # H200, the small shape: 32 row blocks x 9 splits
    (16384, 151936, 132, (2, 76032)),  # 256 row blocks x 2
    (70, 300, 2, (2, 256)),  # the interpreter's 2 SMs
    (70, 300, 100, (3, 128)),  # capped at one tile per split
    (10**6, 300, 132, (1, 384)),  # enough row blocks: no split
]


@pytest.mark.parametrize("n, v, sms, want", SPLIT_CASES)
def test_vocab_splits_fill_the_sms_without_empty_splits(n, v, sms, want):
    from grpoflow.kernels.triton_logprobs import PROGRAMS_PER_SM, vocab_splits

    splits, v_split = vocab_splits(n, v, sms, block_n=64, block_v=128)
    assert (splits, v_split) == want
    assert v_split % 128 == 0 and (splits - 1) * v_split < v <= splits * v_split  # every split non-empty
    blocks = -(-n // 64)
    assert blocks * splits >= PROGRAMS_PER_SM * sms or splits * 128 >= v


def test_vocab_splits_default_to_the_cuda_blocks():
    """On CUDA rows come in blocks of 128 and a split is a whole number of 256-column tiles (the largest BLOCK_V
    the autotuner may pick), so no program's last tile is cut short by the split's end rather than V's."""
    from grpoflow.kernels import triton_logprobs

    if triton_logprobs.INTERPRET:
        pytest.skip("the interpreter's blocks are 64 x 128")
    assert (triton_logprobs.BLOCK_N, triton_logprobs.V_ROUND) == (128, 256)
    assert triton_logprobs.vocab_splits(2048, 151936, 132) == (17, 8960)  # 16 row blocks x 17 splits
    assert triton_logprobs.vocab_splits(16384, 151936, 132) == (3, 50688)  # 128 x 3


def test_merge_partials_is_the_logsumexp_of_the_whole_row():
    from grpoflow.kernels.triton_logprobs import merge_partials

    g = torch.Generator().manual_seed(0)
    z = torch.randn(5, 37, generator=g) * 4
    y = torch.randint(0, 37, (5,), generator=g)
    parts = [(0, 10), (10, 30), (30, 37)]
    m, s, zy, ez = [], [], [], []
    for a, c in parts:
        t = z[:, a:c]
        m.append(t.amax(1))
        e = torch.exp(t - m[-1][:, None])
        s.append(e.sum(1))
        ez.append((e * t).sum(1))
        inside = (y >= a) & (y < c)
        zy.append(torch.where(inside, z.gather(1, y[:, None]).squeeze(1), 0.0))
    logp, lse, ent = merge_partials(*(torch.stack(x) for x in (m, s, zy, ez)))
    logsm = torch.log_softmax(z, 1)
    torch.testing.assert_close(lse, torch.logsumexp(z, 1))
    torch.testing.assert_close(logp, logsm.gather(1, y[:, None]).squeeze(1))
    torch.testing.assert_close(ent, -(logsm.exp() * logsm).sum(1))


def test_backward_chunk_rows_fit_the_budget():
    from grpoflow.kernels.triton_logprobs import backward_chunk_rows

    assert backward_chunk_rows(16384, 151936, 2, block_n=64) == 3520  # 1 GiB of bf16 G: 3520 * 151936 * 2 = 1.07e9
    assert backward_chunk_rows(16384, 151936, 2, block_n=128) == 3456
    assert backward_chunk_rows(2048, 151936, 2, block_n=64) == 2048  # one chunk
    assert backward_chunk_rows(70, 300, 4, budget=64 * 300 * 4, block_n=64) == 64
    assert backward_chunk_rows(70, 300, 4, budget=1, block_n=64) == 64  # never below one row block
    assert backward_chunk_rows(70, 300, 4, block_n=64) == 128  # all rows, rounded up to whole blocks


@pytest.mark.triton_interpret
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_trainable", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_triton_every_dtype_matches_reference(dtype, head_trainable, bias):
    """Ragged N=70, V=300, D=80 against BLOCK_N=64, BLOCK_V=128, BLOCK_D=64; 2 vocabulary splits; T=0.8."""
    inputs = make_inputs(70, 80, 300, bias=bias, head_trainable=head_trainable, dtype=dtype)
    assert_matches_reference("triton", inputs, 0.8, **TOL[dtype])


@pytest.mark.triton_interpret
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_backward_in_row_chunks_and_many_splits(monkeypatch, dtype):
    """Three backward chunks of 64 rows (dW, db accumulated across them) and 3 vocabulary splits."""
    from grpoflow.kernels import triton_logprobs

    monkeypatch.setattr(triton_logprobs, "G_BUDGET_BYTES", 64 * 300 * 4)
    monkeypatch.setattr(triton_logprobs, "_sm_count", lambda device: 100)
    inputs = make_inputs(150, 24, 300, bias=True, head_trainable=True, dtype=dtype)
    assert_matches_reference("triton", inputs, 1.3, **TOL[dtype])


def run_dtype_path(h, w, b, y, temperature, up, dtype, row_chunk=16, vocab_chunk=64):
    logp, ent = ChunkedDtypeTokenLogProbs.apply(h, w, b, y, temperature, True, dtype, row_chunk, vocab_chunk)
    params = [t for t in (h, w, b) if t is not None and t.requires_grad]
    return logp, ent, torch.autograd.grad((logp * up).sum(), params)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_trainable", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("n, d, v, temperature", [(70, 80, 300, 0.7), (33, 8, 97, 1.0)])
def test_chunked_dtype_path_matches_reference(dtype, head_trainable, bias, n, d, v, temperature):
    """The CUDA "chunked" path on CPU tensors: GEMMs in ``dtype``, ragged row and vocabulary chunks."""
    h, w, b, y, up = make_inputs(n, d, v, bias=bias, head_trainable=head_trainable, dtype=dtype)
    logp, ent, grads = run_dtype_path(h, w, b, y, temperature, up, dtype)
    ref = [t.detach().float().requires_grad_(t.requires_grad) if t is not None else None for t in (h, w, b)]
    rlogp, rent, rgrads = run("reference", *ref, y, temperature, up)
    tol = TOL[dtype]
    assert logp.dtype == ent.dtype == torch.float32 and not ent.requires_grad
    torch.testing.assert_close(logp, rlogp, atol=tol["atol"], rtol=tol["rtol"])
    torch.testing.assert_close(ent, rent, atol=tol["atol"], rtol=tol["rtol"])
    assert len(grads) == len(rgrads) == (3 if head_trainable and bias else 2 if head_trainable else 1)
    for got, want in zip(grads, rgrads):
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want, atol=tol["grad_atol"], rtol=tol["rtol"])


def test_chunked_dtype_path_float32_head_under_a_bf16_compute_dtype():
    """The autocast case: float32 hidden and head, bf16 GEMM operands (the bias is added to the float32
    logits unrounded); gradients come back float32."""
    h, w, b, y, up = make_inputs(40, 32, 150, bias=True, head_trainable=True)
    logp, _, grads = run_dtype_path(h, w, b, y, 0.9, up, torch.bfloat16)
    hb, wb = (t.detach().bfloat16().float().requires_grad_() for t in (h, w))  # the rounded GEMM operands
    rlogp, _, rgrads = run("reference", hb, wb, b.detach().requires_grad_(), y, 0.9, up)
    torch.testing.assert_close(logp, rlogp, atol=2e-5, rtol=1e-4)
    for got, want in zip(grads, rgrads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=4e-2, rtol=2e-2)


def test_reference_stays_float32():
    h, w, _, y, _ = make_inputs(6, 8, 20, dtype=torch.bfloat16)
    assert token_logprobs_reference(h, w, y)[0].dtype == torch.float32


@pytest.mark.triton_interpret
def test_triton_float32_inputs_with_a_bf16_compute_dtype():
    """The autocast case through the Triton path's buffers: float32 hidden, head and bias, G and the backward
    GEMM operands in bf16 (the interpreter's dots run in float32), float32 gradients."""
    from grpoflow.kernels.triton_logprobs import TritonTokenLogProbs

    h, w, b, y, up = make_inputs(70, 80, 300, bias=True, head_trainable=True)
    logp, ent = TritonTokenLogProbs.apply(h, w, b, y, 0.9, True, torch.bfloat16)
    grads = torch.autograd.grad((logp * up).sum(), [h, w, b])
    rlogp, rent, rgrads = run("reference", *(t.detach().requires_grad_() for t in (h, w, b)), y, 0.9, up)
    torch.testing.assert_close(logp, rlogp, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(ent, rent, atol=2e-5, rtol=1e-4)
    for got, want in zip(grads, rgrads):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, want, atol=4e-2, rtol=2e-2)


@pytest.mark.parametrize("vocab_chunk", [64, 16])
@pytest.mark.parametrize("head_trainable", [True, False])
def test_chunked_dtype_path_makes_no_host_sync_per_tile(vocab_chunk, head_trainable):
    """The CUDA "chunked" path's forward and backward over 5 or 19 vocabulary tiles (times 3 row chunks) call nothing
    that makes a device wait for the host (no nonzero, boolean-mask indexing, item, bool): the onehot term is added
    by masked arithmetic. Counted on CPU tensors, where the same calls are what would sync on CUDA. A frozen head
    takes the J-keeping forward (kernels/chunked_dtype.py, frozen_head_forward): no sync there either."""
    from tests.host_syncs import counting_syncs

    h, w, b, y, up = make_inputs(40, 16, 300, bias=True, head_trainable=head_trainable)
    with counting_syncs() as syncs:
        run_dtype_path(h, w, b, y, 0.9, up, torch.float32, row_chunk=16, vocab_chunk=vocab_chunk)
    assert syncs.total == 0, syncs.where


@pytest.mark.triton_interpret
@pytest.mark.parametrize("num_n, num_v", [(5, 3), (16, 2), (8, 1), (3, 7)])
def test_grouped_order_runs_every_program_once_a_group_at_a_time(num_n, num_v):
    """kernels/triton_logprobs.py's launch order: a permutation of all (row block, vocabulary index) pairs in which
    each run of GROUP_N * num_v consecutive programs stays within GROUP_N row blocks (the last group smaller)."""
    from tests.kernels.grouped_probe import where_each_program_goes  # imported here: under the interpreter

    group = 4
    out = torch.full((num_n * num_v, 2), -1, dtype=torch.int32)
    where_each_program_goes[(num_n * num_v,)](out, num_n, num_v, GROUP_N=group)
    pairs = [tuple(p) for p in out.tolist()]
    assert sorted(pairs) == [(n, v) for n in range(num_n) for v in range(num_v)]
    for first in range(0, num_n, group):
        blocks = {n for n, _ in pairs[first * num_v : (first + group) * num_v]}
        assert blocks == set(range(first, min(first + group, num_n)))
