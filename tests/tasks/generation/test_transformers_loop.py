"""The transformers backend's LoRA merge-on-the-side and thread switching."""

import pytest
import torch

from grpoflow.tasks.config import TinyModelConfig
from grpoflow.tasks.generation.transformers_loop import TransformersGenerator, distinct_prompts, sample
from grpoflow.tasks.generation.types import SamplingParams, left_pad, torch_threads
from grpoflow.tasks.model.lora import lora_layers, lora_merged, merge_blocker
from grpoflow.tasks.model.tiny import build_tiny_model, train_tiny_tokenizer

TEXTS = ["What is 3 + 4?", "<reasoning>\n3 + 4 = 7\n</reasoning>\n<answer>\n7\n</answer>"] * 20


def plain_model(seed: int = 3):
    tok = train_tiny_tokenizer(TEXTS, 280)
    model = build_tiny_model(
        TinyModelConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1
        ),
        tok,
        seed=seed,
    )
    return tok, model.eval()


def lora_model(dora: bool = False):
    """A tiny LoRA model whose adapters are not zero (fresh LoRA has B = 0: merged == base)."""
    from peft import LoraConfig, get_peft_model

    tok, model = plain_model(seed=0)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=dora))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return tok, model


def frozen_state(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_merged_generation_matches_unmerged_and_leaves_weights_alone():
    tok, model = lora_model()
    prompts = [tok("What is 3 + 4?")["input_ids"], tok("What is 7?")["input_ids"]]
    params = SamplingParams(max_new_tokens=8, greedy=True)
    before = frozen_state(model)
    plain = TransformersGenerator(model, tok, merge_lora=False).generate(prompts, 1, params)
    merged = TransformersGenerator(model, tok, merge_lora=True).generate(prompts, 1, params)
    assert merged.completion_ids == plain.completion_ids
    for a, b in zip(merged.logprobs, plain.logprobs):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)
    after = frozen_state(model)
    assert all(torch.equal(before[n], after[n]) for n in before)  # base and adapters bit-identical
    # the adapters matter: the base model alone decodes other log-probs
    with model.disable_adapter():
        base = TransformersGenerator(model, tok, merge_lora=False).generate(prompts, 1, params)
    assert any(abs(x - y) > 1e-3 for a, b in zip(base.logprobs, plain.logprobs) for x, y in zip(a, b))


def test_lora_merged_restores_on_error_and_swaps_inside():
    tok, model = lora_model()
    layer = next(iter(lora_layers(model).values()))
    original = layer.base_layer.weight
    with pytest.raises(RuntimeError, match="boom"):
        with lora_merged(model):
            assert layer.base_layer.weight is not original
            expected = original + layer.get_delta_weight("default")
            torch.testing.assert_close(layer.base_layer.weight, expected)
            raise RuntimeError("boom")
    assert layer.base_layer.weight is original
    assert not layer.disable_adapters  # adapters active again


def test_dora_is_not_merged_but_still_generates():
    tok, model = lora_model(dora=True)
    assert "DoRA" in merge_blocker(model)
    layer = next(iter(lora_layers(model).values()))
    original = layer.base_layer.weight
    with lora_merged(model):
        assert layer.base_layer.weight is original
    prompts = [tok("What is 3 + 4?")["input_ids"]]
    params = SamplingParams(max_new_tokens=4, greedy=True)
    out = TransformersGenerator(model, tok, merge_lora=True).generate(prompts, 1, params)
    assert (
        out.completion_ids
        == TransformersGenerator(model, tok, merge_lora=False).generate(prompts, 1, params).completion_ids
    )


def test_generation_threads_are_restored():
    tok, model = lora_model()
    start = torch.get_num_threads()
    seen = []
    layer = next(iter(lora_layers(model).values()))
    layer.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    TransformersGenerator(model, tok, threads=1).generate(
        [tok("What is 3 + 4?")["input_ids"]], 1, SamplingParams(max_new_tokens=2, greedy=True)
    )
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == start
    with torch_threads(None):
        assert torch.get_num_threads() == start


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=6, greedy=True),
        SamplingParams(max_new_tokens=6, greedy=True, repetition_penalty=1.3),
        SamplingParams(max_new_tokens=6, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
    ],
    ids=["greedy", "greedy-penalty", "sampled-warped"],
)
def test_sample_draws_what_generate_draws(params):
    """Without early stops (an EOS id the model never emits) the loop consumes the RNG as generate does:
    same tokens for the same seed, with every warper on; greedy too."""
    tok, model = plain_model()
    ids, mask = left_pad([tok("What is 3 + 4?")["input_ids"], tok("7")["input_ids"]], tok.pad_token_id)
    never = len(tok) + 7
    torch.manual_seed(5)
    tokens, logps, lengths, stopped = sample(model, ids, mask, params, never)
    kw = (
        dict(do_sample=False)
        if params.greedy
        else dict(
            do_sample=True, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, min_p=params.min_p
        )
    )
    torch.manual_seed(5)
    ref = model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=params.max_new_tokens,
        repetition_penalty=params.repetition_penalty,
        eos_token_id=never,
        pad_token_id=tok.pad_token_id,
        output_logits=True,
        return_dict_in_generate=True,
        **kw,
    )
    assert tokens.tolist() == ref.sequences[:, ids.shape[1] :].tolist()
    assert lengths.tolist() == [params.max_new_tokens] * 2 and not stopped.any()
    temp = 1.0 if params.greedy else params.temperature
    ref_lp = torch.log_softmax(torch.stack(ref.logits, 1).float() / temp, -1).gather(-1, tokens[..., None])[..., 0]
    torch.testing.assert_close(logps, ref_lp, atol=1e-5, rtol=1e-5)


def test_rows_that_stop_leave_the_batch_and_keep_their_results():
    """Greedy decoding with EOS = a token one row emits early: that row stops (length includes EOS) and
    the other rows' tokens equal decoding them alone."""
    tok, model = plain_model()
    prompts = [tok("What is 3 + 4?")["input_ids"], tok("7")["input_ids"], tok("<answer>")["input_ids"]]
    p = SamplingParams(max_new_tokens=8, greedy=True)
    ids, mask = left_pad(prompts, tok.pad_token_id)
    free, _, _, _ = sample(model, ids, mask, p, len(tok) + 7)
    eos = free[1, 2].item()  # row 1's third token becomes EOS
    tokens, logps, lengths, stopped = sample(model, ids, mask, p, eos)
    first = free[1].tolist().index(eos) + 1
    assert lengths[1] == first and stopped[1]
    assert tokens[1, :first].tolist() == free[1, :first].tolist()
    for r in (0, 2):
        alone_ids, alone_mask = left_pad([prompts[r]], tok.pad_token_id)
        alone, alone_lp, n, s = sample(model, alone_ids, alone_mask, p, eos)
        assert lengths[r] == n[0] and stopped[r] == s[0]
        assert tokens[r, : n[0]].tolist() == alone[0, : n[0]].tolist()
        torch.testing.assert_close(logps[r, : n[0]], alone_lp[0, : n[0]], atol=1e-5, rtol=1e-5)


def test_distinct_prompts_index_every_row():
    unique, rows = distinct_prompts([[1, 2], [1, 2], [3], [1, 2], [3], [4, 5]])
    assert unique == [[1, 2], [3], [4, 5]]
    assert rows == [0, 0, 1, 0, 1, 2]


@pytest.mark.parametrize("greedy", [True, False])
def test_shared_prompt_prefill_samples_what_a_full_prefill_samples(greedy):
    """Each distinct prompt prefilled once and its cache copied to its rows (prompt_rows) gives every row the
    tokens, log-probs, lengths and stop flags of prefilling each row itself, rows leaving the batch included."""
    tok, model = lora_model()
    prompts = [tok("What is 3 + 4?")["input_ids"], tok("7")["input_ids"], tok("<answer>")["input_ids"]]
    rows = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    p = SamplingParams(max_new_tokens=10, greedy=greedy, temperature=0.9)
    seeds = list(range(100, 100 + len(rows)))
    ids, mask = left_pad(prompts, tok.pad_token_id)
    free = sample(model, ids[rows], mask[rows], p, len(tok) + 7, seeds)[0]
    eos = free[3, 1].item()  # some rows stop early: the batch compacts after the shared prefill
    full = sample(model, ids[rows], mask[rows], p, eos, seeds)
    shared = sample(model, ids, mask, p, eos, seeds, prompt_rows=rows)
    assert shared[0].tolist() == full[0].tolist()
    torch.testing.assert_close(shared[1], full[1], atol=1e-5, rtol=1e-5)
    assert shared[2].tolist() == full[2].tolist() and shared[3].tolist() == full[3].tolist()
    assert bool(full[3].any()) and not bool(full[3].all())
    # the generator groups a chunk's repeated prompts itself: the same completions as rows given one by one
    gen = TransformersGenerator(model, tok, batch_size=8)
    greedy6 = SamplingParams(max_new_tokens=6, greedy=True)
    out = gen.generate(prompts, 2, greedy6)
    for i, prompt in enumerate(prompts):
        alone_ids, alone_mask = left_pad([prompt], tok.pad_token_id)
        with lora_merged(model):
            alone = sample(model, alone_ids, alone_mask, greedy6, tok.eos_token_id)
        n = alone[2][0].item()
        assert out.completion_ids[2 * i] == out.completion_ids[2 * i + 1] == alone[0][0, :n].tolist()
