"""vLLM generation, co-located: the engine runs in the trainer's process and gets its weights in memory.

Same interface as the transformers backend (tasks/generation/transformers_loop.py): generate(prompt ids, n, params) ->
Generation; sync_weights(model). What this module adds, and why:

- One process. ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (tasks/generation/vllm_support.py, which also says whether
  vLLM can serve a model here) and the ``uni`` executor keep the engine in
  the trainer's process, so weights move as tensors, never through files or sockets (under torchrun, one engine
  per rank with the ``external_launcher`` executor: tasks/generation/vllm_ranks.py). Memory is
  bounded by config: an explicit KV cache size (the only bound on CPU), or a fraction of the GPU.
- Weight sync. Before a generate whose weights are stale (any trainable parameter changed since
  the last sync; torch bumps a tensor's version on every in-place update, optimizer steps and
  checkpoint loads included) the model's state is streamed into the engine with
  ``collective_rpc("reload_weights", weights_iterator=...)``: vLLM's layer-wise reload, which
  re-runs each layer's post-load processing (the CPU backend repacks linear weights, so copying
  into ``model.load_weights`` directly leaves the packed copies stale). Full fine-tuning streams
  every parameter; LoRA streams W + scale * B @ A for each adapted layer (peft's
  ``get_delta_weight``; the training model is not touched) and the base weights for the rest.
  A tied head is streamed as ``lm_head.weight`` too: vLLM keeps its own (packed) head. The
  prefix cache is reset after every sync: its blocks hold KV computed with the old weights.
- Sampler log-probs: ``logprobs=0`` with ``logprobs_mode="processed_logprobs"`` (as TRL): the
  chosen token's log-prob after temperature, i.e. log_softmax(logits / T), the trainer's
  definition. With top_k / top_p / min_p / repetition_penalty it is the log-prob under the
  truncated distribution actually sampled from (the transformers backend reports the untruncated
  one); the importance-sampling correction then sees the real sampler.
- EOS: the engine stops only on the tokenizer's EOS (``generation_config="vllm"`` ignores extra
  EOS ids in the model's generation_config, as the transformers backend does) and the completion
  includes it: finish_reason "stop"; cut at max_tokens: "length".
- Device and process state (tasks/generation/vllm_device.py): the engine starts on the model's GPU, and the
  trainer's current CUDA device, RNGs and thread count are restored after its start.
- Determinism: Each generate draws one seed from
  the trainer's torch RNG and gives every prompt its own seed (vLLM adds the sample index), so
  completions follow the trainer's RNG state, which GRPO checkpoints: a resumed run samples the
  same completions. With ``row_seeds`` (distributed GRPO) each completion is a request seeded by its row.
- Sleep mode (GPU): between generations the engine's KV cache is freed and its weights put away, then
  woken before the next sync (:func:`sleep_level`): level 2 (weights discarded) when every sync streams
  the whole model anyway, level 1 (weights offloaded to host memory) when only the adapter is synced and
  the base must survive. The CPU backend has no sleep mode (vLLM only logs a warning): skipped there.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from grpoflow.tasks.config import GenerationConfig
from grpoflow.tasks.generation.types import Generation, SamplingParams
from grpoflow.tasks.generation.vllm_device import (
    engine_device,
    keep_current_device,
    keep_process_state,
    placement_kwargs,
    release_cached_blocks,
    vllm_has_device_ids,
)
from grpoflow.tasks.generation.vllm_ranks import executor_backend, full, launcher_world, row_requests
from grpoflow.tasks.generation.vllm_support import config_head_dim, import_vllm
from grpoflow.tasks.model.device import model_device
from grpoflow.tasks.model.lora import lora_layers, merged_weight, unwrap

log = logging.getLogger(__name__)

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


# --------------------------------------------------------------------------------------------
# engine arguments (pure: unit-tested for both the CPU and the GPU branch)
# --------------------------------------------------------------------------------------------
def sleep_level(lora_sync: str | None) -> int:
    """vLLM sleep level while training. 2 discards the engine's weights (nothing copied to host memory,
    nothing copied back): right when each sync streams the whole model (full fine-tuning, or LoRA with
    ``vllm_lora_sync: merge``), as TRL's colocate mode does. 1 offloads them to host memory: needed with
    ``vllm_lora_sync: adapter``, which streams the frozen base only once."""
    return 1 if lora_sync == "adapter" else 2


def sleep_mode_on(cfg: GenerationConfig, device: str, available: bool) -> bool:
    """Offload the engine while training: GPU only (vLLM's CPU worker ignores sleep), when asked and available."""
    return device != "cpu" and cfg.vllm_sleep_mode and available


def kv_cache_bytes(hf_config, dtype: str, tokens: int) -> int:
    """Bytes of K and V for ``tokens`` tokens: 2 * layers * kv_heads * head_dim * dtype size."""
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    head_dim = config_head_dim(hf_config)
    return 2 * hf_config.num_hidden_layers * kv_heads * head_dim * DTYPE_BYTES.get(dtype, 4) * tokens


def engine_kwargs(
    cfg: GenerationConfig,
    *,
    model_path: str,
    dtype: str,
    max_model_len: int,
    seed: int,
    hf_config,
    device: str,
    sleep_available: bool,
    lora_rank: int | None = None,
    world: int = 1,
    revision: str | None = None,
) -> dict:
    """Arguments of ``vllm.LLM`` for a co-located engine on ``device`` ("cpu", "cuda" or "cuda:N"; the GPU's own
    placement: vllm_device.placement_kwargs), in a process of a ``world``-process torch.distributed group
    (tasks/generation/vllm_ranks.py).

    KV cache: ``vllm_kv_cache_gib`` when set; else on CPU room for ``vllm_max_num_seqs`` full-length
    sequences (block-rounded, at least 32 MiB); on GPU ``vllm_gpu_memory_utilization`` of the device.
    ``revision``: the hub commit of a hub-id ``model_path`` (model.revision): the engine starts from the config
    and weights the policy loaded, not from whatever the branch names now (the first sync then streams the
    policy's weights); None: a local folder, or the default branch."""
    kw = dict(
        model=model_path,
        dtype=dtype,
        max_model_len=max_model_len,
        seed=seed,
        distributed_executor_backend=executor_backend(world),
        skip_tokenizer_init=True,  # prompts arrive as ids; completions go back as ids
        generation_config="vllm",  # stop on the tokenizer's EOS only, no sampling defaults from the model
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=cfg.vllm_enable_prefix_caching,
        max_num_seqs=cfg.vllm_max_num_seqs,
        enforce_eager=cfg.vllm_enforce_eager if cfg.vllm_enforce_eager is not None else device == "cpu",
    )
    if revision is not None:
        kw["revision"] = revision
    if device == "cpu":
        # No chunked prefill on CPU: vLLM rewinds a seeded request's generator after a partial prefill with
        # Generator.set_offset, which only CUDA generators have ("CPU Generator does not use offset"). Whole
        # prompts then share one step's token budget, sized for a generation round's prompts.
        kw.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 8192))
    if cfg.vllm_kv_cache_gib is not None:
        kw["kv_cache_memory_bytes"] = int(cfg.vllm_kv_cache_gib * (1 << 30))
    elif device == "cpu":
        block = 128  # the CPU backend's block size
        tokens = cfg.vllm_max_num_seqs * (-(-max_model_len // block) * block)
        kw["kv_cache_memory_bytes"] = max(32 << 20, kv_cache_bytes(hf_config, dtype, tokens))
    else:
        kw["gpu_memory_utilization"] = cfg.vllm_gpu_memory_utilization
    if sleep_mode_on(cfg, device, sleep_available):
        kw["enable_sleep_mode"] = True
    if lora_rank is not None:  # LoRA sync "adapter": the engine applies the adapter itself
        rank = min(r for r in LORA_RANKS if r >= lora_rank)
        kw.update(enable_lora=True, max_lora_rank=rank, max_loras=1, max_cpu_loras=1)
    return kw


LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values


def sampling_kwargs(p: SamplingParams, eos_id: int) -> dict:
    """vllm.SamplingParams arguments equivalent to the transformers backend's generate kwargs."""
    kw = dict(
        max_tokens=p.max_new_tokens,
        logprobs=0,  # the chosen token's log-prob
        stop_token_ids=[eos_id],
        detokenize=False,
        repetition_penalty=p.repetition_penalty,
    )
    if p.greedy:
        kw.update(temperature=0.0)
    else:
        kw.update(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or 0, min_p=p.min_p or 0.0)
    return kw


# --------------------------------------------------------------------------------------------
# what to stream into the engine
# --------------------------------------------------------------------------------------------
@torch.no_grad()
def sync_state(model, merge: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every weight of ``model`` as the engine must see it.

    A peft model yields merged weights W + scale * B @ A computed on the side (the training model is
    not modified) under the base model's names (``merge=False``: the base weights alone); a tied
    head is also yielded as ``lm_head.weight``. FSDP2 shards are gathered one weight at a time, in this order on
    every rank (vllm_ranks.full)."""
    base = unwrap(model)
    layers = lora_layers(model)
    for name, param in base.named_parameters():
        if ".lora_" in name or "lora_magnitude" in name:
            continue
        module_name, _, leaf = name.rpartition(".")
        if module_name.endswith(".base_layer"):
            owner = module_name[: -len(".base_layer")]
            tensor = merged_weight(layers[owner]) if merge and leaf == "weight" else param.detach()
            yield f"{owner}.{leaf}", full(tensor)
        else:
            yield name, full(param.detach())
    if getattr(base.config, "tie_word_embeddings", False) and base.get_output_embeddings() is not None:
        yield "lm_head.weight", full(base.get_output_embeddings().weight.detach())


def _install_adapter(worker, lora_id: int, tensors: dict, peft_config: dict) -> None:
    """Runs inside the engine (collective_rpc): swap the served adapter for these in-memory tensors.

    The caller passes a fresh id per sync: vLLM's own add path skips an id it already holds (so a
    re-sent adapter under the same id would keep serving the old weights), and vLLM expects one id
    per distinct adapter. The old adapter is removed first; only one is ever resident."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = getattr(worker, "worker", worker).model_runner.lora_manager
    manager.remove_all_adapters()
    mapper = getattr(manager._adapter_manager.model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        lora_id,
        tensors,
        PEFTHelper.from_dict({**peft_config, "vllm_max_position_embeddings": None}),
        device=str(manager.device),
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
    )
    manager._adapter_manager.add_adapter(lora)


def weights_version(model) -> int:
    """Grows whenever a trainable parameter is updated in place (optimizer step, checkpoint load)."""
    return sum(p._version for p in model.parameters() if p.requires_grad)


# --------------------------------------------------------------------------------------------
# the generator
# --------------------------------------------------------------------------------------------
_SYNC_CHATTER = (
    "Reloading and processing weights took",
    "Successfully reset prefix cache",
    "RotaryEmbedding: Failed to load weights",  # any other layer that loads nothing is a real problem: kept
    "Chat template warmup failed",  # start-up, with a traceback: this engine has no tokenizer on purpose
)


class _DropSyncChatter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(text in record.getMessage() for text in _SYNC_CHATTER)


def _quiet_sync_logs() -> None:
    """vLLM logs three lines per weight sync: the reload time, the prefix-cache reset, and a warning that the
    rotary embedding loaded nothing (its cos/sin cache is computed, never in a checkpoint). At one sync per
    optimizer step that buries the training log; drop exactly those lines (and the start-up chat warm-up
    traceback of an engine without a tokenizer, which reads like a failure and is not one) at vLLM's handlers."""
    for handler in logging.getLogger("vllm").handlers:
        if not any(isinstance(f, _DropSyncChatter) for f in handler.filters):
            handler.addFilter(_DropSyncChatter())


def _engine_memory(kwargs: dict, device: str, sleep_enabled: bool) -> str:
    """The engine's device, KV cache and sleep mode, as its start-up line says them."""
    if "kv_cache_memory_bytes" in kwargs:
        kv = f"{kwargs['kv_cache_memory_bytes'] / (1 << 20):.0f} MiB"
    else:
        kv = f"{kwargs.get('gpu_memory_utilization')} of the GPU"
    sleep = "on" if sleep_enabled else "off (not supported on CPU)" if device == "cpu" else "off"
    return f"{device}, co-located, KV cache {kv}, sleep mode {sleep}"


class VLLMGenerator:
    """Samples with an in-process vLLM engine that follows the training model's weights."""

    name = "vllm"
    separate_engine = True  # another implementation samples: the trainer corrects for the drift (TIS)

    def __init__(
        self,
        model,
        tokenizer,
        model_path: str,
        cfg: GenerationConfig,
        *,
        dtype: str = "float32",
        max_model_len: int = 1024,
        seed: int = 0,
        revision: str | None = None,
    ):
        vllm = import_vllm()
        from vllm.platforms import current_platform

        self.model = model
        self.eos_id = tokenizer.eos_token_id
        self.cfg = cfg
        self.device = engine_device(current_platform.is_cpu(), model_device(model), torch.cuda.current_device)
        self.empty_cache: Callable[[], None] = lambda: release_cached_blocks(self.device)  # before each wake-up
        self.sleep_enabled = sleep_mode_on(cfg, self.device, current_platform.is_sleep_mode_available())
        base = unwrap(model)
        self.lora_sync = cfg.vllm_lora_sync if hasattr(model, "peft_config") else None
        lora_rank = model.peft_config[model.active_adapter].r if self.lora_sync == "adapter" else None
        self.world = launcher_world()  # > 1: this rank's engine inside torchrun's group (vllm_ranks.py)
        kwargs = engine_kwargs(
            cfg,
            model_path=str(Path(model_path)),
            revision=revision,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            hf_config=base.config,
            device=self.device,
            sleep_available=current_platform.is_sleep_mode_available(),
            lora_rank=lora_rank,
            world=self.world,
        )
        if self.device != "cpu":  # the model's GPU (vLLM's one-process worker would take cuda:0)
            kwargs.update(placement_kwargs(self.device, self.world, vllm_has_device_ids()))
        t0 = time.perf_counter()
        _quiet_sync_logs()  # before the engine starts: its chat warm-up is dropped too
        with keep_process_state(), keep_current_device():  # vLLM's worker sets the current device as it starts
            self.llm = vllm.LLM(**kwargs)
        up = _engine_memory(kwargs, self.device, self.sleep_enabled)
        log.info("vLLM engine up in %.1fs (%s)", time.perf_counter() - t0, up)
        self._synced_version: int | None = None
        # what decides a sync when set (distributed GRPO: the optimizer step, the same on every rank); else the
        # trainable parameters' in-place versions
        self.weights_key: Callable[[], int] | None = None
        self.lora_request = None  # the adapter served in "adapter" mode
        self._asleep: set[str] = set()  # engine memory offloaded while training (GPU sleep mode)
        self.sync_seconds = 0.0  # total time spent streaming weights (reported by the benchmark)
        self.syncs = 0

    # ------------------------------------------------------------------ weights
    def sync_weights(self, model=None, force: bool = False) -> bool:
        """Stream the model's current weights into the engine when they changed; True if it synced."""
        if model is not None:
            if model is not self.model:
                force, self._synced_version = True, None
            self.model = model
        version = self.weights_key() if self.weights_key is not None else weights_version(self.model)
        if not force and version == self._synced_version:
            return False
        self._wake(["weights"])
        t0 = time.perf_counter()
        if self.lora_sync == "adapter":
            if self._synced_version is None:  # first sync of this model: its (frozen) base weights once
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": sync_state(self.model, False)})
            self._sync_adapter()
        else:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": sync_state(self.model)})
        self.llm.reset_prefix_cache()  # cached blocks hold KV of the old weights
        self.sync_seconds += time.perf_counter() - t0
        self.syncs += 1
        self._synced_version = version
        return True

    def _sync_adapter(self) -> None:
        from peft import get_peft_model_state_dict
        from vllm.lora.request import LoRARequest

        name = self.model.active_adapter
        state = get_peft_model_state_dict(self.model, adapter_name=name)
        tensors = {k: full(v.detach()).clone() for k, v in state.items()}
        peft_config = self.model.peft_config[name].to_dict()
        peft_config["target_modules"] = sorted(peft_config["target_modules"] or [])
        lora_id = self.syncs + 1
        self.llm.collective_rpc(_install_adapter, args=(lora_id, tensors, peft_config))
        # lora_path is never read: the adapter is registered above; vLLM only requires a non-empty one
        self.lora_request = LoRARequest(f"grpo-{lora_id}", lora_id, lora_path="in-memory")

    # ------------------------------------------------------------------ memory around training
    def _wake(self, tags: list[str]) -> None:
        """Wake the engine's ``tags`` that sleep, after handing the training step's cached blocks back to the
        driver: the engine allocates beside the caching allocator, and a nearly full card runs out here."""
        tags = [t for t in tags if t in self._asleep]
        if tags:
            self.empty_cache()
            self.llm.wake_up(tags=tags)
            self._asleep -= set(tags)

    def release(self) -> None:
        """Free the engine's memory for training (GPU sleep mode, :func:`sleep_level`; nothing to do on CPU)."""
        if self.sleep_enabled and not self._asleep:
            level = sleep_level(self.lora_sync)
            self.llm.sleep(level=level)  # KV cache dropped; weights offloaded (1) or discarded (2)
            self._asleep = {"weights", "kv_cache"}
            if level == 2:
                self._synced_version = None  # the engine holds no weights now: the next sync streams them all

    def resume(self) -> None:
        self._wake(["weights", "kv_cache"])

    def close(self) -> None:
        """Shut the engine down and free its memory (the stage ends with this). vLLM's parallel state is
        process-wide: engines alive at the same time must be closed together, after their last use. vLLM's shutdown
        also destroys the default process group: in a distributed run, close only after the last collective."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
            del llm
            gc.collect()

    # ------------------------------------------------------------------ sampling
    def generate(
        self, prompts: list[list[int]], n: int, params: SamplingParams, row_seeds: list[int] | None = None
    ) -> Generation:
        """``n`` completions of each prompt, prompt-major. ``row_seeds`` (one per completion): each completion is a
        request of its own with that seed, so it does not depend on the batch that drew it (distributed GRPO)."""
        from vllm import SamplingParams as VLLMSamplingParams

        self.sync_weights()
        self.resume()
        kw = sampling_kwargs(params, self.eos_id)
        if row_seeds is None:
            base_seed = int(torch.randint(0, 2**31 - 1, ()).item())  # the trainer's RNG decides the samples
            requests = [(p, VLLMSamplingParams(n=n, seed=base_seed + i * n, **kw)) for i, p in enumerate(prompts)]
        else:
            requests = [(p, VLLMSamplingParams(n=1, seed=s, **kw)) for p, s in row_requests(prompts, n, row_seeds)]
        inputs, per_request = [{"prompt_token_ids": p} for p, _ in requests], [sp for _, sp in requests]
        with torch.random.fork_rng(devices=[]):  # nothing in the engine may move the trainer's CPU RNG
            outs = self.llm.generate(inputs, per_request, use_tqdm=False, lora_request=self.lora_request)
        self.release()
        gen = Generation()
        for out in outs:  # in prompt order; samples of a prompt in index order: prompt-major
            for c in sorted(out.outputs, key=lambda c: c.index):
                ids = list(c.token_ids)
                gen.completion_ids.append(ids)
                gen.logprobs.append([lp[t].logprob for t, lp in zip(ids, c.logprobs)])
                gen.finish_reasons.append("stop" if c.finish_reason == "stop" else "length")
        return gen
