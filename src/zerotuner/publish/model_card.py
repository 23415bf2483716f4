"""The model card (README.md) pushed next to a run's final export: what was trained from what,
how, for how long, and what it drew. Built from what the run recorded; never a secret."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from zerotuner import families
from zerotuner.settings.schema import Settings, masked_dump

# Settings a reader of the card needs; folders and ports of the machine that trained say nothing.
CARD_SETTINGS = (
    "model", "training_type", "lora_rank", "lora_alpha", "lora_targets",
    "resolution", "train_batch_size", "gradient_accumulation_steps", "max_steps",
    "learning_rate", "lr_scheduler", "lr_warmup_steps", "optimizer", "mixed_precision",
    "zero_stage", "seed", "snr_gamma", "noise_offset", "ema",
)  # fmt: skip


def _last_step(output_dir: Path) -> dict[str, Any] | None:
    path = output_dir / "run" / "steps.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return json.loads(lines[-1]) if lines else None


def _held_out(output_dir: Path) -> list[str]:
    """The held-out loss's line (run/eval.json, ZT_EVAL_*): its best step, and the step an
    early stop exported."""
    path = output_dir / "run" / "eval.json"
    try:
        record = json.loads(path.read_text()) if path.is_file() else None
    except ValueError:
        return []
    if not record or record.get("best_step") is None:
        return []
    line = (
        f"Held-out loss ({record['held_out_images']} images): best {record['best_loss']:.4f} "
        f"at step {record['best_step']}"
    )
    if record.get("exported_step") is not None:
        line += (
            f"; stopped early at step {record['stopped_early_at']}, the export is step "
            f"{record['exported_step']}"
        )
    return ["", line + "."]


def _latest_samples(output_dir: Path) -> list[str]:
    folders = sorted((output_dir / "samples").glob("step-*"), key=lambda p: int(p.name[5:]))
    if not folders:
        return []
    return [p.relative_to(output_dir).as_posix() for p in sorted(folders[-1].glob("*.png"))]


def _lora_files(final: Path) -> list[str]:
    """Which file of final/ each tool loads (docs/models.md), of those the run wrote."""
    from zerotuner.weights.lora_files import ADAPTER_FILE, COMFY_FILE, KOHYA_FILE

    tools = (("diffusers", ADAPTER_FILE), ("ComfyUI (LoraLoader)", COMFY_FILE),
             ("kohya's scripts, A1111 / Forge", KOHYA_FILE))  # fmt: skip
    return [f"- {tool}: `final/{name}`" for tool, name in tools if (final / name).is_file()]


def model_card(settings: Settings, output_dir: Path, family: str) -> str:
    """The README of a pushed run: what it is, how to load it, its samples and settings;
    `family`: the run's (the job's), whose pipeline the adapter loads onto."""
    values = masked_dump(settings)
    chosen = {k: values[k] for k in CARD_SETTINGS if values.get(k) is not None}
    lora = settings.training_type == "lora"
    front = {
        "base_model": str(settings.model),
        "library_name": "diffusers",
        "tags": ["zerotuner", "text-to-image", "diffusers", *(["lora"] if lora else [])],
    }
    last = _last_step(output_dir)
    lines = ["---", yaml.safe_dump(front, sort_keys=False).strip(), "---", ""]
    kind = "LoRA adapter" if lora else "Fine-tuned pipeline"
    lines += [f"# {kind} for {settings.model}", "", "Trained with zerotuner (DeepSpeed ZeRO)."]
    if last is not None:
        lines += ["", f"Steps: {last['step']}; last logged loss {last['loss']:.4f}."]
    lines += _held_out(output_dir)
    if lora:  # Wan 2.2 A14B's low-noise expert: the adapter goes onto transformer_2
        load = families.get(family).lora_load_code(
            "<this repo>", into_transformer_2=settings.expert == "low"
        )
        lines += ["", "```python", load, "```"]
        lines += ["", *_lora_files(output_dir / "final")]
    if settings.expert:
        lines += ["", f"Wan 2.2 A14B's {settings.expert}-noise expert "
                  f"(`{'transformer' if settings.expert == 'high' else 'transformer_2'}`) only; "
                  "the other expert is the base model's."]  # fmt: skip
    if (output_dir / "run" / "loss.png").is_file():
        lines += ["", "![loss curve](run/loss.png)"]
    samples = _latest_samples(output_dir)
    if samples:
        lines += ["", "## Samples", "", *(f"![{Path(s).stem}]({s})" for s in samples)]
    lines += ["", "## Settings", "", "```yaml", yaml.safe_dump(chosen, sort_keys=False).strip(),
              "```", ""]  # fmt: skip
    return "\n".join(lines)
