"""The public surface, pinned: renaming a setting, metric, command or exit code is deliberate.

Adding a name means adding it here too; removing or renaming one breaks users' scripts,
Kubernetes manifests and dashboards, so this test makes that a conscious act.
"""

from __future__ import annotations

from zerotuner import errors
from zerotuner.cli import COMMANDS
from zerotuner.monitor import metrics
from zerotuner.publish import push
from zerotuner.settings.schema import Settings, env_name

SETTINGS = [
    "ZT_MODEL", "ZT_MODEL_FAMILY", "ZT_DATA_DIR", "ZT_DATASETS_FILE", "ZT_OUTPUT_DIR",
    "ZT_CACHE_DIR",
    "ZT_OFFLOAD_DIR", "ZT_OFFLOAD_DEVICE", "ZT_OFFLOAD_FORMAT", "ZT_RESOLUTION",
    "ZT_TRAIN_BATCH_SIZE", "ZT_GRADIENT_ACCUMULATION_STEPS", "ZT_MAX_STEPS",
    "ZT_LEARNING_RATE", "ZT_LR_WARMUP_STEPS", "ZT_LR_SCHEDULER", "ZT_OPTIMIZER",
    "ZT_WEIGHT_DECAY", "ZT_PRODIGY_D_COEF", "ZT_PRODIGY_SAFEGUARD_WARMUP",
    "ZT_PRODIGY_USE_BIAS_CORRECTION", "ZT_GRADIENT_CLIPPING", "ZT_MAX_NONFINITE_STEPS",
    "ZT_MIXED_PRECISION",
    "ZT_GRADIENT_CHECKPOINTING", "ZT_SEED", "ZT_NOISE_OFFSET", "ZT_SNR_GAMMA",
    "ZT_PREDICTION_TYPE", "ZT_WEIGHTING_SCHEME", "ZT_LOGIT_MEAN", "ZT_LOGIT_STD",
    "ZT_MODE_SCALE", "ZT_TIMESTEP_RANGE", "ZT_TRAIN_GUIDANCE", "ZT_MAX_SEQUENCE_LENGTH",
    "ZT_RANDOM_FLIP",
    "ZT_CAPTION_TEMPLATE", "ZT_CAPTION_DROPOUT", "ZT_MIN_IMAGE_SIZE", "ZT_UPSCALE",
    "ZT_VIDEO_FRAMES", "ZT_VIDEO_FPS", "ZT_VIDEO_WINDOWS", "ZT_EXPERT", "ZT_COMPILE", "ZT_EMA",
    "ZT_EMA_DECAY",
    "ZT_TRAINING_TYPE",
    "ZT_LORA_RANK", "ZT_LORA_ALPHA", "ZT_LORA_DROPOUT", "ZT_LORA_TARGETS", "ZT_LORA_DORA",
    "ZT_LORA_RSLORA", "ZT_LORA_INIT", "ZT_LORA_FROM", "ZT_LORA_MERGE", "ZT_LORA_TEXT_ENCODER",
    "ZT_BASE_PRECISION", "ZT_TEXT_ENCODER_PRECISION", "ZT_ZERO_STAGE",
    "ZT_OFFLOAD_OPTIMIZER", "ZT_OFFLOAD_PARAM", "ZT_OFFLOAD_ACTIVATIONS", "ZT_DEEPSPEED_CONFIG",
    "ZT_ACCELERATE_CONFIG",
    "ZT_DEVICE", "ZT_NUM_PROCESSES", "ZT_NNODES", "ZT_NODE_RANK", "ZT_MASTER_ADDR",
    "ZT_MASTER_PORT", "ZT_CHECKPOINT_EVERY_STEPS", "ZT_CHECKPOINTS_KEEP", "ZT_RESUME",
    "ZT_STOP_GRACE_SECONDS", "ZT_PUSH_TO", "ZT_VALIDATION_PROMPTS", "ZT_VALIDATION_IMAGES",
    "ZT_VALIDATION_EVERY_STEPS",
    "ZT_VALIDATION_INFERENCE_STEPS", "ZT_VALIDATION_GUIDANCE_SCALE", "ZT_EVAL_DATA_DIR",
    "ZT_EVAL_FRACTION", "ZT_EVAL_EVERY_STEPS", "ZT_EARLY_STOP_PATIENCE", "ZT_EARLY_STOP_MIN_DELTA",
    "ZT_METRICS_HOST",
    "ZT_METRICS_PORT",
    "ZT_HANG_TIMEOUT_SECONDS", "ZT_COLLECTIVE_TIMEOUT_SECONDS", "ZT_PEER_TIMEOUT_SECONDS",
    "ZT_LOG_FORMAT", "ZT_LOG_LEVEL",
    "ZT_LOG_EVERY_STEPS", "ZT_NOTIFY_URL", "ZT_NOTIFY_TIMEOUT_SECONDS", "ZT_REPORT_TO",
    "ZT_WANDB_PROJECT", "ZT_WANDB_MODE", "ZT_CONFIG_FILE",
    "ZT_SECRETS_DIR", "ZT_HF_TOKEN", "ZT_WANDB_API_KEY",
]  # fmt: skip

# The metric names of the public interface (the catalog's `contract` ones); the catalog may add
# more but never drop one of these.
DESIGN_METRICS = {
    "zerotuner_step_duration_seconds", "zerotuner_steps_total", "zerotuner_samples_total",
    "zerotuner_loss", "zerotuner_learning_rate", "zerotuner_device_memory_allocated_bytes",
    "zerotuner_device_memory_reserved_bytes", "zerotuner_device_memory_peak_bytes",
    "zerotuner_device_memory_total_bytes", "zerotuner_host_memory_rss_bytes",
    "zerotuner_offload_dir_used_bytes", "zerotuner_offload_dir_free_bytes",
    "zerotuner_checkpoint_duration_seconds", "zerotuner_last_checkpoint_step",
    "zerotuner_last_step_timestamp_seconds", "zerotuner_dataset_skipped_files_total",
    "zerotuner_info",
}  # fmt: skip


def test_setting_names_are_pinned():
    assert [env_name(name) for name in Settings.model_fields] == SETTINGS


def test_every_design_setting_exists():
    design = """ZT_MODEL ZT_MODEL_FAMILY ZT_DATA_DIR ZT_OUTPUT_DIR ZT_OFFLOAD_DIR ZT_OFFLOAD_DEVICE
    ZT_CACHE_DIR ZT_RESOLUTION ZT_TRAIN_BATCH_SIZE ZT_GRADIENT_ACCUMULATION_STEPS ZT_MAX_STEPS
    ZT_LEARNING_RATE ZT_LR_WARMUP_STEPS ZT_MIXED_PRECISION ZT_ZERO_STAGE ZT_OFFLOAD_OPTIMIZER
    ZT_OFFLOAD_PARAM ZT_OPTIMIZER ZT_GRADIENT_CLIPPING ZT_GRADIENT_CHECKPOINTING ZT_EMA
    ZT_DEVICE ZT_NUM_PROCESSES ZT_NNODES ZT_NODE_RANK ZT_MASTER_ADDR ZT_MASTER_PORT
    ZT_CHECKPOINT_EVERY_STEPS ZT_CHECKPOINTS_KEEP ZT_RESUME ZT_VALIDATION_PROMPTS
    ZT_VALIDATION_EVERY_STEPS ZT_METRICS_PORT ZT_METRICS_HOST ZT_HANG_TIMEOUT_SECONDS
    ZT_CONFIG_FILE ZT_DEEPSPEED_CONFIG ZT_ACCELERATE_CONFIG""".split()  # noqa: SIM905
    assert set(design) <= set(SETTINGS)


def test_metric_names_are_pinned():
    assert set(metrics.DESIGN_METRICS) == DESIGN_METRICS
    for name in (*metrics.DESIGN_METRICS, *metrics.EXTRA_METRICS):
        assert name.startswith("zerotuner_")
    pushed = ("bytes_total", "seconds_total", "failures_total", "last_step")
    assert tuple(f"zerotuner_push_{name}" for name in pushed) == push.METRICS


def test_commands_and_exit_codes_are_pinned():
    assert list(COMMANDS) == ["train", "config", "plan", "check", "demo", "export", "builder"]
    codes = (errors.EXIT_OK, errors.EXIT_FAILURE, errors.EXIT_CONFIG, errors.EXIT_ENVIRONMENT)
    assert codes == (0, 1, 2, 3)
    assert errors.EXIT_SIGNAL == 143
    assert errors.EXIT_PEER_LOST == 200  # a lost node: podFailurePolicy and PyTorchJob retry it
