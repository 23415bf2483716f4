"""One training rank: `python -m zerotuner.train.worker`, started by torchrun (one per device).

Settings come from the environment and config file, decisions from the Job file
(`ZT_JOB_FILE`). `train()` is the whole per-rank job and reads rank and world size from
torch.distributed, so another launcher (Ray Train, Kubeflow) can call it unchanged. The phases:
loading -> caching -> training (with checkpointing and validating) -> exporting. This is the
only module that calls `deepspeed.initialize`.

Each rank writes its exit status (records.write_rank_status): 0 done, 2 ConfigError,
3 EnvironmentUnfit, 4 Diverged (non-finite steps, see zerotuner.train.nonfinite), 200 PeerLost
(another node of the job was lost: zerotuner.launch.peers), 1 anything else; torchrun itself
exits 1 for every failure. A rank dies with its agent (`peers.die_with_parent`).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sys
import tempfile
import threading
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from zerotuner import families
from zerotuner.data.buckets import bucket_name, dataset_buckets
from zerotuner.data.clips import video_sampling
from zerotuner.data.notes import recipe_notes, upscale_warning
from zerotuner.data.order import Position, iterate_batches
from zerotuner.data.scan import scan_sources
from zerotuner.errors import (
    EXIT_DIVERGED,
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_PEER_LOST,
    EXIT_SIGNAL,
    Diverged,
    PeerLost,
    ZeroTunerError,
)
from zerotuner.launch import distributed, peers
from zerotuner.launch.job import Job, load_job, wait_for_job
from zerotuner.launch.records import Sink, StepRecord, write_rank_armed, write_rank_status
from zerotuner.settings import datasets
from zerotuner.settings.effective import effective_settings
from zerotuner.settings.schema import Settings
from zerotuner.train import caching, loop, model, nonfinite, samples, speed
from zerotuner.train.stop import Stopped, StopRequest
from zerotuner.weights import checkpoint, lora, lora_files, lora_from, lora_text, pipeline_folder
from zerotuner.weights.ema import EMA, full_state_dict

log = logging.getLogger("zerotuner.train.worker")


def build_sinks(
    settings: Settings, job: Job, *, world: distributed.World, resume: Path | None
) -> list[Sink]:
    """Every consumer of step records on this rank: the one place sinks plug in. `resume`:
    the checkpoint this run continues from (its step starts the progress count)."""
    from zerotuner.monitor.logs import ProgressSink
    from zerotuner.monitor.metrics import PrometheusSink

    rank, device = world.rank, world.device
    start = int((checkpoint.read_manifest(resume) or {}).get("step", 0)) if resume else 0
    sinks: list[Sink] = [
        PrometheusSink(
            rank, device=device, world_size=job.world_size, max_steps=settings.max_steps
        ),
        ProgressSink(
            rank,
            max_steps=settings.max_steps,
            every_steps=settings.log_every_steps,
            start_step=start,
            device=device,
        ),
    ]
    if rank == 0:
        sinks.append(loop.StepsJsonlSink(settings.output_dir / "run" / "steps.jsonl"))
    return sinks


def _write_json(path: Path, payload: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True, default=str) + "\n")


class Run:
    """The state of one rank's job, built phase by phase."""

    def __init__(
        self, settings: Settings, job: Job, *, sinks: Sequence[Sink], world: distributed.World
    ):
        self.settings, self.job, self.sinks = settings, job, list(sinks)
        self.place = world  # rank, local rank, world size, device: read once
        self.rank, self.world = world.rank, world.size
        self.run_dir = settings.output_dir / "run"
        self.device = world.device
        self.dtype = model.train_dtype(job.mixed_precision)
        self.position = Position()
        self.ema: EMA | None = None
        self.base_digest: str | None = None  # LoRA: sha256 of the base weights it sits on
        self.text_metadata: dict[str, Any] | None = None  # LoRA on the text encoders too
        self.initial_adapter: dict[str, torch.Tensor] | None = None  # PiSSA / OLoRA's start
        self.adapter_file: lora_from.AdapterFile | None = None  # ZT_LORA_FROM's, read
        self.stop = StopRequest(settings.collective_timeout_seconds)
        write_rank_armed(self.rank)  # a SIGTERM before this line killed a rank with nothing to save
        self.guard: nonfinite.PlainStepGuard | None = None
        self.due: set[str] = set()  # "save", "validate": due at a skipped step, done at the next

    def phase(self, name: str) -> None:
        for sink in self.sinks:
            sink.on_phase(name)

    # --- loading ------------------------------------------------------------------------
    def load(self) -> None:
        s, job = self.settings, self.job
        token = s.hf_token.get_secret_value() if s.hf_token else None
        if not Path(job.model).expanduser().is_dir():
            self.phase("downloading")  # a hub id: fetched, or found in the cache, per node

        def resolve() -> Path:
            return model.fetch_model(
                job.model, cache_dir=s.cache_dir, token=token, revision=job.revision
            )

        if self.place.node_leader:  # one download per node
            self.source = resolve()
        distributed.barrier()
        self.phase("loading")
        if not self.place.node_leader:
            self.source = resolve()
        self.conditioning = families.get(job.family).configured(s, self.source)
        # Wan 2.2 A14B's expert (ZT_EXPERT): the folder trained, exported and sampled
        self.part = self.conditioning.denoiser if s.expert else None
        self.components = model.load_components(
            self.source,
            job.family,
            gradient_checkpointing=job.gradient_checkpointing,
            with_frozen=False,
            deepspeed_config=job.deepspeed,
            # a LoRA base is frozen: loaded straight in the run's dtype, no fp32 copy
            dtype=self.dtype if s.training_type == "lora" else torch.float32,
            denoiser=self.part,
        )
        self.objective = self.conditioning.objective(
            s, self.components.scheduler, self.components.denoiser.config
        )
        self.video = video_sampling(s, self.conditioning, self.source)  # None: images
        self.dataset = scan_sources(
            datasets.sources(s), s.cache_dir, log_skipped=self.rank == 0,
            write_index=self.place.node_leader, min_image_size=s.min_image_size,
            video=self.video,
            datasets_file=s.datasets_file,
        )  # fmt: skip
        # one bucket rule, the one `check` reports (families.bucket_step)
        multiple = families.bucket_step(
            job.family, Path(self.source), resolution=job.resolution, denoiser=self.part
        )
        self.buckets = dataset_buckets(
            self.dataset, job.resolution, multiple=multiple, upscale=s.upscale
        )
        if self.rank == 0:  # every rank scanned the same files: count them once
            for sink in self.sinks:
                if hasattr(sink, "on_dataset_skipped"):
                    sink.on_dataset_skipped(len(self.dataset.skipped))
            _write_json(
                self.run_dir / "dataset.json",
                {
                    "images": len(self.dataset),
                    "datasets": [
                        {"path": p.label, "images": len(p.dataset), "repeats": p.repeats}
                        for p in self.dataset.parts
                    ],
                    "skipped": [[str(p), why] for p, why in self.dataset.skipped],
                    "buckets": {bucket_name(b): len(ix) for b, ix in self.buckets.items()},
                },
            )
            log.info(
                "dataset: %s, %d skipped, %d bucket(s); %s",
                self.dataset.summary(), len(self.dataset.skipped), len(self.buckets),
                self.objective.describe(),
            )  # fmt: skip
            if upscaled := upscale_warning(
                self.dataset, job.resolution, multiple=multiple, upscale=s.upscale
            ):
                log.warning("%s", upscaled)
            if notes := recipe_notes(
                self.dataset, job.resolution, multiple=multiple,
                caption_template=s.caption_template, caption_dropout=s.caption_dropout,
                min_image_size=s.min_image_size, upscale=s.upscale,
                timestep_range=s.timestep_range,
            ):  # fmt: skip
                log.info("dataset recipes: %s", "; ".join(notes))

    # --- caching ------------------------------------------------------------------------
    def cache(self) -> None:
        self.phase("caching")
        self.features, self.items, stats = caching.fill(
            self.settings, self.source, self.components, self.conditioning, self.dataset,
            self.buckets, rank=self.rank, world=self.world, device=torch.device(self.device),
            dtype=self.dtype, texts=not self.settings.lora_text_encoder,
        )  # fmt: skip
        if self.rank == 0:
            _write_json(self.run_dir / "cache.json", stats.as_dict())
            log.info(
                "cache: %d latents encoded, %d reused; %d texts encoded, %d reused%s",
                stats.latents_encoded, stats.latents_reused, stats.texts_encoded,
                stats.texts_reused,
                "" if stats.texts_encoded or stats.texts_reused else
                " (the text encoders train: captions are encoded at every step)",
            )  # fmt: skip

    # --- engine and resume ----------------------------------------------------------------
    def engine(self, resume: Path | None) -> None:
        import deepspeed

        s, config = self.settings, dict(self.job.deepspeed)
        trained = self.components.denoiser
        if s.training_type == "lora":  # before ZeRO-3 partitions the UNet
            lora.add_adapter(trained, s)
            if self.adapter_file is not None and resume:
                log.info("%s: not loaded, the checkpoint resumed continues it", lora_from.NAME)
            elif self.adapter_file is not None:
                lora_from.load_into(trained, self.adapter_file)
            self.initial_adapter = lora.initial_adapter(trained, s.lora_init)  # PiSSA, OLoRA
            self.adapter_metadata = lora.metadata(lora.lora_config(s))
            if s.lora_text_encoder:
                trained, self.tokenizers = lora_text.build(
                    trained, self.source, self.job.family, lora.adapter_settings(s),
                    seed=s.seed, gradient_checkpointing=self.job.gradient_checkpointing,
                )  # fmt: skip
                self.text_metadata = lora.metadata(lora_text.text_config(lora.adapter_settings(s)))
            self.adapter_shapes = lora.shapes(trained)
        params = [p for p in trained.parameters() if p.requires_grad]
        speed.prepare(  # SDPA attention; compiled blocks where ZT_COMPILE decides so
            self.components.denoiser, s, accelerator=self.job.device,
            zero_stage=self.job.zero_stage, shapes=len(self.buckets),
        )  # fmt: skip
        self.engine_, _, _, _ = deepspeed.initialize(
            model=trained, model_parameters=params, config=config
        )
        log.info("DeepSpeed engine ready (ZeRO-%d)", self.engine_.zero_optimization_stage())
        speed.skip_lone_allreduce(self.engine_)
        speed.foreach_clip(self.engine_)
        self.guard = nonfinite.guard_plain_optimizer(self.engine_)  # ZeRO-0 fp32's skip
        if self.rank == 0:  # the entrypoint logs it; the run folder keeps it
            _write_json(self.run_dir / "deepspeed.json", config)
        self.start_step = 0
        resumed = checkpoint.load(self.engine_, resume) if resume else None
        if resumed:
            self.start_step = resumed.step
            self.position = Position(**(resumed.position or {}))
            log.info("resumed from %s at step %d", resumed.path, resumed.step)
        if self.settings.ema:
            self.ema = EMA(
                self.engine_.module, decay=self.settings.ema_decay, rank=self.rank,
                trainable_only=self.settings.training_type == "lora",
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
        self.phase("training")
        texts = not s.lora_text_encoder  # else batches carry token ids (lora_text.TrainedText)
        ctx = loop.LoopContext(
            conditioning=self.conditioning if texts else lora_text.TrainedText(self.conditioning),
            objective=self.objective,
            dtype=self.dtype,
            seed=s.seed,
            rank=self.rank,
            accumulation=self.engine_.gradient_accumulation_steps(),
            samples_per_step=self.engine_.train_batch_size(),  # micro * accumulation * world
            load_batch=functools.partial(self._load_batch, texts=texts),
            guard=self.guard,
            streak=nonfinite.Streak(
                s.max_nonfinite_steps, rank=self.rank,
                counts=not self.engine_.fp16_enabled(),  # fp16: the loss scaler's skips
                last_checkpoint=lambda: checkpoint.last_committed(s.output_dir),
            ),
        )  # fmt: skip
        loop.train(self.engine_, self.steps(), ctx, sinks=self.sinks, after_step=self.after_step)
        ctx.streak.summary()
        if graphs := speed.graphs_built():
            log.info("speed: %d graphs compiled in this rank (blocks x bucket shapes)", graphs)

    def _load_batch(
        self, keys: tuple[list[int], int], gen: torch.Generator, *, texts: bool
    ) -> dict:
        items = caching.batch_items(
            self.items, keys, seed=self.settings.seed, caption_dropout=self.settings.caption_dropout
        )
        batch = self.features.load_batch(items, gen, texts=texts)
        if not texts:
            captions = [item.caption for item in items]
            batch["input_ids"] = self.conditioning.tokens(self.tokenizers, captions)
        return batch

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
        saved = False
        if act and "save" in self.due:
            self.save(step)
            saved = True
        if self.stop.agreed():
            if not saved:
                self.save(step)  # the weights of the last step that applied
            raise Stopped(step, self.stop.name)
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
            **lora.manifest_entries(s, base_digest=self.base_digest),
            **({"expert": s.expert, "denoiser": self.part} if self.part else {}),
        }
        seconds = checkpoint.save(
            self.engine_,
            output_dir=s.output_dir,
            step=step,
            meta=meta,
            ema=self.ema.shadow if self.ema else None,
            ema_updates=self.ema.updates if self.ema else 0,
            keep=s.checkpoints_keep,
            rank=self.rank,
        )
        for sink in self.sinks:
            sink.on_checkpoint(step, seconds)
        self.phase("training")

    def validate(self, step: int) -> None:
        self.require_finite_weights(step, "sampling")
        self.due.discard("validate")
        self.phase("validating")
        s = self.settings
        render = functools.partial(
            samples.render,
            self.source,
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
        )
        if s.training_type == "lora":  # the base pipeline with the adapter as saved so far
            with tempfile.TemporaryDirectory() as tmp:
                if self._write_adapter(Path(tmp) / "adapter"):
                    render(None, lora_dir=Path(tmp) / "adapter")
        else:
            state = full_state_dict(self.engine_.module, rank=self.rank)  # collective
            if state is not None:
                render(state)
        distributed.barrier()
        self.phase("training")

    # --- the end --------------------------------------------------------------------------
    def finish(self) -> None:
        s = self.settings
        step = s.max_steps
        if self.start_step < step:
            self.save(step)
        if s.validation_prompts:
            self.validate(step)
        self.require_finite_weights(step, "exporting")  # a resume at the last step saves none
        self.phase("exporting")
        if s.training_type == "lora":
            final = s.output_dir / "final"
            if self._write_adapter(final, merge=s.lora_merge):
                if self.ema is not None:
                    lora_files.write_adapter(
                        self.job.family, self.ema.state_dict(), self.adapter_shapes,
                        self.adapter_metadata, s.output_dir / "final-ema",
                        text_metadata=self.text_metadata, initial=self.initial_adapter,
                        denoiser=self.part, base=self.source,
                    )  # fmt: skip
                self._loss_curve()
                log.info(
                    "exported %s%s%s", final / lora_files.ADAPTER_FILE,
                    f" and {final / lora_files.MERGED}" if s.lora_merge else "",
                    " and final-ema" if self.ema else "",
                )  # fmt: skip
                if self.part == "transformer_2":  # diffusers' WanLoraLoaderMixin
                    log.info(
                        "the adapter is the low-noise expert's: load it with "
                        "WanPipeline.load_lora_weights(final, load_into_transformer_2=True)"
                    )
            distributed.barrier()
            return
        state = full_state_dict(self.engine_.module, rank=self.rank)  # collective
        if self.rank == 0:
            out = pipeline_folder.write_pipeline(
                self.source, state, s.output_dir / "final", denoiser=self.part
            )
            if self.ema is not None:
                pipeline_folder.write_pipeline(
                    self.source, self.ema.state_dict(), s.output_dir / "final-ema",
                    denoiser=self.part,
                )  # fmt: skip
            self._loss_curve()
            log.info("exported %s%s", out, " and final-ema" if self.ema else "")
        distributed.barrier()

    def _write_adapter(self, out: Path, *, merge: bool = False) -> bool:
        return lora_files.write_gathered(
            self.engine_.module, rank=self.rank, family=self.job.family,
            expected=self.adapter_shapes, adapter_metadata=self.adapter_metadata, out=out,
            text_metadata=self.text_metadata, merge_base=self.source if merge else None,
            initial=self.initial_adapter, denoiser=self.part, base=self.source,
        )  # fmt: skip

    def _loss_curve(self) -> None:
        try:
            from zerotuner.monitor.report import loss_curve_png
        except ImportError:
            return
        steps = self.run_dir / "steps.jsonl"
        if steps.is_file():  # a resume at the last step trains (and logs) nothing
            loss_curve_png(steps, self.run_dir / "loss.png")


class Whereabouts:
    """A sink that remembers where the run is (the last finished step, the phase), for the
    line a lost node ends this rank with."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.phase = "starting"

    def on_phase(self, phase: str) -> None:
        self.phase = phase

    def on_step(self, record: StepRecord) -> None:
        self.step = record.step

    def on_checkpoint(self, step: int, seconds: float) -> None:
        pass

    def close(self) -> None:
        pass


def lost_line(lost: peers.LostPeers, where: Whereabouts, settings: Settings) -> str:
    """One line: which node was lost, when, and what a restart resumes from."""
    when = f"after step {where.step}" if where.step else f"while {where.phase} (no step yet)"
    last = checkpoint.last_committed(settings.output_dir)
    if settings.resume == "never":
        resumes = "starts over (ZT_RESUME=never)"
    elif last is None:
        resumes = "starts over: no checkpoint was committed yet"
    else:
        resumes = f"resumes from {last}"
    return (
        f"lost {lost.describe()} {when}: it {lost.how}. Restart every node (exit "
        f"{EXIT_PEER_LOST}, retryable); training {resumes}"
    )


def _say_lost(error: PeerLost) -> None:
    """The line, once per node (every rank of a surviving node knows the same)."""
    if distributed.World.from_environ().node_leader:
        print(f"zerotuner: error: {error}", file=sys.stderr, flush=True)


def _end_lost(lost: peers.LostPeers, *, rank: int, where: Whereabouts, settings: Settings) -> None:
    """The watch found the node lost while this rank's main thread may wait in a collective
    that never returns (NCCL): say so, record the status and end the process from here."""
    try:
        error = PeerLost(lost_line(lost, where, settings))
        _say_lost(error)
        write_rank_status(rank, EXIT_PEER_LOST, str(error))
    finally:
        sys.stderr.flush()
        os._exit(EXIT_PEER_LOST)


def _lost(watch: peers.PeerWatch | None, where: Whereabouts, settings: Settings) -> PeerLost | None:
    """After a failure: the lost node it came from, if one was lost (else None: the failure is
    this node's own)."""
    if watch is None:
        return None
    lost = watch.diagnose()
    if lost is None:
        return None
    if not watch.claim():  # the watch's thread is ending this rank with the same verdict
        threading.Event().wait()
    return PeerLost(lost_line(lost, where, settings))


def train(settings: Settings, job: Job, *, sinks: Sequence[Sink] | None = None) -> int:
    """The whole job of one rank; returns its exit code (and writes it as its rank status)."""
    rank, code, message = distributed.World.from_environ().rank, EXIT_FAILURE, ""
    where, watch = Whereabouts(), None
    try:
        world = distributed.init_distributed(
            device=job.device, master_addr=job.master_addr, master_port=job.master_port,
            timeout_seconds=settings.collective_timeout_seconds,
        )  # fmt: skip
        rank = world.rank
        watch = peers.start_watch(
            rank=rank, world=world.size, master_addr=job.master_addr, master_port=job.master_port,
            silent_seconds=settings.peer_timeout_seconds,
            on_lost=functools.partial(_end_lost, rank=rank, where=where, settings=settings),
        )  # fmt: skip
        if rank == 0:
            for warning in distributed.timeout_warnings(settings, device=job.device):
                log.warning("%s", warning)
        lora.check_settings(settings)  # preflight did too; a launcher of its own may not
        families.check_family_settings(settings, job.family)
        # ZT_LORA_FROM's rank, alpha and targets (preflight checked the file against the model)
        settings, adapter_file = lora_from.apply(settings, job.family, check=False)
        if rank == 0:  # before anything looks for a checkpoint to resume
            checkpoint.restore_set_aside(settings.output_dir)
        distributed.barrier()
        resume = checkpoint.find_resume(settings.resume, settings.output_dir)  # hashes files
        if resume:
            manifest = checkpoint.read_manifest(resume) or {}
            checkpoint.check_model(
                manifest, family=job.family, denoiser_params=job.denoiser_params,
                model=job.model, path=resume, expert=settings.expert,
            )  # fmt: skip
            lora.check_resume(manifest, settings, resume)
        if sinks is None:
            sinks = build_sinks(settings, job, world=world, resume=resume)
        sinks = [*sinks, where]
        run = Run(settings, job, sinks=sinks, world=world)
        run.adapter_file = adapter_file
        run.load()
        if settings.training_type == "lora":  # an adapter resumes only onto its own base
            run.base_digest = lora.base_for_resume(run.source, settings, resume, rank=rank)
        run.cache()
        if run.stop.agreed():  # signalled while downloading or caching: no step to save yet
            raise Stopped(None, run.stop.name)
        run.engine(resume)
        run.train()
        run.finish()
        if watch is not None:
            watch.settle()
        code, message = EXIT_OK, f"finished at step {settings.max_steps}"
    except Stopped as stopped:
        if watch is not None:
            watch.settle()
        code, message = EXIT_SIGNAL, str(stopped)
        resumes = f"at step {stopped.step + 1}" if stopped.step else "where this one started"
        log.warning("%s: exit %d, a restart resumes %s", stopped, code, resumes)
    except ZeroTunerError as error:
        # a rank that stopped hearing from the others (caching's wait) may have lost a node
        lost = _lost(watch, where, settings) if error.exit_code == EXIT_FAILURE else None
        if watch is not None:
            watch.settle()
        if lost is not None:
            error = lost
            _say_lost(error)
        # every rank diverges at the same step: rank 0 says it once
        elif rank == 0 or not isinstance(error, Diverged):
            for line in error.problems:
                print(f"zerotuner: error: {line}", file=sys.stderr, flush=True)
        code, message = error.exit_code, str(error)
    except Exception as error:  # noqa: BLE001 - the status must be written whatever happened
        lost = _lost(watch, where, settings)  # a failed collective: a node lost?
        if watch is not None:
            watch.settle()
        if lost is not None:
            _say_lost(lost)
            code, message = lost.exit_code, str(lost)
        else:
            traceback.print_exc()
            code, message = EXIT_FAILURE, f"{type(error).__name__}: {error}"
    finally:
        if watch is not None:
            watch.settle()
        for sink in sinks or ():
            if code != EXIT_OK and hasattr(sink, "unfinished"):
                sink.unfinished()  # the progress summary must not read as a finished run
            sink.close()
        write_rank_status(rank, code, message)
        if code in (EXIT_OK, EXIT_SIGNAL, EXIT_DIVERGED):  # every rank got here together
            distributed.leave_group()
    return code


def _import_libraries() -> None:
    """diffusers' model classes and transformers, imported while the entrypoint still plans
    (seconds, the family not known yet: one import brings every denoiser class); no per-file
    progress bars from either in a training log."""
    import diffusers
    import transformers
    from diffusers import AutoencoderKL, UNet2DConditionModel  # noqa: F401

    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.disable_progress_bar()
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def main() -> None:
    """torchrun's entry: settings, imports, the job, logging, then train(); exits with the
    rank's code. The entrypoint starts the ranks before it has planned: the imports here
    overlap its planning, then `wait_for_job` waits for the job file."""
    from zerotuner.monitor.logs import demote_known_noise, rank_level, setup_logging

    peers.die_with_parent()  # no rank trains on alone after its agent was killed
    world = distributed.World.from_environ()
    rank = world.rank
    if os.environ.get("DS_ACCELERATOR") == "cpu":  # JIT-built ops: deepspeed.initialize asks
        speed.warm_cpu_info()  # for it; the answer comes while the rank imports
    demote_known_noise()  # before DeepSpeed's import, which may print some
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING)
    try:
        # the entrypoint's settings path, read again (secrets never pass through the job file);
        # it warned about unknown names already
        settings = effective_settings(warn=False).settings
        level = rank_level(settings.log_level, rank)
        logging.getLogger().setLevel(level)  # ZT_LOG_LEVEL=debug shows what the import prints
        import deepspeed  # noqa: F401 - its logger must exist before ours adopts it

        _import_libraries()
        job = load_job(wait_for_job())  # DS_ACCELERATOR came with the launcher's environment
    except ZeroTunerError as error:
        for line in error.problems:
            print(f"zerotuner: error: {line}", file=sys.stderr, flush=True)
        write_rank_status(rank, error.exit_code, str(error))
        sys.exit(error.exit_code)
    token = settings.hf_token.get_secret_value() if settings.hf_token else None
    setup_logging(
        rank=rank,
        world_size=world.size,
        log_format=settings.log_format,
        level=level,
        secrets=[token],
    )
    code = train(settings, job)
    # Done and recorded (status written, files closed, group left): interpreter teardown
    # once aborted a finished rank in C++ destructors (SIGABRT), failing a done run.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
