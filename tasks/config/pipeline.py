"""The run configuration's sections (run, data, model, generation, eval, export, tracking) and their root,
:class:`PipelineConfig`; the model section is in model.py, the sft/grpo sections in training.py, storage in
storage.py.

Every section is a pydantic model with ``extra="forbid"`` and ``frozen=True``: unknown keys,
wrong types and impossible combinations fail in :func:`grpoflow.tasks.config.load.load_config`, before any model
is loaded, with a :class:`ConfigError` whose message names the dotted key (``grpo.num_generations``).
"""

from __future__ import annotations

import math
import os
import posixpath
import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from grpoflow.tasks.config.base import _Section
from grpoflow.tasks.config.distributed import DistributedConfig
from grpoflow.tasks.config.model import ModelConfig
from grpoflow.tasks.config.storage import StorageConfig, check_s3_uri
from grpoflow.tasks.config.training import GRPOConfig, SFTConfig

# --------------------------------------------------------------------------------------------
# run / data
# --------------------------------------------------------------------------------------------
DEVICE_PATTERN = r"auto|cpu|cuda(:\d+)?"
BNB_OPTIMIZERS = ("adamw_8bit", "paged_adamw_8bit")  # the optim values bitsandbytes implements


class RunConfig(_Section):
    """The ``run`` section: the run's name and folder, its seed, and the device and CPU threads it trains on."""

    name: str | None = Field(
        None, description="Run name; the run workspace is <output_dir>/<name>. Default: run-<time>."
    )
    output_dir: str = Field("runs", description="Folder that holds run workspaces and the MLflow store.")
    seed: int = Field(
        42,
        description="Seed of what is random in the run: the arithmetic questions, the held-out split, the tiny "
        "model's initial weights, the prompt order and the sampled completions.",
    )
    device: str = Field(
        "auto",
        pattern=f"^({DEVICE_PATTERN})$",
        description="Where SFT, GRPO and evaluation run: auto (a CUDA GPU when torch sees one, else the CPU), cpu, "
        "cuda or cuda:N. Models, batches and optimizer state all live there; export writes from CPU copies.",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads for torch (torch.set_num_threads) in every stage; None keeps torch's default. "
        "In the stage keys: another count sums in another order, so it trains other weights. Small models on "
        "a few shared cores can run faster on 1: their ops are too small to split, and threads spin when cores "
        "are busy.",
    )

    @field_validator("name")
    @classmethod
    def _safe_name(cls, v: str | None) -> str | None:
        if v is None:
            return v
        if not v or "/" in v or v in {".", ".."}:
            raise ValueError("must be a non-empty name without '/'")
        return v

    @field_validator("output_dir")
    @classmethod
    def _s3_output_dir(cls, v: str) -> str:
        return check_s3_uri(v)  # now, not when the first stage writes under a mirror path that lies elsewhere


class ArithmeticConfig(_Section):
    """The built-in verifiable task: 'What is 37 + 58?' -> 95."""

    train_size: int = Field(4000, ge=1, description="Generated training questions, none of them in the eval split.")
    eval_size: int = Field(200, ge=1, description="Generated held-out questions (data.eval_size is for other sources).")
    min_operand: int = Field(0, description="Smallest operand.")
    max_operand: int = Field(99, description="Largest operand (at least min_operand).")
    operations: list[Literal["+", "-", "*"]] = Field(
        default_factory=lambda: ["+", "-"], min_length=1, description="Operators the questions are drawn from."
    )
    non_negative_subtraction: bool = Field(
        False,
        description="Only subtraction questions whose answer is not negative (a >= b). SmolLM2-135M after SFT gets "
        'a - b with a < b right in 3% of its samples (pass@8 0.19; benchmarks/RESULTS.md, "Learning on the real '
        'model", 2026-12-03 18:15): too rare a reward for GRPO to learn from quickly.',
    )
    reasoning: Literal["direct", "steps", "mixed"] = Field(
        "direct",
        description="Reference reasoning: direct '37 + 58 = 95'; steps '37 + 58 = 37 + 50 + 8 = 87 + 8 = 95'; "
        "mixed: half of each (GRPO then finds which style earns more reward).",
    )

    @model_validator(mode="after")
    def _range(self) -> ArithmeticConfig:
        if self.max_operand < self.min_operand:
            raise ValueError("max_operand must be >= min_operand")
        return self


GSM8K_SYSTEM_PROMPT = "Respond in the following format:\n<reasoning>\n...\n</reasoning>\n<answer>\n...\n</answer>"


class DataConfig(_Section):
    """The ``data`` section: where the training and held-out rows come from and how they become chat prompts."""

    source: str = Field(
        "arithmetic",
        description="'arithmetic' (built-in task), 'humaneval' (HumanEval's 164 problems, extra 'code'), a local "
        "or s3://bucket/key .jsonl/.json/.parquet/.csv file, "
        "or a Hugging Face dataset id.",
    )
    format: Literal["auto", "gsm8k", "qa", "arithmetic", "code"] = Field(
        "auto",
        description="Row mapping: gsm8k = gold answer after '####'; qa = answer field used as is; code = answer "
        "field holds Python tests for the code_tests reward; auto = gsm8k when answers contain '####', else qa "
        "(code for data.source humaneval).",
    )
    question_field: str = Field("question", description="Column holding the question in a data file or dataset.")
    answer_field: str = Field(
        "answer", description="Column holding the gold answer (code rows: the tests the code_tests reward runs)."
    )
    subset: str | None = Field(None, description="Config name of a HF dataset id (e.g. 'main' for openai/gsm8k).")
    split: str = Field("train", description="Split of a HF dataset id used for training.")
    revision: str | None = Field(
        None,
        description="Branch, tag or commit of a HF dataset id (data.source, and data.eval_source when it names a "
        "split); null: the default branch. A run pins it to the commit it names when the run starts (config.yaml "
        "records it), so a resume, a rerun of the data stage or a later run of the same config reads the same "
        "files whatever is pushed to the dataset since.",
    )
    eval_source: str | None = Field(
        None,
        description="Separate eval file (local or s3://) or split name; else a held-out slice. Either way a "
        "training row whose question (whitespace aside) is a held-out one is dropped, and each held-out question "
        "is scored once (a warning counts both).",
    )
    eval_size: float = Field(0.1, gt=0, description="Held-out rows: a fraction (<1) or a count (>=1).")
    max_train_rows: int | None = Field(None, ge=1, description="Keep at most this many training rows; null: all.")
    max_eval_rows: int | None = Field(None, ge=1, description="Keep at most this many held-out rows; null: all.")
    system_prompt: str | None = Field(
        GSM8K_SYSTEM_PROMPT,
        description="System message put before every question in the chat prompt; null: none. The default asks "
        "for the <reasoning>/<answer> format the format rewards check.",
    )
    on_invalid_row: Literal["error", "skip"] = Field(
        "error", description="A row without a usable question/answer: fail naming the row, or skip and count it."
    )
    arithmetic: ArithmeticConfig = Field(default_factory=ArithmeticConfig)

    @field_validator("source", "eval_source")
    @classmethod
    def _s3_sources(cls, v: str | None) -> str | None:
        return check_s3_uri(v)  # an s3:// file is downloaded to <storage.cache_dir>/<bucket>/<key>


class GenerationConfig(_Section):
    """How GRPO samples completions. vllm_* keys apply to the vLLM backend only (tasks/generation/vllm_engine.py)."""

    backend: Literal["auto", "vllm", "transformers"] = Field(
        "auto",
        description="auto: vLLM when it imports and supports the model, else the transformers backend; "
        "vllm: the co-located vLLM engine (fails if unavailable); transformers: grpoflow's own KV-cached decode "
        "loop over the training model's forward (not model.generate), optionally a compiled static-shape step "
        "(generation.compile).",
    )
    batch_size: int = Field(64, ge=1, description="Sequences per decoding chunk of the transformers backend.")
    merge_lora: bool = Field(
        True,
        description="transformers backend: generate with LoRA merged on the side (W + scale*B@A, one matmul per "
        "layer; a copy of the adapted weights while generating). Skipped for 4-bit bases and DoRA.",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="transformers backend: torch CPU threads while generating (default: run.torch_threads). "
        "Decoding is many small ops: on cores other processes keep busy, 1 thread can be faster.",
    )
    compile: Literal["auto", "on", "off"] = Field(
        "auto",
        description="transformers backend: decode with a torch.compile'd static-shape step "
        "(tasks/generation/static_decode.py; on CUDA with CUDA graphs). auto: on for CUDA, off on CPU, where "
        "compiling (3-39 s a graph on the 2-core CPU host of benchmarks/RESULTS.md, cached to cold) costs more "
        "than it saves in a default run (docs/generation.md). Keyed as written: compiled kernels sum in another "
        "order, so log-probs differ in the last bits; auto is one key on every device, so a run resumed on another "
        "device continues with that device's choice (set on or off to hold it).",
    )

    @field_validator("compile", mode="before")
    @classmethod
    def _on_off(cls, v):
        """YAML reads an unquoted on / off (a config file's `compile: on`, the override `generation.compile=on`) as a
        boolean: take it as the word the user typed."""
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v

    vllm_kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description="KV cache size of the vLLM engine in GiB. Default: on CPU, room for vllm_max_num_seqs "
        "full-length sequences (at least 32 MiB); on GPU, vllm_gpu_memory_utilization decides.",
    )
    vllm_gpu_memory_utilization: float = Field(
        0.3, gt=0, le=1, description="GPU only: fraction of the device for the engine (weights + KV cache)."
    )
    vllm_max_num_seqs: int = Field(256, ge=1, description="Sequences the engine decodes at once.")
    vllm_enforce_eager: bool | None = Field(
        None, description="No CUDA graphs / torch.compile. Default: true on CPU (no warm-up), false on GPU."
    )
    vllm_enable_prefix_caching: bool = Field(
        True, description="Share the KV of a prompt's blocks among its samples; reset after every weight sync."
    )
    vllm_lora_sync: Literal["merge", "adapter"] = Field(
        "merge",
        description="LoRA: stream merged weights W + scale*B@A (merge) or hand the engine the adapter "
        "(adapter: vLLM's LoRA kernels, a fresh in-memory adapter id per sync).",
    )
    vllm_sleep_mode: bool = Field(
        True, description="GPU only: offload the engine's weights and free its KV cache while training."
    )


class EvalConfig(_Section):
    """The ``eval`` section: accuracy on the held-out split before and after GRPO (greedy decoding), and pass@k."""

    enabled: bool = Field(True, description="Run the evaluate stage.")
    max_samples: int | None = Field(None, ge=1, description="Evaluate at most this many held-out rows.")
    batch_size: int = Field(64, ge=1, description="Sequences per generate call.")
    max_new_tokens: int | None = Field(None, ge=1, description="Defaults to grpo.max_completion_length.")
    pass_k: list[int] = Field(
        default_factory=lambda: [1, 4],
        description="pass@k on the held-out split from num_samples completions per row sampled with grpo's "
        "temperature, top_p, top_k, min_p and repetition_penalty; [] samples nothing.",
    )
    num_samples: int | None = Field(
        None, ge=1, description="Completions sampled per row for pass@k (n >= max(pass_k)); defaults to max(pass_k)."
    )

    @field_validator("pass_k")
    @classmethod
    def _pass_k(cls, v: list[int]) -> list[int]:
        if any(k < 1 for k in v):
            raise ValueError(f"every k must be >= 1 (got {v})")
        return sorted(set(v))

    @model_validator(mode="after")
    def _samples(self) -> EvalConfig:
        if self.pass_k and self.num_samples is not None and self.num_samples < max(self.pass_k):
            raise ValueError(
                f"num_samples ({self.num_samples}) must be >= max(pass_k) ({max(self.pass_k)}): "
                "pass@k needs at least k samples per row"
            )
        return self

    @property
    def samples_per_row(self) -> int:
        """n of pass@k: num_samples, else max(pass_k); 0 when pass_k is empty."""
        if not self.pass_k:
            return 0
        return self.num_samples or max(self.pass_k)


class ExportConfig(_Section):
    """The ``export`` section: what the export stage writes from the trained model (the LoRA adapter, a merged
    model, GGUF files), logged to MLflow; the merged model is checked against the trained one."""

    enabled: bool = Field(True, description="Run the export stage.")
    adapter: bool = Field(True, description="Save the trained LoRA adapter (export/adapter); needs model.lora.enabled.")
    merged: bool = Field(
        True, description="Save a standalone model with the adapter merged into its base (export/merged)."
    )
    merged_dtype: Literal["float16", "bfloat16", "float32"] = Field(
        "float16", description="dtype of the merged model's weights."
    )
    verify_prompts: int = Field(
        4,
        ge=0,
        description="Verify the merged model on N eval prompts: per-token log-probs of the trained model's greedy "
        "completions, teacher-forced through both, within a tolerance per dtype (docs/export.md); 0: no check.",
    )
    gguf: list[Literal["f32", "f16", "bf16", "q8_0", "q4_k_m"]] = Field(
        default_factory=lambda: ["f16"],
        description="GGUF files of the merged model (export/gguf/model-<type>.gguf), for llama.cpp; [] for none. "
        "q4_k_m needs llama.cpp: llama-cpp-python (the llamacpp extra) or llama-quantize on PATH (else skipped with "
        "a warning).",
    )
    quantize_timeout_s: float = Field(
        1800.0,
        gt=0,
        description="Seconds llama-quantize may run for one GGUF type before it is stopped and the export fails "
        "naming the command (a 7B model takes a few minutes on a laptop).",
    )

    @model_validator(mode="after")
    def _gguf(self) -> ExportConfig:
        if self.gguf and not self.merged:
            raise ValueError("gguf converts the merged model: set merged: true, or gguf: []")
        return self

    @model_validator(mode="before")
    @classmethod
    def _default_gguf_follows_merged(cls, raw: Any) -> Any:
        """The default GGUF is made from the merged export: none when merged is off and gguf is not set."""
        if isinstance(raw, dict) and raw.get("merged") is False and "gguf" not in raw:
            return {**raw, "gguf": []}
        return raw


# the URI schemes MLflow 3 tracks and registers models with (postgresql+psycopg2 etc.: the part before '+')
TRACKING_SCHEMES = (
    "http",
    "https",
    "file",
    "sqlite",
    "postgresql",
    "mysql",
    "mssql",
    "databricks",
    "databricks-uc",
    "uc",
)
EXPERIMENT_ENV = "MLFLOW_EXPERIMENT_NAME"  # MLflow's own name for the default experiment


class TrackingConfig(_Section):
    """The ``tracking`` section: the MLflow store the runs are logged to, and the model registry."""

    uri: str | None = Field(
        None, description="MLflow tracking URI; default: $MLFLOW_TRACKING_URI, else sqlite:///<output_dir>/mlflow.db"
    )
    experiment: str = Field(
        "grpoflow",
        description="MLflow experiment the pipeline's runs are logged in. Not set in the config or overrides: "
        "$MLFLOW_EXPERIMENT_NAME when set (MLflow's convention, as HF and TRL follow it), else this default; a value "
        "set here wins over the variable.",
    )
    register_model: bool = Field(True, description="Register the exported model in the MLflow model registry.")
    registered_model: str | None = Field(None, description="Registered model name; default grpoflow-<model name>.")
    champion_alias: str = Field(
        "champion",
        description="Alias moved to a new version that beats the current holder: on the paired held-out comparison "
        "for a run that started from it (tracking.promotion_alpha), else on the recorded held-out accuracy.",
    )
    promotion_alpha: float = Field(
        0.05,
        gt=0,
        le=1,
        description="A run that started from the champion (a continuous cycle) takes the alias only when it answers "
        "more held-out rows right that the champion got wrong than the reverse, and an exact two-sided McNemar test "
        "on those rows gives p < this (tasks/tracking/promotion.py). Smaller: a larger gain needed.",
    )
    flush_timeout_s: float = Field(
        60.0,
        ge=0,
        description="At the end of each stage (and of the pipeline), how long to wait for buffered metrics, params "
        "and artifacts to reach the tracking server. What a server that still does not answer misses stays in "
        "<workspace>/tracking-journal; `grpoflow sync RUN_DIR` or `grpoflow resume` sends it (docs/tracking.md).",
    )
    request_timeout_s: float = Field(
        10.0,
        gt=0,
        description="Timeout of one request of the background sender to an http(s) tracking server (an artifact "
        "upload or download: MLflow's MLFLOW_HTTP_REQUEST_TIMEOUT, 120 s by default); it makes one try per request "
        "and backs off itself (1, 2, 4 ... 30 s) while the server does not answer. No request outlasts "
        "tracking.flush_timeout_s at a stage's end, nor `grpoflow sync --timeout`.",
    )

    @field_validator("uri")
    @classmethod
    def _uri_scheme(cls, v: str | None) -> str | None:
        """A scheme MLflow serves (its tracking and registry stores: mlflow.tracking._tracking_service.utils):
        'htp://...' otherwise failed the run with MLflow's traceback before the first stage."""
        if v is None or "://" not in v:
            return v  # a plain folder path, as MLflow takes it
        scheme = v.split("://", 1)[0].lower()
        if scheme.split("+", 1)[0] not in TRACKING_SCHEMES:
            raise ValueError(f"scheme {scheme!r} is no MLflow tracking store: one of {', '.join(TRACKING_SCHEMES)}")
        return v

    @field_validator("registered_model")
    @classmethod
    def _model_name(cls, v: str | None) -> str | None:
        """MLflow's rules for a registered model name (mlflow.utils.validation._validate_model_name), checked here:
        refused by the registry, the name failed the export stage, after training."""
        if v is None:
            return v
        norm = posixpath.normpath(v)
        if not v.strip() or "/" in v or ":" in v or norm != v or norm == "." or norm.startswith(".."):
            raise ValueError("no MLflow registered model name: not empty, no '/' or ':', no '.' or '..'")
        return v

    @field_validator("champion_alias")
    @classmethod
    def _alias(cls, v: str) -> str:
        """MLflow's rules for an alias (mlflow.utils.validation._validate_model_alias_name and _reserved): letters,
        digits, '_' and '-'; not 'latest' nor a version alias (v1, V2); otherwise the alias never moved (latest
        names the newest version) or the registry refused it after training."""
        if not v or len(v) > 255 or not re.fullmatch(r"[\w\-]+", v):
            raise ValueError("an MLflow alias may only hold letters, digits, '_' and '-' (1 to 255 of them)")
        if v.lower() == "latest" or re.fullmatch(r"[vV]\d+", v):
            raise ValueError("reserved by MLflow ('latest', and v<N> for version N)")
        return v

    @model_validator(mode="before")
    @classmethod
    def _experiment_from_env(cls, raw: Any) -> Any:
        """An experiment the config does not name comes from $MLFLOW_EXPERIMENT_NAME, the variable MLflow's fluent
        API, HF Trainer and TRL read; an explicit ``tracking.experiment`` wins. Resolved here, once, so run.json,
        the logged config and every process of a launch (which reads the resolved config back) agree on it."""
        env = os.environ.get(EXPERIMENT_ENV, "").strip()
        if env and isinstance(raw, dict) and raw.get("experiment") is None:
            return {**raw, "experiment": env}
        return raw


class PipelineConfig(_Section):
    run: RunConfig = Field(default_factory=RunConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    export: ExportConfig = Field(default_factory=ExportConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    @model_validator(mode="after")
    def _distributed(self) -> PipelineConfig:
        d = self.distributed
        if d.row_seeded and self.grpo.dynamic_sampling:
            raise ValueError(
                "grpo.dynamic_sampling with distributed (nproc_per_node * nnodes > 1, or seed_by_row): refilling a "
                "round with fresh prompts is not implemented over several processes yet; turn one of them off"
            )
        if d.launcher == "trainjob" and not self.run.output_dir.startswith("s3://"):
            raise ValueError(
                f"distributed.launcher=trainjob needs run.output_dir on S3 (s3://bucket/prefix, got "
                f"{self.run.output_dir!r}): the TrainJob's pods run on other nodes and share the workspace through it"
            )
        if d.world_size == 1:
            return self
        try:  # config_from_dict checks it in the grpo section already; this covers PipelineConfig.model_validate
            self.grpo.batching(d.world_size)
        except ValueError as e:  # the round does not split over the processes: TRL's formula, with the key
            raise ValueError(f"grpo on {d.world_size} processes (distributed.nproc_per_node * nnodes): {e}") from None
        if re.fullmatch(r"cuda:\d+", self.run.device):
            raise ValueError(
                f"run.device={self.run.device} with distributed (nproc_per_node * nnodes = {d.world_size}): each GRPO "
                "process takes the GPU of its LOCAL_RANK; use run.device=cuda (or auto) and choose the GPUs with "
                "CUDA_VISIBLE_DEVICES"
            )
        if d.strategy == "fsdp2" and self.grpo.optim in BNB_OPTIMIZERS:
            raise ValueError(
                f"grpo.optim={self.grpo.optim} with distributed.strategy=fsdp2: bitsandbytes' 8-bit optimizers fault "
                "on FSDP2's sharded (DTensor) parameters (bitsandbytes issue #1633, open); use grpo.optim=adamw_torch "
                "or distributed.strategy=ddp"
            )
        if d.strategy == "fsdp2" and self.model.load_in_4bit:
            raise ValueError(
                "distributed.strategy=fsdp2 cannot shard model.load_in_4bit (bitsandbytes) weights; use ddp"
            )
        if d.strategy == "fsdp2" and self.grpo.logprob_chunk_rows:
            raise ValueError(
                "grpo.logprob_chunk_rows with distributed.strategy=fsdp2: several forward passes of the sharded "
                "layers per step are not tested yet; use ddp or logprob_chunk_rows: 0"
            )
        if d.strategy == "fsdp2" and self.grpo.beta > 0 and not self.model.lora.enabled:
            raise ValueError(
                "distributed.strategy=fsdp2 with grpo.beta > 0 and full fine-tuning needs a sharded reference model, "
                "which is not implemented yet; use ddp, LoRA (the reference is the base without adapters) or beta 0"
            )
        return self

    @model_validator(mode="after")
    def _cross(self) -> PipelineConfig:
        if self.export.enabled and self.export.adapter and not self.model.lora.enabled:
            raise ValueError("export.adapter needs model.lora.enabled (full fine-tuning has no adapter)")
        if self.grpo.sync_ref_model and self.model.lora.enabled:
            raise ValueError(
                "grpo.sync_ref_model needs full fine-tuning (model.lora.enabled: false): with LoRA the reference is "
                "the base model with the adapter off, which is never trained (TRL 1.16 refuses it with PEFT too)"
            )
        if (self.data.format == "code" or self.data.source == "humaneval") and self.sft.enabled:
            raise ValueError(
                "sft.enabled: code rows (data.format code, data.source humaneval) have no SFT target, their answer "
                "is the tests; set sft.enabled: false"
            )
        if self.model.warm_start is not None and self.sft.enabled:
            raise ValueError(
                f"model.warm_start={self.model.warm_start}: GRPO starts from that folder, so SFT does not run; set "
                "sft.enabled: false"
            )
        if self.model.dtype == "float16":
            raise ValueError(
                "model.dtype=float16: GRPO and SFT in float16 needs a loss scaler, which grpoflow does not run (small "
                "gradients underflow to zero); use bfloat16 (GPUs from Ampere on) or float32"
            )
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def warm_started(self, folder: str) -> PipelineConfig:
        """This config with GRPO starting from the model folder ``folder`` (model.warm_start) and no SFT."""
        model = self.model.model_copy(update={"warm_start": folder})
        return self.model_copy(update={"model": model, "sft": self.sft.model_copy(update={"enabled": False})})


def resolve_eval_size(eval_size: float, n_rows: int) -> int:
    """A fraction (<1) of n_rows, at least 1, or an absolute count (>=1)."""
    n = max(1, math.floor(eval_size * n_rows)) if eval_size < 1 else int(eval_size)
    return min(n, n_rows - 1) if n_rows > 1 else 0
