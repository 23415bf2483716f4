"""One rank's run, phase by phase: loading -> caching -> training (with checkpointing and
validating) -> exporting. `zerotuner.train.worker.train` drives it; this is the only module that
calls `deepspeed.initialize`. What differs between a full and a LoRA run is the run's
`weights` (zerotuner.weights.training_type); nothing here asks which.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from zerotuner import families
from zerotuner.data import held_out
from zerotuner.data.buckets import Bucket, bucket_name, dataset_buckets
from zerotuner.data.clips import Video, video_sampling
from zerotuner.data.controls import one_count
from zerotuner.data.dataset import Dataset
from zerotuner.data.notes import recipe_notes, upscale_warning
from zerotuner.data.order import Position, iterate_batches
from zerotuner.data.scan import scan_sources
from zerotuner.errors import Diverged
from zerotuner.families.base import ModelFamily, Objective
from zerotuner.launch import distributed
from zerotuner.launch.job import Job
from zerotuner.launch.records import Sink, StepRecord, write_rank_armed
from zerotuner.settings import datasets
from zerotuner.settings.schema import Settings
from zerotuner.train import (
    caching,
    feature_cache,
    loop,
    model,
    nonfinite,
    samples,
    speed,
    validation_inputs,
)
from zerotuner.train import evaluate as evaluation
from zerotuner.train import optimizer as client_optimizer
from zerotuner.train.stop import Stopped, StopRequest
from zerotuner.weights import checkpoint, lora_text
from zerotuner.weights.ema import EMA
from zerotuner.weights.training_type import TrainedWeights

# The rank's lines keep the logger they always had: log readers match on it (bench/runs.py).
log = logging.getLogger("zerotuner.train.worker")


def _write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")


class Run:
    """The state of one rank's job, declared here and filled phase by phase."""

    def __init__(
        self,
        settings: Settings,
        job: Job,
        *,
        sinks: Sequence[Sink],
        world: distributed.World,
        weights: TrainedWeights,
        resume: Path | None,
    ) -> None:
        self.settings, self.job, self.sinks = settings, job, list(sinks)
        self.weights = weights  # what trains, and how it is saved, rendered and exported
        self.resume = resume  # the committed checkpoint this run continues from
        self.place = world  # rank, local rank, world size, device: read once
        self.rank, self.world = world.rank, world.size
        self.run_dir = settings.output_dir / "run"
        self.device = world.device
        self.dtype = model.train_dtype(job.mixed_precision)
        self.stop = StopRequest(settings.collective_timeout_seconds)
        write_rank_armed(self.rank)  # a SIGTERM before this line killed a rank with nothing to save
        # Filled by the phases in order, declared here so the whole state reads in one place.
        # load(): the base model, its family and objective, the dataset in its buckets
        self.source: Path
        self.conditioning: ModelFamily
        self.part: str | None = None  # Wan 2.2 A14B's expert (ZT_EXPERT): the folder trained
        self.components: model.Components
        self.objective: Objective
        self.video: Video | None = None  # None: the dataset is images
        self.dataset: Dataset
        self.buckets: dict[Bucket, list[int]]  # the training images'
        # the held-out images (ZT_EVAL_*): cached with the training ones, never trained on
        self.cached: tuple[Dataset, dict[Bucket, list[int]]]  # what caching encodes
        self.held: list[int] = []  # the held-out images' indices in self.items
        self.sample_inputs: list[Any] | None = None  # each validation prompt's input image
        # cache(): the feature cache and the items it holds
        self.features: feature_cache.FeatureCache
        self.items: list[feature_cache.CacheItem]
        # engine(): DeepSpeed's engine, where a resume continues, the EMA
        self.engine_: Any
        self.guard: nonfinite.PlainStepGuard | None = None  # ZeRO-0 fp32's skip
        self.start_step = 0
        self.position = Position()  # the data order's, followed step by step
        self.ema: EMA | None = None
        self.due: set[str] = set()  # "save", "validate": due at a skipped step, done at the next
        # train(): the loop's context; the held-out loss's best and the early stop
        self.ctx: loop.LoopContext
        held = settings.eval_data_dir is not None or settings.eval_fraction is not None
        self.early = (
            evaluation.EarlyStop(settings.early_stop_patience, settings.early_stop_min_delta)
            if held
            else None
        )
        self.stopped_early: int | None = None  # the step an early stop committed

    def phase(self, name: str) -> None:
        for sink in self.sinks:
            sink.on_phase(name)

    # --- loading ------------------------------------------------------------------------
    def load(self) -> None:
        s, job = self.settings, self.job
        self.source = source = self._fetch()
        self.conditioning = conditioning = families.get(job.family).configured(s, source)
        self.part = conditioning.denoiser if s.expert else None
        self.components = components = model.load_components(
            source,
            job.family,
            gradient_checkpointing=job.gradient_checkpointing,
            with_frozen=False,
            deepspeed_config=job.deepspeed,
            dtype=self.weights.load_dtype(self.dtype),
            denoiser=self.part,
            offload_activations=job.offload_activations,
        )
        self.objective = objective = conditioning.objective(
            s, components.scheduler, components.denoiser.config
        )
        self.video = video_sampling(s, conditioning, source)
        self.dataset = dataset = scan_sources(
            datasets.sources(s), s.cache_dir, log_skipped=self.rank == 0,
            write_index=self.place.node_leader, min_image_size=s.min_image_size,
            video=self.video,
            datasets_file=s.datasets_file,
            control_count=families.REGISTRY[job.family].control_counts,
        )  # fmt: skip
        # one bucket rule, the one `check` reports (families.bucket_step)
        multiple = families.bucket_step(
            job.family, source, resolution=job.resolution, denoiser=self.part
        )
        self.buckets = dataset_buckets(
            dataset, job.resolution, multiple=multiple, upscale=s.upscale
        )
        self._hold_out(multiple)
        # a model that samples from an input image: each prompt's, read before any training
        # (FLUX.2 samples from its references where its data have them: the run's one count)
        spec = families.REGISTRY[job.family]
        sample_input = spec.run_sample_input(len(dataset.items[0].controls))
        self.sample_inputs = validation_inputs.chosen(
            s, sample_input, dataset, self.held, spec.sample_images
        )
        if self.rank == 0:  # every rank scanned the same files: count them once
            self._report_dataset(dataset, objective, multiple)
        self.weights.check_base(source, self.resume, rank=self.rank)  # a LoRA's own base only

    def _hold_out(self, multiple: int) -> None:
        """The held-out images: ZT_EVAL_FRACTION's taken out of the training buckets, or
        ZT_EVAL_DATA_DIR's scanned and cached beside the training images."""
        s = self.settings
        self.cached = (self.dataset, self.buckets)
        if s.eval_fraction is not None:
            self.held = held_out.held_out(self.dataset.items, s.eval_fraction, s.seed)
            out, kept = set(self.held), {}
            for bucket, indices in self.buckets.items():
                if training := [i for i in indices if i not in out]:
                    kept[bucket] = training
            self.buckets = kept
        elif s.eval_data_dir is not None:
            extra = scan_sources(
                datasets.eval_sources(s), s.cache_dir, log_skipped=self.rank == 0,
                write_index=self.place.node_leader, min_image_size=s.min_image_size,
                video=self.video,
                control_count=families.REGISTRY[self.job.family].control_counts,
                setting="ZT_EVAL_DATA_DIR",
            )  # fmt: skip
            one_count("ZT_EVAL_DATA_DIR", self.dataset.items, extra.items)
            offset = len(self.dataset)
            joined = dict(self.buckets)
            for bucket, indices in dataset_buckets(
                extra, self.job.resolution, multiple=multiple, upscale=s.upscale
            ).items():
                joined[bucket] = joined.get(bucket, []) + [offset + i for i in indices]
            items = self.dataset.items + extra.items
            self.cached = (Dataset(self.dataset.root, items, self.dataset.skipped), joined)
            self.held = list(range(offset, len(items)))
        if self.held and self.rank == 0:
            source = s.eval_data_dir or f"{s.eval_fraction:g} of the training images"
            every = f"every {s.eval_every_steps} steps and " if s.eval_every_steps else ""
            log.info(
                "held-out loss: %d image(s) (%s), evaluated %sat the end",
                len(self.held), source, every,
            )  # fmt: skip

    def _fetch(self) -> Path:
        """The base pipeline's folder: a hub id is downloaded (or found in the cache) once per
        node, by its first rank."""
        s, job = self.settings, self.job
        token = s.hf_token.get_secret_value() if s.hf_token else None
        if not Path(job.model).expanduser().is_dir():
            self.phase("downloading")  # a hub id: fetched, or found in the cache, per node

        def resolve() -> Path:
            return model.fetch_model(
                job.model, cache_dir=s.cache_dir, token=token, revision=job.revision
            )

        source = resolve() if self.place.node_leader else None  # one download per node
        distributed.barrier()
        self.phase("loading")
        return source if source is not None else resolve()

    def _report_dataset(self, dataset: Dataset, objective: Objective, multiple: int) -> None:
        """run/dataset.json and the dataset's log lines (rank 0)."""
        s, resolution = self.settings, self.job.resolution
        for sink in self.sinks:
            sink.on_dataset_skipped(len(dataset.skipped))
        _write_json(
            self.run_dir / "dataset.json",
            {
                "images": len(dataset),
                "datasets": [
                    {"path": p.label, "images": len(p.dataset), "repeats": p.repeats}
                    for p in dataset.parts
                ],
                "skipped": [[str(p), why] for p, why in dataset.skipped],
                "buckets": {bucket_name(b): len(ix) for b, ix in self.buckets.items()},
            },
        )
        log.info(
            "dataset: %s, %d skipped, %d bucket(s); %s",
            dataset.summary(), len(dataset.skipped), len(self.buckets), objective.describe(),
        )  # fmt: skip
        if upscaled := upscale_warning(dataset, resolution, multiple=multiple, upscale=s.upscale):
            log.warning("%s", upscaled)
        if notes := recipe_notes(
            dataset, resolution, multiple=multiple,
            caption_template=s.caption_template, caption_dropout=s.caption_dropout,
            min_image_size=s.min_image_size, upscale=s.upscale,
            timestep_range=s.timestep_range,
        ):  # fmt: skip
            log.info("dataset recipes: %s", "; ".join(notes))

    # --- caching ------------------------------------------------------------------------
    def cache(self) -> None:
        self.phase("caching")
        self.features, self.items, stats = caching.fill(
            self.settings, self.source, self.components, self.conditioning, *self.cached,
            rank=self.rank, world=self.world, device=torch.device(self.device),
            dtype=self.dtype, texts=not self.weights.texts_trained,
        )  # fmt: skip
        if self.rank == 0:
            _write_json(self.run_dir / "cache.json", stats.as_dict())
            if families.REGISTRY[self.conditioning.name].captions_per_item:
                why = " (each caption is read with its control image: cached with its latents)"
            elif stats.texts_encoded or stats.texts_reused:
                why = ""
            else:
                why = " (the text encoders train: captions are encoded at every step)"
            log.info(
                "cache: %d latents encoded, %d reused; %d texts encoded, %d reused%s",
                stats.latents_encoded, stats.latents_reused, stats.texts_encoded,
                stats.texts_reused, why,
            )  # fmt: skip

    # --- engine and resume ----------------------------------------------------------------
    def engine(self) -> None:
        import deepspeed

        s, job, config = self.settings, self.job, dict(self.job.deepspeed)
        denoiser = self.components.denoiser
        trained = self.weights.prepare(  # adapters before ZeRO-3 partitions the denoiser
            denoiser, source=self.source, resume=self.resume,
            gradient_checkpointing=job.gradient_checkpointing,
        )  # fmt: skip
        params = [p for p in trained.parameters() if p.requires_grad]
        speed.prepare(  # SDPA attention; compiled blocks where ZT_COMPILE decides so
            denoiser, s, accelerator=job.device, zero_stage=job.zero_stage,
            shapes=len(self.buckets),
        )  # fmt: skip
        # prodigy, schedule-free, 8-bit AdamW, Adafactor: built here, its section taken out
        kind = str(config.get("optimizer", {}).get("type"))
        if self.resume:
            client_optimizer.check_resume(
                self.resume, kind, world=self.world, zero_stage=job.zero_stage
            )
        built = client_optimizer.take(config, params, zero_stage=job.zero_stage)
        self.engine_, _, _, _ = deepspeed.initialize(
            model=trained, model_parameters=params, optimizer=built, config=config
        )
        log.info("DeepSpeed engine ready (ZeRO-%d)", self.engine_.zero_optimization_stage())
        speed.skip_lone_allreduce(self.engine_)
        speed.foreach_clip(self.engine_)
        self.guard = nonfinite.guard_plain_optimizer(self.engine_)
        if self.rank == 0:  # the entrypoint logs it; the run folder keeps it
            _write_json(self.run_dir / "deepspeed.json", job.deepspeed)  # optimizer included
        resumed = checkpoint.load(self.engine_, self.resume) if self.resume else None
        if resumed:
            client_optimizer.resume_training_weights(self.engine_)  # saved as evaluated
            self.start_step = resumed.step
            self.position = Position(**(resumed.position or {}))
            log.info("resumed from %s at step %d", resumed.path, resumed.step)
            if self.early is not None:  # the best so far, and the evaluations since it
                self.early.restore((checkpoint.read_manifest(resumed.path) or {}).get("eval"))
        if s.ema:
            self.ema = EMA(
                self.engine_.module, decay=s.ema_decay, rank=self.rank,
                trainable_only=self.weights.adapter_only,
            )  # fmt: skip
            if resumed and resumed.ema is not None:
                self.ema.load(resumed.ema, resumed.ema_updates)

    # --- training -------------------------------------------------------------------------
    def steps(self) -> Iterator[tuple[int, list[tuple[list[int], int]]]]:
        """(step, micro-batches) from the resumed position; self.position follows along. A
        micro-batch is (item indices, epoch): the epoch decides the caption dropout."""
        s = self.settings
        micro = iterate_batches(
            self.dataset,
            self.buckets,
            micro_batch=self.engine_.train_micro_batch_size_per_gpu(),
            rank=self.rank,
            world_size=self.world,
            seed=s.seed,
            start=self.position,
        )
        accumulation = self.engine_.gradient_accumulation_steps()
        for step in range(self.start_step + 1, s.max_steps + 1):
            batch = [next(micro) for _ in range(accumulation)]
            self.position = batch[-1][1]
            yield step, [(indices, position.epoch) for indices, position in batch]

    def train(self) -> None:
        s = self.settings
        if self.early is not None and self.early.exhausted:  # resumed from its early stop
            self.stopped_early = self.start_step
            return
        self.phase("training")
        texts = not self.weights.texts_trained  # else batches carry token ids
        streak = nonfinite.Streak(
            s.max_nonfinite_steps, rank=self.rank,
            counts=not self.engine_.fp16_enabled(),  # fp16: the loss scaler's skips
            last_checkpoint=lambda: checkpoint.last_committed(s.output_dir),
        )  # fmt: skip
        self.ctx = ctx = loop.LoopContext(
            conditioning=self.conditioning if texts else lora_text.TrainedText(self.conditioning),
            objective=self.objective,
            dtype=self.dtype,
            seed=s.seed,
            rank=self.rank,
            accumulation=self.engine_.gradient_accumulation_steps(),
            samples_per_step=self.engine_.train_batch_size(),  # micro * accumulation * world
            load_batch=functools.partial(self._load_batch, texts=texts),
            guard=self.guard,
            streak=streak,
            evaluate=self.evaluate_due if self.held else None,
        )
        try:
            loop.train(
                self.engine_, self.steps(), ctx, sinks=self.sinks, after_step=self.after_step
            )
        except evaluation.EarlyStopped as stopped:
            self.stopped_early = stopped.step
        streak.summary()
        if graphs := speed.graphs_built():
            log.info("speed: %d graphs compiled in this rank (blocks x bucket shapes)", graphs)

    def _load_batch(
        self, keys: tuple[list[int], int], gen: torch.Generator, *, texts: bool
    ) -> dict[str, Any]:
        items = caching.batch_items(
            self.items, keys, seed=self.settings.seed, caption_dropout=self.settings.caption_dropout
        )
        return self._load_items(items, gen, texts=texts)

    def _load_items(
        self, items: list[feature_cache.CacheItem], gen: torch.Generator, *, texts: bool
    ) -> dict[str, Any]:
        batch: dict[str, Any] = self.features.load_batch(items, gen, texts=texts)
        if not texts:
            captions = [item.caption for item in items]
            batch["input_ids"] = self.conditioning.tokens(self.weights.tokenizers, captions)
        return batch

    # --- the held-out loss ------------------------------------------------------------------
    def evaluate_due(self, step: int) -> None:
        every = self.settings.eval_every_steps
        if step == self.settings.max_steps or (every and step % every == 0):
            self.evaluate(step)

    def evaluate(self, step: int) -> None:
        """The held-out loss of the weights after `step` (every rank), told to the sinks; a
        new best is due to be checkpointed when an early stop may export it."""
        assert self.early is not None
        texts = not self.weights.texts_trained

        def loss_of(slot: int, gen: torch.Generator) -> torch.Tensor:
            batch = self._load_items([self.items[self.held[slot]]], gen, texts=texts)
            return loop.batch_loss(self.engine_, batch, self.ctx, gen)

        with client_optimizer.eval_weights(self.engine_, "the held-out loss"):
            loss = evaluation.held_out_loss(
                self.engine_, [held_out.identity(self._scanned_item(i)) for i in self.held],
                seed=self.settings.seed, rank=self.rank, world=self.world, loss_of=loss_of,
            )  # fmt: skip
        if self.early.update(step, loss) and self.early.patience:
            self.due.add("best")
        for sink in self.sinks:
            sink.on_eval(step, loss)
        if self.rank == 0:
            self._write_eval_record()

    def _scanned_item(self, index: int) -> Any:
        """The scanned item behind cache item `index` (training images, then held-out ones)."""
        return self.cached[0].items[index]

    def _write_eval_record(self, exported: int | None = None) -> None:
        """run/eval.json: the last and the best held-out loss (the model card names the best),
        and after an early stop the step exported."""
        assert self.early is not None
        _write_json(
            self.run_dir / "eval.json",
            {
                "held_out_images": len(self.held),
                **self.early.state(),
                "stopped_early_at": self.stopped_early,
                "exported_step": exported,
            },
        )

    def after_step(self, record: StepRecord) -> None:
        s, step = self.settings, record.step
        if self.ema is not None and not record.skipped:  # a skipped step changed no weight
            self.ema.update(self.engine_.module)
        if s.checkpoint_every_steps and step % s.checkpoint_every_steps == 0:
            self.due.add("save")
        every = s.validation_every_steps
        if s.validation_prompts and every and step % every == 0:
            self.due.add("validate")
        # the end-of-run checkpoint and samples follow in finish(); a checkpoint or samples due
        # at a skipped (non-finite) step wait for the next step that applies, so no checkpoint
        # lands inside a run of them
        act = step != s.max_steps and not record.skipped
        # a new best held-out loss is checkpointed at once (whatever the step): an early stop
        # exports it
        best = "best" in self.due and step != s.max_steps
        self.due.discard("best")
        saved = False
        if (act and "save" in self.due) or best:
            self.save(step)
            saved = True
        if self.stop.agreed():
            if not saved:
                self.save(step)  # the weights of the last step that applied
            raise Stopped(step, self.stop.name)
        if self.early is not None and self.early.exhausted:
            if not saved:
                self.save(step)
            raise evaluation.EarlyStopped(step)
        if act and "validate" in self.due:
            self.validate(step)

    def require_finite_weights(self, step: int, doing: str) -> None:
        """Nothing is committed, rendered or exported from non-finite weights (an update
        that overflowed them despite a finite gradient norm: a far too high learning rate)."""
        if not nonfinite.weights_finite(self.engine_.module):
            last = checkpoint.last_committed(self.settings.output_dir)
            raise Diverged(
                f"training diverged: the weights are non-finite after step {step}; not "
                f"{doing} them. {nonfinite.resume_hint(last)}"
            )

    def save(self, step: int) -> None:
        self.require_finite_weights(step, "saving")
        self.due.discard("save")
        self.phase("checkpointing")
        s, job = self.settings, self.job
        meta = {
            "base_model": str(self.source),
            "model": job.model,
            "family": job.family,
            "denoiser_params": job.denoiser_params,
            "zero_stage": job.zero_stage,
            "world_size": self.world,
            "mixed_precision": job.mixed_precision,
            "position": asdict(self.position),
            "optimizer": str(job.deepspeed.get("optimizer", {}).get("type", s.optimizer)),
            **self.weights.manifest_entries(),
            **({"expert": s.expert, "denoiser": self.part} if self.part else {}),
            **({"eval": self.early.state()} if self.early is not None else {}),
            # the best evaluated step: kept by the local and the remote rotation
            **({"keep_step": pinned} if (pinned := self._kept_step()) is not None else {}),
        }
        with client_optimizer.eval_weights(self.engine_, "the checkpoint"):
            seconds = self._save(step, meta)
        for sink in self.sinks:
            sink.on_checkpoint(step, seconds)
        self.phase("training")

    def _save(self, step: int, meta: dict[str, Any]) -> float:
        s = self.settings
        return checkpoint.save(
            self.engine_,
            output_dir=s.output_dir,
            step=step,
            meta=meta,
            ema=self.ema.shadow if self.ema else None,
            ema_updates=self.ema.updates if self.ema else 0,
            keep=s.checkpoints_keep,
            rank=self.rank,
            keep_step=self._kept_step(),
        )

    def _kept_step(self) -> int | None:
        """The best evaluated step, which an early stop exports: it outlives the rotation."""
        return self.early.best_step if self.early and self.early.patience else None

    def validate(self, step: int) -> None:
        self.require_finite_weights(step, "sampling")
        self.due.discard("validate")
        self.phase("validating")
        s = self.settings
        with (
            client_optimizer.eval_weights(self.engine_, "samples"),
            self.weights.to_render(
                self.engine_.module, rank=self.rank, source=self.source, part=self.part
            ) as trained,
        ):
            if trained is not None:  # the ranks that render
                samples.render(
                    self.source,
                    trained.state,
                    family=self.job.family,
                    lora_dir=trained.lora_dir,
                    prompts=s.validation_prompts,
                    out_dir=s.output_dir / "samples" / f"step-{step}",
                    resolution=self.job.resolution,
                    inference_steps=s.validation_inference_steps,
                    guidance_scale=s.validation_guidance_scale,
                    seed=s.seed,
                    device=self.device,
                    pipeline_kwargs=self.conditioning.pipeline_kwargs(s),
                    video_frames=s.video_frames,  # a video family's samples are clips
                    video_fps=s.video_fps,
                    denoiser=self.part,
                    base_precision=trained.base_precision,
                    inputs=self.sample_inputs,
                    # from an input: the family's pipeline (TI2V-5B's folder names WanPipeline)
                    pipeline=self.conditioning.pipeline_class() if self.sample_inputs else None,
                )
        distributed.barrier()
        for sink in self.sinks:  # the trackers (ZT_REPORT_TO) show the images
            sink.on_samples(step, s.output_dir / "samples" / f"step-{step}")
        self.phase("training")

    # --- the end --------------------------------------------------------------------------
    def finish(self) -> str:
        """The last checkpoint, samples and the export; returns the run's one line."""
        s = self.settings
        if self.stopped_early is not None:
            return self._finish_early(self.stopped_early)
        step = s.max_steps
        if self.start_step < step:
            self.save(step)
        if s.validation_prompts:
            self.validate(step)
        self.require_finite_weights(step, "exporting")  # a resume at the last step saves none
        self._export()
        return f"finished at step {step}"

    def _finish_early(self, step: int) -> str:
        """An early stop: `step` is committed; the best evaluated step's weights are exported."""
        assert self.early is not None and self.early.best_step is not None
        best = self.early.best_step
        if best != step:
            path = checkpoint.checkpoints_dir(self.settings.output_dir) / f"step-{best}"
            resumed = checkpoint.load(self.engine_, path)
            client_optimizer.resume_training_weights(self.engine_)
            if self.ema is not None and resumed.ema is not None:
                self.ema.load(resumed.ema, resumed.ema_updates)
        self.require_finite_weights(best, "exporting")
        self._export()
        line = self.early.why(step)
        if self.rank == 0:
            self._write_eval_record(exported=best)
            log.info("%s", line)
        return line

    def _export(self) -> None:
        self.phase("exporting")
        with client_optimizer.eval_weights(self.engine_, "the export"):
            exported = self.weights.export(
                self.engine_.module, rank=self.rank, ema=self.ema, source=self.source,
                part=self.part,
            )  # fmt: skip
        if exported is not None:  # rank 0 wrote them
            self._loss_curve()
            log.info("exported %s", exported.files)
            if exported.note:
                log.info("%s", exported.note)
        distributed.barrier()

    def _loss_curve(self) -> None:
        try:
            from zerotuner.monitor.report import loss_curve_png
        except ImportError:
            return
        steps = self.run_dir / "steps.jsonl"
        if steps.is_file():  # a resume at the last step trains (and logs) nothing
            loss_curve_png(steps, self.run_dir / "loss.png")
