"""The SFT loss: cross-entropy of the labelled next tokens, the head applied to those positions only."""

import copy
import random

import pytest
import torch

from grpoflow.tasks.stages.sft import collate, draw_examples, labelled_token_loss, run_sft, tokenize_sft
from grpoflow.tasks.tracking.tracker import RunLogger
from tests.tasks.grpo.test_trainer import make
from tests.tasks.stages.test_grpo import make_cfg, workspace


def _full_logits_loss(model, ids, labels, mask) -> torch.Tensor:
    """The textbook form: every position's vocabulary logits, ignore_index on the unlabelled ones."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # float32 at least; float64 stays
    return torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
    )


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("completion_only", [True, False])
def test_labelled_token_loss_equals_the_full_logits_loss_and_its_gradient(lora: bool, completion_only: bool) -> None:
    tok, model = make(lora=lora)
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} + {a}?"}], "reference": f"<answer>{2 * a}</answer>"}
        for a in (3, 17, 250)  # different lengths: padding on the right of the shorter rows
    ]
    examples, cut = tokenize_sft(rows, tok, 64, completion_only)
    assert cut.cut == cut.dropped == 0 and cut.total == 3
    ids, labels, mask = collate(examples, tok.pad_token_id)
    assert (mask == 0).any() and (labels[:, 1:] == -100).any()
    params = [p for p in model.parameters() if p.requires_grad]

    ours = labelled_token_loss(model, ids, labels, mask)
    ours_grads = torch.autograd.grad(ours, params)
    # The reference runs in float64, and each gradient must sit within 1e-5 of its tensor's scale: float32 sums in
    # another order (the full-logits loss in float32 did) land ~2e-6 apart on entries of ~0.03, which an elementwise
    # rtol of 1e-5 failed for either side; a wrong gradient is off by its own size.
    model64 = copy.deepcopy(model).double()
    full = _full_logits_loss(model64, ids, labels, mask)
    full_grads = torch.autograd.grad(full, [p for p in model64.parameters() if p.requires_grad])

    torch.testing.assert_close(ours.double(), full, rtol=1e-6, atol=1e-5)
    for a, b in zip(ours_grads, full_grads, strict=True):
        assert (a.double() - b).abs().max() <= 1e-5 * b.abs().max() + 1e-12
    assert any(g.abs().sum() > 0 for g in ours_grads)


def test_draw_examples_covers_every_example_once_per_epoch():
    rng, order = random.Random(0), []
    drawn = [draw_examples(list(range(10)), order, rng, 4) for _ in range(5)]  # two epochs of 10
    flat = [x for d in drawn for x in d]
    assert all(len(d) == 4 for d in drawn) and sorted(flat[:10]) == sorted(flat[10:]) == list(range(10))
    assert flat[:10] != list(range(10)) and flat[:10] != flat[10:]  # shuffled, and anew each epoch


@pytest.mark.parametrize("lora", [False, True])
def test_run_sft_trains_and_saves_a_plain_model(tmp_path, lora):
    cfg = make_cfg(tmp_path, lora=lora)
    cfg = cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"use_lora": lora, "max_steps": 2})})
    ws = workspace(cfg, tmp_path)
    summary = run_sft(cfg, ws, RunLogger.disabled())
    out = ws.stage_dir("sft") / "model"
    assert summary["model_path"] == str(out) and summary["steps"] == 2 and summary["final_loss"] > 0
    assert summary["train_examples"] == 40 and summary["base_model"] == str(ws.stage_dir("base_model"))
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()  # LoRA merged


def test_examples_past_max_length_are_counted_warned_and_dropped_when_no_answer_is_left(caplog) -> None:
    """sft.max_length cuts the end of an example: counted, warned with the count and the key; a row whose prompt
    alone fills max_length (no answer token left: loss 0.0 with completion_only) is left out."""
    from grpoflow.tasks.model.loading import prompt_ids
    from grpoflow.tasks.stages.sft import report_cut

    tok, _ = make(lora=False)
    short = {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "reference": "<answer>2</answer>"}
    long_q = "What is " + " + ".join(["1"] * 40) + "?"
    long = {"prompt": [{"role": "user", "content": long_q}], "reference": "<answer>40</answer>"}
    full = len(prompt_ids(tok, short["prompt"])) + len(tok(short["reference"], add_special_tokens=False)["input_ids"])
    max_length = full + 1  # the short row and its EOS fit exactly; the long one's prompt alone is longer
    assert len(prompt_ids(tok, long["prompt"])) > max_length
    examples, cut = tokenize_sft([short, long, short], tok, max_length, completion_only=True)
    assert (cut.total, cut.cut, cut.dropped) == (3, 1, 1) and cut.longest > max_length
    assert len(examples) == 2 and all(any(label != -100 for label in labels) for _, labels in examples)
    with caplog.at_level("WARNING", logger="grpoflow.tasks.stages.sft"):
        report_cut(cut, max_length, RunLogger.disabled())
    assert f"1 of 3 train examples are longer than sft.max_length={max_length}" in caplog.text
    assert "1 with no answer token left are dropped" in caplog.text
    # a cut that keeps part of the answer: counted, kept
    examples, cut = tokenize_sft([short], tok, full - 1, completion_only=True)
    assert (cut.cut, cut.dropped, len(examples)) == (1, 0, 1)
    # nothing left at all: a named error, not a run of loss 0.0
    _, cut = tokenize_sft([long, long], tok, 8, completion_only=True)
    with pytest.raises(ValueError, match=r"sft.max_length=8: every one of the 2 train examples has a prompt of 8"):
        report_cut(cut, 8, RunLogger.disabled())
