"""The compiled static-shape decode step (generation.compile): the eager loop's tokens, log-probs and stops."""

import pytest
import torch

from grpoflow.tasks.generation.backend import compile_choice
from grpoflow.tasks.generation.static_decode import (
    CompiledDecoder,
    bucket_rows,
    bucket_width,
    choose,
    exponential_noise,
    grouped_decode_attention,
)
from grpoflow.tasks.generation.transformers_loop import TransformersGenerator, sample
from grpoflow.tasks.generation.types import SamplingParams, left_pad
from tests.tasks.generation.test_transformers_loop import lora_model, plain_model

PARAMS = [
    SamplingParams(max_new_tokens=10, greedy=True),
    SamplingParams(max_new_tokens=10, greedy=True, repetition_penalty=1.3),
    SamplingParams(max_new_tokens=10, temperature=0.7, top_k=20, top_p=0.9, min_p=0.05, repetition_penalty=1.2),
]
QUESTIONS = ["What is 3 + 4?", "What is 7?", "3 + 4 = 7"]


def test_buckets_round_up_to_few_shapes():
    assert [bucket_rows(n) for n in (1, 2, 3, 5, 64, 65)] == [1, 2, 4, 8, 64, 128]
    assert [bucket_width(n) for n in (1, 32, 33, 70)] == [32, 32, 64, 96]


def test_choose_draws_what_multinomial_draws():
    """argmax(softmax / Exp(1) noise) is torch.multinomial's own single draw: same generator, same token, also
    where warpers set scores to -inf; a generator's noise drawn in a block equals the same draws one by one."""
    scores = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    scores[:, :10] = float("-inf")
    gens = [torch.Generator().manual_seed(s) for s in range(6)]
    expect = [int(torch.multinomial(torch.softmax(scores[i], -1), 1, generator=g)) for i, g in enumerate(gens)]
    noise = exponential_noise(3, 6, 50, [torch.Generator().manual_seed(s) for s in range(6)], "cpu")
    token, logp = choose(scores, scores, noise[0], greedy=False, temperature=1.0)
    assert token.tolist() == expect
    torch.testing.assert_close(logp, torch.log_softmax(scores, -1).gather(-1, token[:, None]).squeeze(1))
    g2 = torch.Generator().manual_seed(2)
    one_by_one = torch.stack([torch.empty(50).exponential_(generator=g2) for _ in range(3)])
    torch.testing.assert_close(noise[:, 2], one_by_one, rtol=0, atol=0)


def test_grouped_attention_equals_repeated_kv_sdpa():
    """One query position against Hkv < H key/value heads without repeat_kv: transformers' sdpa values."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Attn(torch.nn.Module):
        num_key_value_groups = 2
        is_causal = True

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(3, 4, 1, 8, generator=g), torch.randn(3, 2, 9, 8, generator=g), torch.randn(3, 2, 9, 8)
    mask = torch.ones(3, 1, 1, 9, dtype=torch.bool)
    mask[0, ..., :4] = False
    ours, _ = grouped_decode_attention(Attn(), q, k, v, mask, scaling=0.3)
    theirs, _ = sdpa_attention_forward(Attn(), q, k, v, mask, scaling=0.3)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)


def eos_that_stops_some(tok, model, prompts, n, params, seeds):
    """A token the eager loop emits mid-completion for some rows, as the EOS id: rows then stop at different
    steps, so the compiled step's masking of finished rows is exercised."""
    out = TransformersGenerator(model, tok).generate(prompts, n, params, row_seeds=seeds)
    counts: dict[int, int] = {}
    for row in out.completion_ids:
        for t in set(row[2:6]):
            counts[t] = counts.get(t, 0) + 1
    return min(counts, key=lambda t: abs(counts[t] - len(out.completion_ids) / 2))


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "greedy-penalty", "sampled-warped"])
def test_compiled_step_decodes_what_the_eager_loop_decodes(params):
    """Row seeds (or greedy): the same tokens, stops and lengths as the eager loop, log-probs to float
    tolerance; 9 rows (a padded batch bucket of 16), prompts of different lengths shared by 3 rows each, and an
    EOS some rows emit early."""
    tok, model = plain_model()
    prompts = [tok(q)["input_ids"] for q in QUESTIONS]
    seeds = list(range(100, 109))
    tok.eos_token_id = eos_that_stops_some(tok, model, prompts, 3, params, seeds)
    eager = TransformersGenerator(model, tok).generate(prompts, 3, params, row_seeds=seeds)
    gen = TransformersGenerator(model, tok, compiled=True)
    compiled = gen.generate(prompts, 3, params, row_seeds=seeds)
    assert compiled.completion_ids == eager.completion_ids
    assert compiled.finish_reasons == eager.finish_reasons
    assert {"stop", "length"} == set(eager.finish_reasons)  # some rows stopped early, some ran to the limit
    for a, b in zip(compiled.logprobs, eager.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)
    assert gen.decoder.stats.compiles == 1
    gen.generate(prompts, 3, params, row_seeds=[s + 1 for s in seeds])  # other seeds, same shapes: no recompile
    assert gen.decoder.stats.compiles == 1


def test_global_rng_draws_agree_until_a_row_stops():
    """Without row seeds both draw from the global RNG; with no early stop they consume it alike."""
    tok, model = plain_model()
    ids, mask = left_pad([tok(q)["input_ids"] for q in QUESTIONS], tok.pad_token_id)
    p = SamplingParams(max_new_tokens=12, temperature=0.9)
    torch.manual_seed(5)
    eager = sample(model, ids, mask, p, eos_id=-1)
    torch.manual_seed(5)
    compiled = CompiledDecoder().sample(model, ids, mask, p, eos_id=-1)
    assert torch.equal(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1], atol=1e-5, rtol=1e-5)


def test_compiled_step_sees_weights_updated_in_place_and_merged_lora():
    """Parameters are graph inputs: an in-place optimizer-style update and a LoRA adapter change (merged afresh
    each round by lora_merged) show in the next generation, which equals the eager loop's, without recompiling
    for the update."""
    tok, model = lora_model()
    prompts = [tok(q)["input_ids"] for q in QUESTIONS]
    p = SamplingParams(max_new_tokens=8, greedy=True)
    gen = TransformersGenerator(model, tok, compiled=True)
    before = gen.generate(prompts, 2, p)
    compiles = gen.decoder.stats.compiles
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(-3.0)
        model.get_base_model().lm_head.weight.add_(0.05)  # not adapted: a plain parameter updated in place
    after = gen.generate(prompts, 2, p)
    eager = TransformersGenerator(model, tok).generate(prompts, 2, p)
    assert after.completion_ids == eager.completion_ids
    for a, b in zip(after.logprobs, eager.logprobs, strict=True):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)
    assert after.logprobs != before.logprobs
    assert gen.decoder.stats.compiles == compiles


def test_compile_choice_auto_is_on_for_cuda_only():
    assert compile_choice("auto", "cuda")[:2] == (True, "reduce-overhead")
    assert compile_choice("auto", "cpu")[0] is False
    assert compile_choice("on", "cpu")[:2] == (True, None)
    assert compile_choice("off", "cuda")[0] is False


@pytest.mark.parametrize(("setting", "compiled"), [("on", True), ("off", False), ("auto", False)])
def test_generation_compile_reaches_the_generator(setting, compiled):
    """generation.compile picks the decoder make_generator builds (auto: off on this CPU)."""
    from grpoflow.tasks.config import GenerationConfig
    from grpoflow.tasks.generation.backend import make_generator

    tok, model = plain_model()
    cfg = GenerationConfig(backend="transformers", compile=setting)
    gen = make_generator(cfg, model, tok, model_path="unused")
    assert (gen.decoder is not None) is compiled
