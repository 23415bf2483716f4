"""Every user-facing setting, declared once with its documentation.

Sources, highest precedence first: environment (`ZT_*`), the mounted config file
(`ZT_CONFIG_FILE`; YAML, JSON or TOML), secret files (`/run/secrets`), defaults.
The CLI help and the settings tables (docs/configuration.md, README) are generated from the
descriptions here.
"""

from __future__ import annotations

import contextlib
import difflib
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)
from pydantic_settings.sources.utils import parse_env_vars

from zerotuner.errors import ConfigError
from zerotuner.settings.files import MAX_INT, load_mapping, parse_json, read_text, short_repr
from zerotuner.settings.video_windows import Windows, parse_windows

ENV_PREFIX = "ZT_"
DEFAULT_CONFIG_FILE = Path("/config/zerotuner.yaml")
DEFAULT_SECRETS_DIR = Path("/run/secrets")

# The environment the settings are read from: the process's, unless `load_settings` was given
# a mapping (the builder evaluates a form without touching the process's environment).
_ENVIRON: ContextVar[Mapping[str, str] | None] = ContextVar("zerotuner_environ", default=None)

Auto = Literal["auto"]
MIN_RESOLUTION, MAX_RESOLUTION = 64, 4096  # ZT_RESOLUTION and a datasets-file entry's own
# Every duration setting's ceiling: a year sits far inside what each consumer accepts
# (timedelta, threading's TIMEOUT_MAX and the C++ clocks behind gloo, NCCL and the TCPStore,
# ~292 years in nanoseconds); past those, a rank dies with OverflowError.
MAX_SECONDS = 365 * 24 * 3600
# Linux file systems' limits on one path part (NAME_MAX) and on a whole path (PATH_MAX - 1):
# past them every stat fails with ENAMETOOLONG.
NAME_MAX, PATH_MAX = 255, 4095
# The DDPM schedulers' num_train_timesteps (SD 1.x, 2.x, XL): ZT_TIMESTEP_RANGE must hold one.
DDPM_TIMESTEPS = 1000
OffloadTarget = Literal["auto", "none", "cpu", "nvme"]


class Settings(BaseSettings):
    """The whole configuration of one training job. Field order is the docs' order."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        case_sensitive=False,
        env_ignore_empty=True,  # `ZT_RESOLUTION=` (an uncommented example line) means default
        extra="forbid",
        frozen=True,
        validate_default=True,
        allow_inf_nan=False,  # every float setting: `inf`, `nan`, 1e400 are exit 2
    )

    # --- model and data ---------------------------------------------------------------
    model: str = Field(
        "stabilityai/stable-diffusion-xl-base-1.0",
        description="Hub id or local folder of a diffusers pipeline to fine-tune.",
    )
    # Its choices are the family registry's names (zerotuner.families, a layer above): checked
    # by families.known_family when the model is resolved; docs and the builder list them.
    model_family: str = Field(
        "auto",
        description="Model family; `auto` reads it from model_index.json / the model's config.",
    )
    data_dir: str = Field(
        "/data",
        description="Training images with captions: a folder, `s3://bucket/prefix` or "
        "`hf://datasets/owner/name` (fetched once per node into ZT_CACHE_DIR/datasets).",
    )
    datasets_file: Path | None = Field(
        None,
        description="Several datasets in one run (YAML, JSON or TOML; replaces ZT_DATA_DIR): "
        "each entry a `path` (folder or URL as ZT_DATA_DIR) with its own `repeats`, "
        "`caption_template`, `resolution`, `caption_extension` and, for parquet shards, "
        "`image_column` / `caption_column` / `control_column`.",
    )
    output_dir: Path = Field(
        Path("/output"), description="Checkpoints, samples, run records and the final export."
    )
    cache_dir: Path = Field(
        Path("/cache"), description="Model downloads (HF_HOME) and the latent/embedding cache."
    )
    offload_dir: Path = Field(
        Path("/offload"),
        description="NVMe offload swap directory (a fast local volume). Unset, a real "
        "`nvme_path` in the DeepSpeed/accelerate config is used instead; set, the two must agree.",
    )
    offload_device: str | None = Field(
        None, description="Block device to mount at the offload dir (needs a privileged container)."
    )
    offload_format: bool = Field(
        False, description="Allow formatting `ZT_OFFLOAD_DEVICE` when it holds no filesystem."
    )

    # --- training -----------------------------------------------------------------------
    resolution: int | None = Field(
        None,
        ge=MIN_RESOLUTION,
        le=MAX_RESOLUTION,
        description="Target side in pixels; empty = the family's native.",
    )
    train_batch_size: int = Field(1, ge=1, description="Micro-batch per device.")
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per step.")
    max_steps: int = Field(1000, ge=1, description="Optimizer steps to train.")
    learning_rate: float = Field(1e-5, gt=0, description="Peak learning rate.")
    lr_warmup_steps: int = Field(0, ge=0, description="Linear warm-up steps.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Shape after warm-up (DeepSpeed WarmupLR/WarmupDecayLR/Cosine)."
    )
    optimizer: str = Field(
        "AdamW",
        description="DeepSpeed's own (AdamW, Adam, Adagrad, Lion, Lamb, Muon) or a client "
        "optimizer: `prodigy` (finds its step size: ZT_LEARNING_RATE=1.0), "
        "`adamw_schedulefree` (no schedule; warm-up from ZT_LR_WARMUP_STEPS), `adamw8bit` "
        "(bitsandbytes: 2 bytes of state per parameter), `adafactor` (no first moment).",
    )
    weight_decay: float = Field(1e-2, ge=0, description="Optimizer weight decay.")
    prodigy_d_coef: float = Field(
        1.0, gt=0, description="Prodigy only: scales its estimated step size d (0.5-2 typical)."
    )
    prodigy_safeguard_warmup: bool = Field(
        False, description="Prodigy only: keep the LR warm-up out of d's estimate (set it "
        "with ZT_LR_WARMUP_STEPS).",
    )  # fmt: skip
    prodigy_use_bias_correction: bool = Field(
        False, description="Prodigy only: Adam's bias correction (smaller early steps)."
    )
    gradient_clipping: float = Field(1.0, ge=0, description="Max gradient norm; 0 disables.")
    max_nonfinite_steps: int = Field(
        5, ge=1, description="Steps in a row with a non-finite loss or gradient norm (each "
        "skipped, the weights unchanged) before the run stops with exit 4.",
    )  # fmt: skip
    mixed_precision: Literal["auto", "bf16", "fp16", "no"] = Field(
        "auto", description="`auto`: bf16 where the GPU supports it, else fp16; `no` on CPU."
    )
    gradient_checkpointing: Auto | bool = Field(
        "auto", description="Recompute activations; `auto` turns it on when needed to fit."
    )
    seed: int = Field(42, description="Random seed (data order, noise, validation).")
    noise_offset: float = Field(0.0, ge=0, description="Noise offset (0 disables).")
    snr_gamma: float | None = Field(
        None, gt=0, description="Min-SNR-gamma loss weighting (e.g. 5); empty disables."
    )
    prediction_type: Literal["auto", "epsilon", "v_prediction"] = Field(
        "auto", description="Training target; `auto` follows the model's scheduler (UNets)."
    )
    weighting_scheme: Literal["logit_normal", "uniform", "mode"] = Field(
        "logit_normal",
        description="Flow matching (SD3, Flux): the density sigmas are drawn from.",
    )
    logit_mean: float = Field(0.0, description="Flow matching, `logit_normal`: the mean.")
    logit_std: float = Field(1.0, gt=0, description="Flow matching, `logit_normal`: the std.")
    mode_scale: float = Field(1.29, description="Flow matching, `mode`: its scale.")
    timestep_range: str | None = Field(
        None,
        description="Train on part of the noise schedule only: `low-high` as fractions of it "
        "(0 clean, 1 pure noise), e.g. `0.0-0.5` (detail) or `0.5-1.0` (composition); the "
        "DDPM timesteps and the flow-matching sigmas alike. Empty: all of it.",
    )
    train_guidance: float = Field(
        3.5,
        ge=0,
        description="Flux: the guidance value a guidance-distilled transformer (FLUX.1-dev) "
        "trains with; unused by models without a guidance embedding.",
    )
    max_sequence_length: int | None = Field(
        None,
        ge=1,
        le=512,
        description="T5 tokens per caption (SD3, Flux); empty = the pipeline's default (SD3 "
        "256, Flux 512). Shorter: smaller text cache, faster steps.",
    )
    random_flip: bool = Field(False, description="Flip images horizontally at random.")
    caption_template: str | None = Field(
        None,
        description="Every caption through a template with `{caption}` once, e.g. `sks "
        "{caption}` (a trigger word) or `{caption}, in sks style`; cached as written. Empty: "
        "captions as read.",
    )
    caption_dropout: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Probability of training a sample on the empty caption (what classifier-"
        "free guidance needs; 0.05-0.1 is usual), decided per sample and epoch from ZT_SEED.",
    )
    min_image_size: int = Field(
        0,
        ge=0,
        description="Leave out images whose short side is below this many pixels (listed "
        "with the skipped files); 0 keeps all.",
    )
    upscale: bool = Field(
        True,
        description="Enlarge images smaller than their bucket to cover it; `false`: such an "
        "image trains at its own size (rounded down to the bucket step), in a bucket of its "
        "own shape.",
    )
    video_frames: int = Field(
        81,
        ge=1,
        le=1025,
        description="Video families (Wan): frames per training clip, sampled at ZT_VIDEO_FPS; "
        "the model's rule holds (Wan: 4k+1, e.g. 17, 33, 81). A shorter clip trains at the "
        "longest count it holds; an image is a one-frame clip.",
    )
    video_fps: float = Field(
        16.0,
        gt=0,
        le=240,
        description="Video families: the rate frames are sampled from a clip at (Wan 2.1 was "
        "trained at 16 fps, Wan 2.2 5B at 24).",
    )
    video_windows: str = Field(
        "head",
        description="Video families: which parts of a long clip train, each window "
        "ZT_VIDEO_FRAMES frames and an example of its own: `head` (one from the start), "
        "`uniform:N` (N spread over the clip) or `slide:S` (one every S sampled frames); a "
        "dataset's `video_windows` in ZT_DATASETS_FILE overrides it.",
    )
    expert: Literal["high", "low"] | None = Field(
        None,
        description="Wan 2.2 A14B (two expert transformers): the one this run trains, `high` "
        "(`transformer`, the noisy steps) or `low` (`transformer_2`, the clean ones), on its "
        "part of the noise schedule (the model's boundary_ratio); the export keeps the other "
        "as it was. Two runs train both. Empty: a model with one transformer.",
    )
    compile: Auto | bool = Field(
        "auto",
        description="torch.compile the model's repeated blocks; `auto` turns it on where it "
        "pays (see the plan's note). Off, nothing is compiled: the ranks set "
        "TORCHDYNAMO_DISABLE=1, so no library compiles either.",
    )
    ema: bool = Field(False, description="Keep an EMA of the UNet weights (on the CPU).")
    ema_decay: float = Field(0.9999, gt=0, lt=1, description="EMA decay per step.")
    training_type: Literal["full", "lora"] = Field(
        "full", description="`full`: train the whole UNet; `lora`: train LoRA adapters on it."
    )
    lora_rank: int = Field(16, ge=1, description="LoRA rank (training type `lora`).")
    lora_alpha: float | None = Field(
        None, gt=0, description="LoRA alpha (scale = alpha / rank); empty = the rank."
    )
    lora_dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA path.")
    lora_targets: str = Field(
        "attention",
        description="UNet modules that get adapters: `attention` (to_q, to_k, to_v, to_out.0, "
        "as diffusers' SDXL LoRA example), `attention+ff` (also the feed-forward layers), or "
        "module names and presets separated by commas.",
    )
    lora_dora: bool = Field(
        False,
        description="DoRA (peft's use_dora): each adapted layer also learns the magnitude of "
        "its weight's rows; at every ZeRO stage.",
    )
    lora_rslora: bool = Field(
        False,
        description="rsLoRA (peft's use_rslora): scale = alpha / sqrt(rank) instead of alpha / "
        "rank, so a higher rank does not shrink the update.",
    )
    lora_init: Literal["gaussian", "pissa", "olora"] = Field(
        "gaussian",
        description="How the adapter starts: `gaussian` (A random, B zero: at the base model), "
        "or from the base weights' principal components (`pissa`: SVD) or an orthonormal "
        "basis (`olora`: QR), which move them into the adapter; ZeRO 0-2, linear targets.",
    )
    lora_from: str | None = Field(
        None,
        description="Train on from an existing adapter file (a `.safetensors` in the "
        "diffusers, kohya or ComfyUI layout, for this model: a path, `s3://bucket/key` or "
        "`hf://owner/repo[@revision]/path`, fetched into ZT_CACHE_DIR before the ranks start): "
        "its rank, alpha and targets are the run's, its weights the adapter's start; a resume "
        "starts from its checkpoint instead.",
    )
    lora_merge: bool = Field(
        False,
        description="Also write `final/merged/`: a whole diffusers pipeline with the adapter "
        "fused into the UNet.",
    )
    lora_text_encoder: bool = Field(
        False,
        description="Also train adapters on the text encoders' attention (q/k/v/out_proj, as "
        "diffusers' SDXL DreamBooth LoRA example); captions are then encoded at every step, "
        "not cached.",
    )
    base_precision: Literal["auto", "fp8", "int8"] = Field(
        "auto",
        description="LoRA: how the frozen base's weights are stored: `auto` at the run's "
        "precision; `fp8` (e4m3) or `int8`, each with a scale per output channel (torchao's "
        "weight-only storage), upcast layer by layer for the matmul: the blocks' Linear "
        "layers take about half the bytes of bf16 (norms, embedders, the first and last "
        "layers keep the run's precision). The adapter trains at the run's precision; ZeRO "
        "0-2.",
    )
    text_encoder_precision: Literal["auto", "fp8", "int8"] = Field(
        "auto",
        description="How the text encoders that cache the captions are stored: `auto` at the "
        "run's precision; `fp8` or `int8` as `ZT_BASE_PRECISION` stores the base (their "
        "repeated blocks' Linear layers in 8 bits, upcast per matmul). It changes the cached "
        "captions, so they are cached apart from the full-precision ones. Samples encode their "
        "prompts at full precision; not with `ZT_LORA_TEXT_ENCODER` (encoders that train).",
    )

    # --- DeepSpeed ------------------------------------------------------------------------
    zero_stage: Auto | Literal[0, 1, 2, 3] = Field(
        "auto", description="ZeRO stage 0-3; `auto` picks the lowest that fits."
    )
    offload_optimizer: OffloadTarget = Field(
        "auto", description="Optimizer state offload: none, cpu or nvme (nvme needs stage 3)."
    )
    offload_param: OffloadTarget = Field(
        "auto", description="Parameter offload (stage 3 only): none, cpu or nvme."
    )
    offload_activations: Literal["auto", "none", "cpu"] = Field(
        "auto",
        description="Video families (Wan): with gradient checkpointing, keep each block's "
        "saved input in host memory, not on the GPU, copied back when the backward recomputes "
        "the block; `auto` turns it on where the plan needs it to fit.",
    )
    deepspeed_config: Annotated[str | dict[str, Any] | None, NoDecode] = Field(
        None, description="A DeepSpeed JSON (inline text or a file path) to start from."
    )
    accelerate_config: Path | None = Field(
        None, description="An `accelerate config` YAML to start from."
    )

    # --- devices and launch -----------------------------------------------------------------
    device: Literal["auto", "cuda", "cpu"] = Field(
        "auto", description="Accelerator; `auto` uses CUDA GPUs when present."
    )
    num_processes: int | None = Field(
        None, ge=1, description="Ranks per node; empty = visible GPUs (1 on CPU)."
    )
    nnodes: int | None = Field(None, ge=1, description="Nodes in the job; empty = detected / 1.")
    node_rank: int | None = Field(None, ge=0, description="This node's index; empty = detected.")
    master_addr: str | None = Field(None, description="Rendezvous host of node 0.")
    master_port: int | None = Field(None, ge=1, le=65535, description="Rendezvous port.")

    # --- checkpoints, validation ----------------------------------------------------------------
    checkpoint_every_steps: int = Field(500, ge=0, description="Checkpoint interval; 0 = end only.")
    checkpoints_keep: int = Field(2, ge=1, description="Committed checkpoints to keep.")
    resume: str = Field(
        "auto", description="`auto` (latest committed checkpoint), `never`, or a checkpoint path."
    )
    stop_grace_seconds: float = Field(
        300,
        gt=0,
        le=MAX_SECONDS,
        description="After SIGTERM, seconds ranks get to save and commit before they are killed "
        "(Kubernetes' terminationGracePeriodSeconds must be larger).",
    )
    push_to: str | None = Field(
        None,
        description="Remote for checkpoints, the final export and run records: `s3://bucket/"
        "prefix` (any S3-compatible store; AWS_* variables) or `hf://user/repo` (a private Hub "
        "model repo); a fresh machine resumes from it. Empty: outputs stay in ZT_OUTPUT_DIR.",
    )
    validation_prompts: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="Prompts for sample images: a JSON list or `|`-separated."
    )
    validation_images: str | None = Field(
        None,
        description="Input images of the samples of a model that samples from one (Wan "
        "image-to-video: the first frame; FLUX.1 Kontext, Qwen-Image-Edit: the image to edit): "
        "comma-separated paths, one per validation prompt or one for all (relative: under "
        "ZT_DATA_DIR), or a JSON list whose entries may be lists, a prompt's several "
        'references (Qwen-Image-Edit Plus, FLUX.2): `[["a.png", "b.png"], "c.png"]`; empty = '
        "the first training clip's first frame (an edit model: the first pair's control "
        "images).",
    )
    validation_every_steps: int = Field(0, ge=0, description="Sample interval; 0 = end only.")
    validation_inference_steps: int = Field(20, ge=1, description="Denoising steps per sample.")
    validation_guidance_scale: float | None = Field(
        None, ge=0, description="Classifier-free guidance of the samples; empty = the pipeline's."
    )
    eval_data_dir: str | None = Field(
        None,
        description="Held-out images for an evaluation loss, never trained on: a folder or a URL "
        "as ZT_DATA_DIR takes (captions likewise).",
    )
    eval_fraction: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Instead of ZT_EVAL_DATA_DIR: this share of the training images held out "
        "for the evaluation loss (chosen by ZT_SEED) and never trained on.",
    )
    eval_every_steps: int = Field(
        0,
        ge=0,
        description="Held-out loss interval (fixed noise and timestep per image: comparable "
        "from one evaluation to the next); 0 = end only.",
    )
    early_stop_patience: int = Field(
        0,
        ge=0,
        description="Stop after this many evaluations without a held-out loss lower than the "
        "best by more than ZT_EARLY_STOP_MIN_DELTA, exporting the best evaluated step (each new "
        "best is checkpointed and kept); 0 disables.",
    )
    early_stop_min_delta: float = Field(
        0.0, ge=0, description="How much lower the held-out loss must be to count as better."
    )

    # --- observability ----------------------------------------------------------------------------
    metrics_host: str = Field("0.0.0.0", description="Address the metrics endpoint binds.")
    metrics_port: int = Field(
        9464, ge=0, le=65535, description="/metrics, /healthz, /readyz; 0 disables."
    )
    hang_timeout_seconds: float = Field(
        1800,
        gt=0,
        le=MAX_SECONDS,
        description="/healthz fails when no step finished for this long.",
    )
    collective_timeout_seconds: float = Field(
        600,
        gt=0,
        le=MAX_SECONDS,
        description="How long a rank waits in a collective (barrier, all-reduce) of the process "
        "group before failing (gloo raises; NCCL's watchdog aborts the communicator and the "
        "process: TORCH_NCCL_ASYNC_ERROR_HANDLING=1). Keep it below ZT_HANG_TIMEOUT_SECONDS, so "
        "a stuck collective fails with its own exit before the liveness probe restarts the pod. "
        "Caching waits do not depend on it: ranks waiting for the encoding rank wait as long as "
        "it keeps working.",
    )
    peer_timeout_seconds: float = Field(
        60,
        gt=0,
        le=MAX_SECONDS,
        description="Multi-node: a node whose ranks give no sign of life (a heartbeat each "
        "second in torchrun's store) for this long is lost; the other nodes stop with exit 200 "
        "(retryable) and one line naming it. A node that is killed is noticed at its first "
        "failed collective, within seconds.",
    )
    log_format: Literal["text", "json"] = Field("text", description="Log line format.")
    log_level: Literal["debug", "info", "warning"] = Field(
        "info",
        description="`info`: progress from rank 0, warnings from every rank; `debug`: every "
        "rank's debug lines, the third-party notices held back included.",
    )
    log_every_steps: int = Field(10, ge=1, description="Progress line interval without a TTY.")
    notify_url: SecretStr | None = Field(
        None,
        description="Where to tell the run's start, checkpoints, samples, finish and failures: "
        "Discord or Slack webhook URLs, any apprise URL (ntfy://, tgram://, mailto://, ...), or "
        "an http(s) URL for a JSON POST; several separated by spaces. A secret (never printed; "
        "the secret file `notify_url` works). Sent by node 0's entrypoint, never slowing a step.",
    )
    notify_timeout_seconds: float = Field(
        10, gt=0, le=300, description="Bound of one notification's delivery try (3 tries)."
    )
    report_to: Annotated[list[Literal["tensorboard", "wandb"]], NoDecode] = Field(
        default_factory=list,
        description="Experiment trackers mirroring rank 0's step log, learning rate, memory and "
        "samples: `tensorboard` (event files in ZT_OUTPUT_DIR/run/tensorboard/), `wandb` "
        "(Weights & Biases; ZT_WANDB_MODE); comma-separated; empty or `none`: none.",
    )
    wandb_project: str = Field("zerotuner", min_length=1, description="W&B project of the run.")
    wandb_mode: Literal["auto", "online", "offline"] = Field(
        "auto",
        description="W&B: `online` needs an API key (WANDB_API_KEY or the secret file "
        "`wandb_api_key`); `offline` writes ZT_OUTPUT_DIR/run/wandb/ for `wandb sync`; `auto`: "
        "online with a key, offline without.",
    )

    # --- files and secrets ---------------------------------------------------------------------
    config_file: Path = Field(
        DEFAULT_CONFIG_FILE, description="Config file (YAML, JSON or TOML), read when present."
    )
    secrets_dir: Path = Field(
        DEFAULT_SECRETS_DIR, description="Folder of secret files (e.g. `hf_token`)."
    )
    hf_token: SecretStr | None = Field(
        None,
        validation_alias=AliasChoices("zt_hf_token", "hf_token"),
        description="Hugging Face token (env `HF_TOKEN` or a secret file `hf_token`).",
    )
    wandb_api_key: SecretStr | None = Field(
        None,
        validation_alias=AliasChoices("zt_wandb_api_key", "wandb_api_key"),
        description="W&B API key (env `WANDB_API_KEY` or a secret file `wandb_api_key`).",
    )

    @field_validator("*")
    @classmethod
    def _int64(cls, value: Any) -> Any:
        """Every whole-number setting fits 64 bits (10**400 steps or seed overflow later)."""
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_INT:
            raise PydanticCustomError("int_too_large", "Input should be a number below 2**63")
        return value

    @field_validator("report_to", mode="before")
    @classmethod
    def _split_trackers(cls, value: Any) -> Any:
        if isinstance(value, str):
            names = [n.strip().lower() for n in value.split(",") if n.strip()]
            return [n for n in names if n != "none"]
        return value

    @field_validator("validation_prompts", mode="before")
    @classmethod
    def _split_prompts(cls, value: Any) -> Any:
        if isinstance(value, str):
            text = value.strip()
            if text.startswith("["):
                try:  # the shared reader: depth, duplicate and number limits included
                    return parse_json(text, source="JSON")
                except ConfigError as error:
                    raise PydanticCustomError(
                        "json_invalid",
                        "a JSON list of prompts or `|`-separated text ({why})",
                        {"why": str(error)},
                    ) from None
            return [p.strip() for p in text.split("|") if p.strip()]
        return value

    @field_validator("validation_images")
    @classmethod
    def _image_list(cls, value: str | None) -> str | None:
        try:
            _image_groups(value)
        except ConfigError as error:
            raise PydanticCustomError(
                "json_invalid",
                "comma-separated paths or a JSON list of paths and lists of paths ({why})",
                {"why": str(error)},
            ) from None
        return value

    @field_validator("data_dir", "eval_data_dir", mode="before")
    @classmethod
    def _folder_or_url(cls, value: Any) -> Any:
        """A folder (a Path is fine) or an s3:// / hf://datasets/ URL, kept as text: a Path
        would fold the URL's `//`."""
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("eval_fraction")
    @classmethod
    def _one_eval_source(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and info.data.get("eval_data_dir"):
            raise PydanticCustomError(
                "eval_source",
                "no fraction while ZT_EVAL_DATA_DIR is set: the held-out images are one or the "
                "other (unset one of them)",
            )
        return value

    @field_validator("early_stop_patience")
    @classmethod
    def _patience_needs_eval(cls, value: int, info: ValidationInfo) -> int:
        held_out = info.data.get("eval_data_dir") or info.data.get("eval_fraction")
        if value and not (held_out and info.data.get("eval_every_steps")):
            raise PydanticCustomError(
                "early_stop",
                "0 (off) unless held-out images are evaluated during the run: set "
                "ZT_EVAL_DATA_DIR or ZT_EVAL_FRACTION, and ZT_EVAL_EVERY_STEPS above 0",
            )
        return value

    @field_validator("zero_stage", mode="before")
    @classmethod
    def _stage_number(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().isdigit():
            return int(value)
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    @field_validator("push_to")
    @classmethod
    def _remote_url(cls, value: str | None) -> str | None:
        from zerotuner.settings.push_url import parse

        if value is None or not value.strip():
            return None
        parse(value.strip())  # one line naming the setting and both forms when malformed
        return value.strip()

    @field_validator("lora_from", mode="before")
    @classmethod
    def _adapter_file(cls, value: Any) -> Any:
        """A path kept as text (a Path would fold an `hf://` URL's `//`, which the refusal
        names); empty is unset."""
        text = os.fspath(value).strip() if isinstance(value, (str, os.PathLike)) else value
        return text or None

    @field_validator("video_windows")
    @classmethod
    def _windows(cls, value: str) -> str:
        return str(_windows(value))

    @field_validator("resume")
    @classmethod
    def _resume_word_or_path(cls, value: str) -> str:
        return value.strip() or "auto"

    @property
    def timesteps(self) -> tuple[float, float]:
        """ZT_TIMESTEP_RANGE as (low, high) fractions of the noise schedule, (0, 1) when unset:
        the objectives and Wan's experts read the numbers, never the text (a property, so a
        `model_copy(update=...)` cannot leave it stale)."""
        return (_fractions(self.timestep_range) if self.timestep_range else None) or (0.0, 1.0)

    @property
    def validation_image_paths(self) -> list[list[Path]]:
        """ZT_VALIDATION_IMAGES's paths, per prompt (each prompt's one image, or its several
        references), a relative one under ZT_DATA_DIR when that is a local folder."""
        data = self.data_dir
        root = Path(data) if data and "://" not in data else None

        def path(name: str) -> Path:
            return Path(name) if Path(name).is_absolute() or root is None else root / name

        return [[path(n) for n in names] for names in _image_groups(self.validation_images)]

    @property
    def windows(self) -> Windows:
        """ZT_VIDEO_WINDOWS parsed (validated when the settings were read)."""
        return parse_windows(self.video_windows)

    @field_validator("timestep_range")
    @classmethod
    def _fraction_range(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        low, high = _fractions(value) or (1.0, 0.0)
        # as the DDPM loss maps it (families/ddpm.py): a low that rounds to timestep 1000 of
        # 0-999 holds none, and step 1 would fail with an IndexError
        if not 0 <= low < high <= 1 or round(low * DDPM_TIMESTEPS) >= DDPM_TIMESTEPS:
            raise PydanticCustomError(
                "timestep_range",
                "two fractions of the noise schedule, `low-high` with 0 <= low < high <= 1 and "
                "low below {top}, so that it holds one of the schedule's {steps} timesteps "
                "(e.g. `0.0-0.5`: the less noisy half)",
                {"top": 1 - 0.5 / DDPM_TIMESTEPS, "steps": DDPM_TIMESTEPS},
            )
        return f"{low:g}-{high:g}"

    @field_validator("model", "data_dir", "output_dir", "cache_dir", "offload_dir")
    @classmethod
    def _path_fits(cls, value: Any) -> Any:
        """A folder the file systems cannot name is one line here, not an ENAMETOOLONG
        traceback at its first use (an s3:// or hf:// URL's parts name no local file; the
        files read, as ZT_CONFIG_FILE, say so when they are opened)."""
        text = "" if value is None else os.fspath(value)
        if "://" in text:
            return value
        longest = max((_byte_length(part) for part in text.split("/")), default=0)
        if longest > NAME_MAX or _byte_length(text) > PATH_MAX:
            raise PydanticCustomError(
                "path_too_long",
                "a path of at most {whole} bytes, each part (folder or file name) at most "
                "{part} bytes, as file systems allow (its longest part has {longest})",
                {"whole": PATH_MAX, "part": NAME_MAX, "longest": longest},
            )
        return value

    @field_validator("caption_template")
    @classmethod
    def _one_caption_slot(cls, value: str | None) -> str | None:
        if value is None or not value.strip():
            return None
        if value.count("{caption}") != 1:
            raise PydanticCustomError(
                "caption_template",
                "text with {slot} exactly once, where each caption goes (e.g. `sks {slot}` or "
                "`{slot}, in sks style`)",
                {"slot": "{caption}"},
            )
        return value.strip()

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (
            init_settings,
            MappingEnvSource(settings_cls),
            ConfigFileSource(settings_cls),
            SecretsDirSource(settings_cls),
        )


def env_name(field: str) -> str:
    return ENV_PREFIX + field.upper()


def _image_groups(text: str | None) -> list[list[str]]:
    """ZT_VALIDATION_IMAGES's names per prompt: comma-separated (one each), or a JSON list whose
    entries are a name or a list of names (one prompt's references)."""
    text = (text or "").strip()
    if not text.startswith("["):
        return [[n.strip()] for n in text.split(",") if n.strip()]
    listed = parse_json(text, source="JSON")  # the shared reader: depth and size limits
    groups = (
        [e if isinstance(e, list) else [e] for e in listed] if isinstance(listed, list) else None
    )
    if groups is None or not all(
        group and all(isinstance(n, str) and n.strip() for n in group) for group in groups
    ):
        raise ConfigError("a list whose entries are a path or a non-empty list of paths")
    return [[n.strip() for n in group] for group in groups]


FRACTIONS = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*-\s*(\d+(?:\.\d*)?|\.\d+)\s*$")


def _fractions(value: str) -> tuple[float, float] | None:
    """`low-high` as two numbers, else None: ZT_TIMESTEP_RANGE's one parser."""
    match = FRACTIONS.match(value)
    return (float(match[1]), float(match[2])) if match else None


def _byte_length(text: str) -> int:
    """Bytes as the OS sees the name (undecodable bytes kept as one each)."""
    try:
        return len(os.fsencode(text))
    except UnicodeEncodeError:  # a lone surrogate from a config file: no name the OS takes
        return len(text.encode("utf-8", "surrogatepass"))


def precision_name(value: str) -> str:
    """How a precision reads in text: the setting's `no` (no mixed precision) is fp32."""
    return "fp32" if value == "no" else value


def source_key(name: str) -> str:
    """The key the env source files a field's value under: its first alias when it has any.

    The config file and the secrets dir must use the same key, so that their value merges
    with the env's (lower precedence) instead of sitting beside it as an unknown setting.
    """
    alias = Settings.model_fields[name].validation_alias
    if isinstance(alias, AliasChoices) and isinstance(alias.choices[0], str):
        return alias.choices[0]
    return alias if isinstance(alias, str) else name


def field_of(key: str) -> str:
    """The field a source key or an alias names (`zt_hf_token` -> `hf_token`)."""
    for name, field in Settings.model_fields.items():
        alias = field.validation_alias
        choices: Sequence[object] = alias.choices if isinstance(alias, AliasChoices) else (alias,)
        if key == name or key.lower() in {c.lower() for c in choices if isinstance(c, str)}:
            return name
    return key


def _is_secret(name: str) -> bool:
    field = Settings.model_fields.get(name)
    return field is not None and field.annotation == SecretStr | None


def reading_environ() -> Mapping[str, str]:
    """The environment settings are being read from (see `load_settings`)."""
    environ = _ENVIRON.get()
    return os.environ if environ is None else environ


class MappingEnvSource(EnvSettingsSource):
    """pydantic-settings' env source, reading `reading_environ()` instead of os.environ."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        return parse_env_vars(
            reading_environ(), self.case_sensitive, self.env_ignore_empty, self.env_parse_none_str
        )


def _path_from_env(name: str, default: Path) -> Path:
    return Path(reading_environ().get(env_name(name)) or default)


@contextlib.contextmanager
def file_errors(setting: str, path: Path) -> Iterator[None]:
    """A path the OS refuses (a name too long, a symlink loop, an I/O error, a NUL byte) as
    one clear line: `files.read_text` names only the common cases."""
    if "\x00" in str(path):
        raise ConfigError(f"{setting}: the path contains a NUL byte")
    try:
        yield
    except OSError as exc:
        raise ConfigError(f"{setting}={path}: cannot read it: {exc.strerror or exc}") from None


class ConfigFileSource(PydanticBaseSettingsSource):
    """The mounted config file. Keys are field names (`max_steps`) or env names."""

    def __call__(self) -> dict[str, Any]:
        path = _path_from_env("config_file", DEFAULT_CONFIG_FILE)
        setting = env_name("config_file")
        with file_errors(setting, path):
            exists = path.exists()
        if not exists:
            if setting in reading_environ():
                raise ConfigError(f"{setting}={path}: no such file")
            return {}
        with file_errors(setting, path):
            data = load_mapping(path, setting=setting)
        known = set(self.settings_cls.model_fields) | {"hf_token"}
        out: dict[str, Any] = {}
        for key, value in data.items():
            if not isinstance(key, str):
                raise ConfigError(f"{path}: setting names must be text, got {key!r}")
            name = key.lower().removeprefix(ENV_PREFIX.lower())
            if name not in known:
                hint = did_you_mean(name, known)
                raise ConfigError(f"{path}: unknown setting '{key}'{hint}")
            out[source_key(name)] = value
        return out

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError  # __call__ reads the whole file at once


class SecretsDirSource(PydanticBaseSettingsSource):
    """Secret files as Docker and Kubernetes mount them: `/run/secrets/hf_token`.

    Only fields declared as secrets are read, so a stray file there cannot change a setting.
    """

    def __call__(self) -> dict[str, Any]:
        folder = _path_from_env("secrets_dir", DEFAULT_SECRETS_DIR)
        out: dict[str, Any] = {}
        for name, field in self.settings_cls.model_fields.items():
            if field.annotation != SecretStr | None:
                continue
            for candidate in (name, name.upper(), env_name(name), env_name(name).lower()):
                path = folder / candidate
                with file_errors(env_name("secrets_dir"), path):
                    if not path.is_file():
                        continue
                    # the shared reader: size-capped, and its errors never show the content
                    text = read_text(path, setting=env_name("secrets_dir"))
                    out[source_key(name)] = text.strip()
                break
        return out

    def get_field_value(self, field: Any, field_name: str) -> tuple[Any, str, bool]:
        raise NotImplementedError


def did_you_mean(name: str, known: Iterable[str]) -> str:
    match = difflib.get_close_matches(name, sorted(known), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def unknown_env_names(environ: Mapping[str, str] | None = None) -> list[tuple[str, str, bool]]:
    """`ZT_*` variables that name no setting: (name, hint, looks_like_a_typo).

    pydantic-settings ignores them silently. A near miss of a real name is a typo (an error);
    anything else (e.g. Kubernetes' `ZT_SERVICE_HOST` for a Service called `zt`) is a warning.
    """
    environ = reading_environ() if environ is None else environ
    known = {env_name(n) for n in Settings.model_fields} | {"ZT_HF_TOKEN"}
    found = []
    for key in sorted(environ):
        upper = key.upper()
        if not upper.startswith(ENV_PREFIX) or upper in known:
            continue
        close = difflib.get_close_matches(upper, sorted(known), n=1, cutoff=0.85)
        hint = did_you_mean(upper, known)
        found.append((key, hint, bool(close)))
    return found


def format_validation_error(error: ValidationError) -> list[str]:
    """One line per setting, naming the env variable, the value and what is valid.

    A union (`auto` or 0-3) fails once per member: those are merged into one line.
    """
    by_field: dict[str, tuple[Any, list[str]]] = {}
    for item in error.errors():
        loc = [str(p) for p in item.get("loc", ()) if not isinstance(p, int)]
        field = field_of(loc[0]) if loc else "?"
        if item.get("type") == "extra_forbidden":
            hint = did_you_mean(field, Settings.model_fields)
            by_field[field] = (None, [f"unknown setting{hint}"])
            continue
        msg = item.get("msg", "invalid").removeprefix("Input should be ")
        value, msgs = by_field.setdefault(field, (item.get("input"), []))
        if msg not in msgs:
            msgs.append(msg)
    lines = []
    for field, (value, msgs) in by_field.items():
        name = env_name(field) if field in Settings.model_fields else field
        if msgs and msgs[0].startswith("unknown setting"):
            lines.append(f"'{field}': {msgs[0]}")
            continue
        shown = "***" if _is_secret(field) else short_repr(value)
        lines.append(f"{name}={shown}: expected {' or '.join(msgs)}")
    return lines


def load_settings(environ: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
    """Read every source; raise ConfigError with one line per problem. `environ`: the
    variables to read instead of the process's (its config file and secrets folder too)."""
    token = _ENVIRON.set(environ)
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise ConfigError("invalid settings", problems=format_validation_error(exc)) from None
    finally:
        _ENVIRON.reset(token)


def explicit_fields(settings: Settings) -> set[str]:
    """Fields the user set in any source (not defaults): these override raw DeepSpeed/accelerate."""
    return set(settings.model_fields_set)


def masked_dump(settings: Settings) -> dict[str, Any]:
    """The settings as JSON-able data with secrets masked, for logs and run records."""
    data = settings.model_dump(mode="json")
    for name, field in Settings.model_fields.items():
        if field.annotation == SecretStr | None and data.get(name) is not None:
            data[name] = "***"
    return data


def _windows(text: str) -> Windows:
    """ZT_VIDEO_WINDOWS (or a dataset's) parsed; pydantic's one-line error otherwise."""
    try:
        return parse_windows(text)
    except ValueError as error:
        raise PydanticCustomError("video_windows", "{why}", {"why": str(error)}) from None
