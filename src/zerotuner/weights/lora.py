"""LoRA adapters on the UNet (ZT_TRAINING_TYPE=lora), trained under DeepSpeed with peft.

The base UNet is frozen (DeepSpeed casts it to the run's 16-bit dtype with the rest of the
module, and no optimizer state exists for it); peft's LoRA layers are added with diffusers'
`add_adapter`, and only their parameters reach `deepspeed.initialize` (fp32 masters, Adam
moments); peft's DoRA and rsLoRA variants are settings. DoRA works at every stage: under ZeRO-3
the base weight it reads outside the base layer's forward is gathered by DeepSpeed on access
(its external-parameter hook on `module._parameters`).

This module holds the settings, the adapter's definition and the resume checks; a training rank
adds the adapter through zerotuner.weights.training_type, and the files it becomes are written
by zerotuner.weights.lora_files.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from zerotuner.errors import ConfigError
from zerotuner.settings.notes import Note
from zerotuner.settings.schema import Settings, env_name
from zerotuner.weights import base_precision, zero_init

log = logging.getLogger(__name__)

ADAPTER = "default"  # peft's adapter name inside the UNet
ATTENTION = ("to_k", "to_q", "to_v", "to_out.0")  # diffusers' train_text_to_image_lora_sdxl
PRESETS: dict[str, tuple[str, ...]] = {
    "attention": ATTENTION,
    "attention+ff": (*ATTENTION, "ff.net.0.proj", "ff.net.2"),
}
# A preset's layer names as other models spell them: diffusers' Attention holds its output Linear
# in a ModuleList (`to_out.0`, with a dropout), HiDream's HiDreamAttention as `to_out` itself
# (diffusers' HiDream example targets to_k, to_q, to_v, to_out)
SPELLINGS = {"to_out.0": "to_out"}
LORA_FIELDS = (
    "lora_rank", "lora_alpha", "lora_dropout", "lora_targets", "lora_dora", "lora_rslora",
    "lora_init", "lora_merge", "lora_text_encoder", "lora_from",
)  # fmt: skip
LORA_LAYERS = (torch.nn.Linear, torch.nn.Conv2d)
# peft's initialisers that read the base weights (Linear layers only), by ZT_LORA_INIT
INITS = {"pissa": "PiSSA", "olora": "OLoRA"}  # what peft can wrap in a diffusers UNet


def check_settings(settings: Settings) -> None:
    """The LoRA settings against the training type: one line per problem (exit 2)."""
    problems = []
    if settings.training_type == "full":
        for name in LORA_FIELDS:
            if name in settings.model_fields_set:
                problems.append(
                    f"{env_name(name)} is set but {env_name('training_type')}=full: set "
                    f"{env_name('training_type')}=lora or unset {env_name(name)}"
                )
    else:
        try:
            parse_targets(settings.lora_targets)
        except ConfigError as error:
            problems.extend(error.problems)
        if settings.lora_init != "gaussian":
            for name, on in (("lora_dora", settings.lora_dora),
                             ("lora_text_encoder", settings.lora_text_encoder)):  # fmt: skip
                if on:
                    problems.append(
                        f"{env_name('lora_init')}={settings.lora_init} with {env_name(name)}="
                        f"true: not offered; set {env_name('lora_init')}=gaussian or unset "
                        f"{env_name(name)}"
                    )
    problems.extend(base_precision.settings_problems(settings))  # ZT_BASE_PRECISION's
    if problems:
        raise ConfigError(problems[0], problems=problems)


def notes(settings: Settings) -> list[Note]:
    """What `config --explain` and `train` say about a LoRA run before it starts."""
    if settings.training_type != "lora":
        return []
    targets = _targets_shown(parse_targets(settings.lora_targets), settings.lora_from)
    variants = [name for name, on in (("DoRA", settings.lora_dora),
                                      ("rsLoRA", settings.lora_rslora),
                                      (INITS.get(settings.lora_init, ""),
                                       settings.lora_init != "gaussian")) if on]  # fmt: skip
    shown = f" ({', '.join(variants)})" if variants else ""
    said = [
        Note(
            "info",
            f"LoRA rank {settings.lora_rank}, alpha {alpha(settings):g}{shown} on {targets}; "
            "the plan counts the adapter as trained and the base UNet as frozen (weights only)",
        )
    ]
    if settings.lora_init != "gaussian":
        said.append(
            Note(
                "info",
                f"{env_name('lora_init')}={settings.lora_init}: the adapter starts from the base "
                "weights and the base keeps the rest (W - scale B0 A0); the files written are "
                "the plain LoRA of rank 2 x rank that turns the published base into the trained "
                "model",
            )
        )
    if settings.lora_text_encoder:
        said.append(
            Note(
                "info",
                f"{env_name('lora_text_encoder')}: the text encoders train adapters too (on "
                "q/k/v/out_proj, same rank and alpha) and run at every step under DeepSpeed "
                "with the UNet; captions are not cached (latents still are), and the plan "
                "counts the encoders' weights as frozen and their adapters as trained",
            )
        )
    return said


def _targets_shown(targets: Iterable[str], source: str | None = None) -> str:
    """Targets in a log line: an adapter file's (ZT_LORA_FROM) are its layers' whole names."""
    targets = list(targets)
    return f"{len(targets)} layers of {source}" if source else ",".join(targets)


def parse_targets(value: str) -> tuple[str, ...]:
    """Presets and module names separated by commas (order kept, duplicates dropped)."""
    items = [n.strip() for n in value.split(",") if n.strip()]
    names = tuple(dict.fromkeys(n for item in items for n in PRESETS.get(item, (item,))))
    if not names:
        raise ConfigError(
            f"{env_name('lora_targets')}={value!r}: expected a preset "
            f"({', '.join(PRESETS)}) or comma-separated module names"
        )
    return names


def resolve_targets(module: torch.nn.Module, targets: Iterable[str]) -> tuple[str, ...]:
    """The targets as this model spells them: a name that matches none of its layers while
    its other spelling (SPELLINGS) does is that spelling; every other name stays (check_targets
    refuses one that matches nothing). A layer an adapter wraps already counts as its own.
    A name that also matches layers the model's family never trains (`ModelFamily.trains`:
    LTX-2's audio stream, which no gradient reaches) becomes the full names of the layers it
    does train; one that matches only such layers stays as it is."""
    layers = matching(n for n, m in module.named_modules()
                      if isinstance(getattr(m, "base_layer", m), LORA_LAYERS))  # fmt: skip
    trains = _family_trains(module)
    resolved: list[str] = []
    for target in targets:
        if target in SPELLINGS and target not in layers and SPELLINGS[target] in layers:
            target = SPELLINGS[target]
        matched = layers.get(target, [])
        trained = [n for n in matched if trains(f"{n}.weight")]
        resolved += [target] if not trained or len(trained) == len(matched) else trained
    return tuple(dict.fromkeys(resolved))


def _family_trains(module: torch.nn.Module) -> Any:
    """`trains` of the family whose denoiser class `module` is (every parameter: a UNet's, or
    a family that trains all of its transformer)."""
    from zerotuner import families
    from zerotuner.families.registry import TRANSFORMERS

    family = TRANSFORMERS.get(type(module).__name__)
    return families.get(family).trains if family else (lambda name: True)


def alpha(settings: Settings) -> float:
    return settings.lora_rank if settings.lora_alpha is None else settings.lora_alpha


def suffixes(module_name: str) -> list[str]:
    """The target names that pick `module_name` out by peft's rule for a list of names: the
    whole name and each dotted suffix of it (`up.0.to_q`, `0.to_q`, `to_q`)."""
    parts = module_name.split(".")
    return [".".join(parts[i:]) for i in range(len(parts))]


def matching(module_names: Iterable[str]) -> dict[str, list[str]]:
    """Each target name that picks out a module -> those modules, in order: one lookup per
    target (a plan checks thousands of full names against a 14B model's thousands of layers)."""
    index: dict[str, list[str]] = {}
    for name in module_names:
        for suffix in suffixes(name):
            index.setdefault(suffix, []).append(name)
    return index


def short_names(module: torch.nn.Module) -> list[str]:
    """The names a user can target: each wrappable layer's last part (two when the last is an
    index, as in `to_out.0`), e.g. `to_q`, `proj_in`, `conv1`, `net.2`."""
    found = set()
    for name, child in module.named_modules():
        if isinstance(child, LORA_LAYERS) and name:
            parts = name.split(".")
            found.add(".".join(parts[-2:]) if parts[-1].isdigit() and len(parts) > 1 else parts[-1])
    return sorted(found)


def adapter_size(
    module: torch.nn.Module, targets: Iterable[str], rank: int, *, dora: bool = False
) -> tuple[int, int]:
    """(parameters, elements of the largest tensor) of the adapter `add_adapter` puts on
    `targets` at `rank`, from the layers' shapes alone (a meta-device UNet will do): peft's
    lora_A / lora_B of a Linear are rank x in and out x rank; of a Conv2d, a conv of the
    layer's kernel from its inputs to `rank` channels and a 1x1 conv back (no biases); DoRA
    adds a magnitude per output feature."""
    wanted = set(targets)
    total = largest = 0
    for name, layer in module.named_modules():
        if not isinstance(layer, LORA_LAYERS) or wanted.isdisjoint(suffixes(name)):
            continue
        if isinstance(layer, torch.nn.Linear):
            a, b, out = rank * layer.in_features, layer.out_features * rank, layer.out_features
        else:
            kernel = layer.kernel_size[0] * layer.kernel_size[1]
            a, b = rank * layer.in_channels * kernel, layer.out_channels * rank // layer.groups
            out = layer.out_channels
        magnitude = out if dora else 0
        total += a + b + magnitude
        largest = max(largest, a, b, magnitude)
    return total, largest


def check_targets(
    denoiser: torch.nn.Module, targets: Iterable[str], init: str = "gaussian"
) -> None:
    """Every target must name at least one Linear/Conv2d layer of this UNet (only Linear
    layers for peft's PiSSA / OLoRA: their SVD / QR is of a matrix)."""
    targets = tuple(targets)
    order = {t: i for i, t in enumerate(targets)}
    layers = matching(n for n, m in denoiser.named_modules() if isinstance(m, LORA_LAYERS))
    missing = [t for t in targets if t not in layers]
    if missing:
        raise ConfigError(
            f"{env_name('lora_targets')}: no layer of this UNet is called "
            f"{', '.join(missing)}; valid names: {', '.join(short_names(denoiser))} "
            f"(or a preset: {', '.join(PRESETS)})"
        )
    # peft wraps every module a target matches and raises on any it cannot (a SiLU that
    # shares Z-Image's `adaLN_modulation.0`), which would fail the run after caching
    other = next(((min(hit, key=order.__getitem__), n, m) for n, m in denoiser.named_modules()
                  if n and not isinstance(m, LORA_LAYERS)
                  and (hit := order.keys() & suffixes(n))), None)  # fmt: skip
    if other is not None:
        target, name, module = other
        layer = layers[target][0]
        raise ConfigError(
            f"{env_name('lora_targets')}: {target} also names {name}, a "
            f"{type(module).__name__}, and LoRA wraps only Linear and Conv2d layers; leave it "
            f"out, or give each layer's whole path (e.g. {layer})"
        )
    convs = sorted({t for n, m in denoiser.named_modules() if isinstance(m, torch.nn.Conv2d)
                    for t in order.keys() & suffixes(n)})  # fmt: skip
    if init != "gaussian" and convs:
        raise ConfigError(
            f"{env_name('lora_init')}={init}: {', '.join(convs)} name convolutions, and "
            f"{INITS[init]} starts from a linear layer's weight matrix; target linear layers "
            f"only (e.g. attention) or set {env_name('lora_init')}=gaussian"
        )


def check_init_stage(settings: Settings, zero_stage: int) -> None:
    """The LoRA settings against the stage the plan chose. PiSSA / OLoRA read and rewrite the
    base weights as the adapter is added: ZeRO-3 holds only a shard of each; a base stored at
    a low precision (ZT_BASE_PRECISION) cannot be partitioned."""
    base_precision.check_stage(settings, zero_stage)
    if settings.training_type == "lora" and settings.lora_init != "gaussian" and zero_stage == 3:
        raise ConfigError(
            f"{env_name('lora_init')}={settings.lora_init}: {INITS[settings.lora_init]} reads "
            "each base weight whole, and ZeRO-3 partitions them; use ZeRO 0-2 (set "
            f"{env_name('zero_stage')}=2, with offload if it must) or "
            f"{env_name('lora_init')}=gaussian"
        )


def initial_adapter(module: torch.nn.Module, init: str) -> dict[str, torch.Tensor] | None:
    """A PiSSA / OLoRA adapter's starting weights (lora_files.plain_lora needs them to write
    the adapter for the published base), right after add_adapter; None for gaussian's."""
    if init == "gaussian":
        return None
    return {n: p.detach().cpu().clone() for n, p in module.named_parameters() if ".lora_" in n}


def check_model_targets(settings: Settings, family: str, model_dir: Path | None) -> None:
    """check_targets before launch, on the model built from its config on the meta device (no
    weights read; a hub model not yet fetched is checked against its family's config)."""
    from zerotuner.families import EXPERTS, meta_model

    targets = parse_targets(settings.lora_targets)
    denoiser = EXPERTS.get(settings.expert or "")  # Wan 2.2 A14B's expert
    model = meta_model(family, model_dir, denoiser)
    check_targets(model, resolve_targets(model, targets), settings.lora_init)


def lora_config(settings: Settings, denoiser: torch.nn.Module | None = None) -> Any:
    """The adapter's peft config; with `denoiser`, its targets as that model spells them."""
    adapter = adapter_settings(settings)
    if denoiser is not None:
        adapter["targets"] = list(resolve_targets(denoiser, adapter["targets"]))
    return make_config(adapter)


def adapter_settings(settings: Settings) -> dict[str, Any]:
    """What defines the adapter, as the checkpoint manifest records it."""
    return {
        "rank": settings.lora_rank,
        "alpha": alpha(settings),
        "dropout": settings.lora_dropout,
        "targets": list(parse_targets(settings.lora_targets)),
        "dora": settings.lora_dora,
        "rslora": settings.lora_rslora,
        "init": settings.lora_init,
        "text_encoder": settings.lora_text_encoder,
    }


def make_config(adapter: dict[str, Any]) -> Any:
    from peft import LoraConfig

    return LoraConfig(
        r=adapter["rank"],
        lora_alpha=adapter["alpha"],
        lora_dropout=adapter.get("dropout", 0.0),
        # gaussian: A random, B zero, training starts at the base model; pissa / olora: from
        # the base weights, which keep the rest (see plain_lora)
        init_lora_weights=adapter.get("init", "gaussian"),
        target_modules=list(adapter["targets"]),
        use_dora=adapter.get("dora", False),
        use_rslora=adapter.get("rslora", False),
    )


def add_adapter(denoiser: Any, settings: Settings) -> list[torch.nn.Parameter]:
    """Freeze the base, add the adapter (fp32; DeepSpeed casts the module as configured) and
    return the parameters the optimizer gets: the adapter's only."""
    config = lora_config(settings, denoiser)
    check_targets(denoiser, config.target_modules, settings.lora_init)
    denoiser.requires_grad_(False)
    # lora_A's random start from ZT_SEED: every rank and every run starts from the same adapter
    # (ZeRO-3 partitions each rank's own copy: DeepSpeed broadcasts none), whatever the stage
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(settings.seed)
        zero_init.add_adapter(denoiser, config, ADAPTER)  # also on a ZeRO-3 partitioned UNet
    named = [(n, p) for n, p in denoiser.named_parameters() if p.requires_grad]
    if not named or any(".lora_" not in n for n, _ in named):
        raise RuntimeError("peft left base parameters trainable or added no adapter")
    total = sum(p.numel() for p in denoiser.parameters())
    targets = _targets_shown(sorted(config.target_modules), settings.lora_from)
    log.info(
        "LoRA rank %d, alpha %g on %s: %d trainable of %d parameters",
        config.r, config.lora_alpha, targets, sum(p.numel() for _, p in named), total,
    )  # fmt: skip
    return [p for _, p in named]


def metadata(config: Any) -> dict[str, Any]:
    """The adapter's LoraConfig as diffusers stores it beside the weights (alpha, rank,
    targets, dropout): `load_lora_weights` rebuilds the adapter from it."""
    config = config.to_dict()
    config["target_modules"] = sorted(config["target_modules"])  # a set: JSON needs a list
    return config


def shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Every adapter parameter's full shape (under ZeRO-3 the tensor itself is a placeholder;
    DeepSpeed keeps the real shape in `ds_shape`)."""
    return {
        name: tuple(getattr(p, "ds_shape", p.shape))
        for name, p in module.named_parameters()
        if p.requires_grad
    }


def base_folders(source: Path, *, text_encoder: bool, denoiser: str | None = None) -> list[str]:
    """The pipeline parts an adapter sits on: the UNet (`denoiser`: that folder, Wan 2.2 A14B's
    expert), and the text encoders if they train."""
    texts = ["text_encoder", "text_encoder_2"] if text_encoder else []
    denoiser = denoiser or ("unet" if (source / "unet").is_dir() else "transformer")
    return [denoiser, *(t for t in texts if (source / t).is_dir())]


def base_digest(source: Path, *, text_encoder: bool = False, denoiser: str | None = None) -> str:
    """sha256 over the base weight files the adapter sits on (names and contents): what it
    was trained on, whatever the folder or hub id is called. (The manifest keeps it as
    `base_unet_sha256`, the name it had before text encoders could train.)"""
    digest = hashlib.sha256()
    for folder in base_folders(source, text_encoder=text_encoder, denoiser=denoiser):
        files = (source / folder).iterdir()
        for path in sorted(p for p in files if p.suffix in (".safetensors", ".bin")):
            with path.open("rb") as f:
                name = path.name if folder == "unet" else f"{folder}/{path.name}"  # as before
                digest.update(name.encode() + hashlib.file_digest(f, "sha256").digest())
    return digest.hexdigest()


def shared_base_digest(
    source: Path, *, rank: int, text_encoder: bool = False, denoiser: str | None = None
) -> str:
    """base_digest read once (rank 0) and given to every rank (a collective)."""
    import torch.distributed as dist

    shared = [
        base_digest(source, text_encoder=text_encoder, denoiser=denoiser) if rank == 0 else None
    ]
    if dist.is_available() and dist.is_initialized():
        dist.broadcast_object_list(shared, src=0)
    assert shared[0] is not None
    return shared[0]


def base_for_resume(source: Path, settings: Settings, resume: Path | None, *, rank: int) -> str:
    """The base UNet's digest (every rank), checked against the checkpoint to resume."""
    from zerotuner.families import EXPERTS
    from zerotuner.weights.checkpoint import read_manifest

    digest = shared_base_digest(
        source, rank=rank, text_encoder=settings.lora_text_encoder,
        denoiser=EXPERTS.get(settings.expert or ""),  # Wan 2.2 A14B's expert
    )  # fmt: skip
    if resume:
        check_resume_base(read_manifest(resume) or {}, digest, settings, resume)
    return digest


def check_resume_base(
    manifest: dict[str, Any], digest: str, settings: Settings, path: Path
) -> None:
    """Refuse (exit 2) to resume a LoRA checkpoint onto a base UNet other than its own."""
    saved = manifest.get("lora", {}).get("base_unet_sha256")
    if saved is not None and saved != digest:
        parts = "UNet or text encoder" if settings.lora_text_encoder else "UNet"
        raise ConfigError(
            f"{env_name('model')}={settings.model}: its {parts} weights differ from those the "
            f"checkpoint to resume ({path}) trained its adapter on (sha256 {saved[:12]}, now "
            f"{digest[:12]}); set {env_name('model')} back, or {env_name('resume')}=never or "
            f"another {env_name('output_dir')} to start afresh"
        )


def check_resume(manifest: dict[str, Any], settings: Settings, path: Path) -> None:
    """Refuse (exit 2, one line) to resume a checkpoint of another training type, or a LoRA
    checkpoint whose adapter has another rank, other targets, DoRA or the text encoders'
    adapters on/off, or that trained on a base stored at another precision. Alpha, rsLoRA and
    dropout may change: they do not change what the checkpoint holds."""
    saved = manifest.get("training_type", "full")  # checkpoints from before LoRA were full
    wanted = settings.training_type
    fresh = f"set {env_name('resume')}=never or another {env_name('output_dir')} to start afresh"
    if saved != wanted:
        raise ConfigError(
            f"{env_name('training_type')}={wanted}: the checkpoint to resume ({path}) is from "
            f"a {saved} run; set {env_name('training_type')}={saved} to continue it, or {fresh}"
        )
    if wanted != "lora":
        return
    before = {"dora": False, "text_encoder": False, "init": "gaussian"} | manifest.get("lora", {})
    now = adapter_settings(settings)
    for key, setting in (
        ("rank", "lora_rank"), ("targets", "lora_targets"), ("dora", "lora_dora"),
        ("text_encoder", "lora_text_encoder"), ("init", "lora_init"),
    ):  # fmt: skip
        if before.get(key) != now[key]:
            shown = ",".join(before.get(key, [])) if key == "targets" else before.get(key)
            value = getattr(settings, setting)
            if isinstance(value, bool):  # as the variable is written, and the manifest's flag
                value, shown = str(value).lower(), "on" if shown else "off"
            raise ConfigError(
                f"{env_name(setting)}={value}: the checkpoint to resume ({path}) has an adapter "
                f"with {key.replace('_', ' ')} {shown}; set it back to continue, or {fresh}"
            )
    base_precision.check_resume(manifest, settings, path)
