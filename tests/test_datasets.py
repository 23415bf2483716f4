"""Data as people keep it (issue 31): several datasets in one run (ZT_DATASETS_FILE) with
repeats, their own caption template, caption files and resolution; datasets on an
S3-compatible server (moto) and on the Hugging Face Hub (parquet shards, served by the fake
hub); loss masks beside the images. The slow test at the end is the issue's whole run."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import trainkit as tk
import yaml
from fakehub import FakeHub
from PIL import Image
from s3server import KEY_ID, SECRET, S3Server, served

from zerotuner.data.buckets import dataset_buckets
from zerotuner.data.loading import load_example
from zerotuner.data.order import Position, epoch_batches, iterate_batches
from zerotuner.data.scan import scan, scan_sources
from zerotuner.errors import ConfigError
from zerotuner.families.ddpm import masked_mse
from zerotuner.preflight.fetch import MANIFEST, fetch_all
from zerotuner.settings.datasets import DatasetSource, local_folder, sources
from zerotuner.settings.schema import Settings
from zerotuner.train import caching
from zerotuner.train.feature_cache import FeatureCache

BUCKET = "datasets"


s3 = served(BUCKET)


def _client(s3: S3Server):
    import boto3

    return boto3.client("s3", endpoint_url=s3.url, aws_access_key_id=KEY_ID,
                        aws_secret_access_key=SECRET, region_name="us-east-1")  # fmt: skip


def _upload(s3: S3Server, prefix: str, files: list[Path]) -> None:
    client = _client(s3)
    for path in files:
        client.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.name}", Body=path.read_bytes())


def _demo_files(demo_dir: Path, start: int, count: int) -> list[Path]:
    """`count` demo images from `start` on, with their caption files."""
    images = sorted((demo_dir / "data").glob("*.png"))[start : start + count]
    return [f for image in images for f in (image, image.with_suffix(".txt"))]


def _copy(files: list[Path], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for path in files:
        shutil.copy(path, folder / path.name)
    return folder


def _datasets_file(tmp_path: Path, entries: object) -> Path:
    path = tmp_path / "datasets.yaml"
    path.write_text(yaml.safe_dump(entries))
    return path


def _parquet_repo(folder: Path, demo_dir: Path, count: int = 6) -> list[str]:
    """A dataset repo in the hub's layout: README.md and data/train-*.parquet with the hub's
    Image feature ({bytes, path}) and a `text` column; one row's bytes are no image. Returns the
    captions of the good rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    images = sorted((demo_dir / "data").glob("*.png"))[:count]
    captions = [f"hub caption {i}" for i in range(count)]
    rows = [{"bytes": p.read_bytes(), "path": p.name} for p in images]
    rows.append({"bytes": b"not an image at all", "path": None})
    table = pa.table({"image": rows, "text": [*captions, "broken"]})
    (folder / "data").mkdir(parents=True)
    pq.write_table(table, folder / "data" / "train-00000-of-00001.parquet")
    (folder / "README.md").write_text("---\nlicense: mit\n---\n")
    return captions


# --- the datasets file ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({"datasets": [{"path": "/x", "repeats": 0}]},
         "datasets[0].repeats: Input should be greater than or equal to 1 (got 0)"),
        ({"datasets": [{"path": "/x", "colour": "red"}]},
         "datasets[0].colour: Extra inputs are not permitted"),
        ({"datasets": ["/x", {"path": "ftp://host/x"}]},
         "datasets[1].path: not a dataset location; use a folder, s3://bucket/prefix or "
         "hf://datasets/owner/name"),
        ({"datasets": [{"path": "hf://owner/name"}]}, "hf://datasets/owner/name"),
        ({"datasets": [{"path": "/x", "caption_template": "sks"}]},
         "datasets[0].caption_template: needs {caption} exactly once"),
        ({"datasets": [{"path": "/x", "caption_extension": ".png"}]},
         "datasets[0].caption_extension: a file suffix such as .txt"),
        ({"datasets": [{"path": "/x", "resolution": 10}]}, "datasets[0].resolution"),
        ({"datasets": []}, "expected `datasets:` with a list of entries"),
        ({"data": ["/x"]}, "unknown key 'data'"),
    ],
)  # fmt: skip
def test_a_bad_datasets_file_is_one_line_exit_2(
    demo_job_env, tmp_path, capsys, entries, message
) -> None:
    from zerotuner.cli import main

    demo_job_env.setenv("ZT_DATASETS_FILE", str(_datasets_file(tmp_path, entries)))
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    assert message in err and "ZT_DATASETS_FILE=" in err, err
    assert "Traceback" not in err


def test_a_data_url_of_no_known_kind_names_zt_data_dir(demo_job_env, capsys) -> None:
    from zerotuner.cli import main

    demo_job_env.setenv("ZT_DATA_DIR", "gs://bucket/images")
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    assert "ZT_DATA_DIR='gs://bucket/images': not a dataset location" in err
    assert "Traceback" not in err


def test_a_dataset_folder_overlapping_the_output_is_refused(demo_job_env, tmp_path, capsys):
    from zerotuner.cli import main

    entries = {"datasets": [str(tmp_path / "output" / "images")]}
    demo_job_env.setenv("ZT_DATASETS_FILE", str(_datasets_file(tmp_path, entries)))
    assert main(["config"]) == 2
    err = capsys.readouterr().err
    assert "ZT_OUTPUT_DIR=" in err and "holds the dataset" in err and "of ZT_DATASETS_FILE" in err


def test_repeats_resolution_template_and_caption_files_per_dataset(demo_dir, tmp_path) -> None:
    portraits = _copy(_demo_files(demo_dir, 0, 4), tmp_path / "portraits")
    styles = _copy(_demo_files(demo_dir, 4, 6), tmp_path / "styles")
    for caption in styles.glob("*.txt"):  # BLIP-style .caption files instead of .txt
        caption.rename(caption.with_suffix(".caption"))
    found = [
        DatasetSource(path=str(portraits), repeats=3, caption_template="sks {caption}"),
        DatasetSource(path=str(styles), resolution=128, caption_extension=".caption"),
    ]
    dataset = scan_sources(found, tmp_path / "cache", log_skipped=False)
    assert len(dataset) == 10 and not dataset.skipped  # the .caption files are not "skipped"
    assert dataset.summary() == (
        f"10 images in 2 datasets: 4 images in {portraits} (x3), 6 images in {styles} (128 px)"
    )
    first, second = dataset.items[:4], dataset.items[4:]
    assert all(item.caption.startswith("sks ") for item in first)
    assert [i.caption for i in second] == [
        (styles / i.path.name).with_suffix(".caption").read_text().strip() for i in second
    ]
    buckets = dataset_buckets(dataset, 64, multiple=8)
    sizes = {i: size for size, ix in buckets.items() for i in ix}
    area = {i: w * h for i, (w, h) in sizes.items()}
    assert all(area[i] <= 64 * 64 for i in range(4))  # the job's 64 px buckets
    assert all(64 * 64 < area[i] <= 128 * 128 for i in range(4, 10))  # its own 128 px ones
    order = epoch_batches(buckets, micro_batch=1, seed=0, epoch=0)
    counts = Counter(i for batch in order for i in batch)
    assert [counts[i] for i in range(10)] == [3] * 4 + [1] * 6


def test_the_order_after_a_position_is_the_same_on_one_rank_as_on_two(demo_dir, tmp_path):
    """What a mid-epoch resume on another world size relies on, over two datasets with
    repeats: the global batches from a saved position are the same on 1 rank as on 2."""
    a = _copy(_demo_files(demo_dir, 0, 5), tmp_path / "a")
    b = _copy(_demo_files(demo_dir, 5, 7), tmp_path / "b")
    found = [DatasetSource(path=str(a), repeats=3), DatasetSource(path=str(b))]
    dataset = scan_sources(found, tmp_path / "cache", log_skipped=False)
    buckets = dataset_buckets(dataset, 64, multiple=8)
    start = Position(epoch=0, batch=4)  # where two ranks stopped after 2 steps

    def take(world: int, rank: int, count: int) -> list[list[int]]:
        it = iterate_batches(dataset, buckets, micro_batch=2, rank=rank,
                                  world_size=world, seed=7, start=start)  # fmt: skip
        return [next(it)[0] for _ in range(count)]

    two = [batch for pair in zip(take(2, 0, 4), take(2, 1, 4), strict=True) for batch in pair]
    assert take(1, 0, 8) == two


# --- loss masks -------------------------------------------------------------------------------


def _halves(size: tuple[int, int], left: tuple, right: tuple, mode: str = "RGB") -> Image.Image:
    image = Image.new(mode, size, right)
    image.paste(Image.new(mode, (size[0] // 2, size[1]), left), (0, 0))
    return image


def test_a_mask_pairs_with_its_image_and_the_rest_is_listed(tmp_path) -> None:
    _halves((96, 64), (255, 0, 0), (0, 0, 255)).save(tmp_path / "a.png")
    _halves((48, 32), 255, 0, "L").save(tmp_path / "a.mask.png")  # any size: stretched
    _halves((96, 64), (0, 255, 0), (0, 0, 0)).save(tmp_path / "b.jpg")
    Image.new("L", (8, 8), 255).save(tmp_path / "c.mask.png")  # no image c
    _halves((96, 64), (1, 2, 3), (4, 5, 6)).save(tmp_path / "d.png")
    (tmp_path / "d.mask.png").write_bytes(b"\x89PNG broken")
    dataset = scan(tmp_path, log_skipped=False)
    items = {item.path.name: item for item in dataset.items}
    assert set(items) == {"a.png", "b.jpg"}
    assert items["a.png"].mask == tmp_path / "a.mask.png" and items["b.jpg"].mask is None
    assert items["a.png"].content != items["a.png"].digest  # a new mask: new latents entry
    reasons = {path.name: why for path, why in dataset.skipped}
    assert reasons["c.mask.png"] == "masks without an image of the same name"
    assert reasons["d.png"].startswith("its mask is unusable")
    assert any("masks without an image" in line for line in dataset.warnings())
    for flip in (False, True):  # cut and mirrored as the pixels are
        example = load_example(items["a.png"], (64, 64), flip=flip)
        red = example.pixels[0] > 0.5
        kept = example.mask[0] > 0.5
        assert kept.any() and (~kept).any()
        assert np.array_equal(red, kept)


def test_masked_cells_contribute_nothing_to_the_loss() -> None:
    generator = torch.Generator().manual_seed(0)
    target = torch.randn(2, 4, 8, 8, generator=generator)
    pred = torch.randn(2, 4, 8, 8, generator=generator, requires_grad=True)
    mask = torch.ones(2, 1, 8, 8)
    mask[:, :, :, 4:] = 0  # the right half of each latent left out
    loss = masked_mse(pred, target, mask)
    loss.backward()
    assert torch.all(pred.grad[..., 4:] == 0) and torch.all(pred.grad[..., :4] != 0)
    changed = target.clone()
    changed[..., 4:] += 100  # whatever the masked cells hold
    assert torch.equal(masked_mse(pred, changed, mask), loss)
    expected = ((pred - target)[..., :4] ** 2).mean()  # the kept cells' own mean
    assert torch.allclose(loss, expected)
    assert torch.allclose(masked_mse(pred, target, torch.ones(2, 1, 8, 8)),
                          masked_mse(pred, target))  # fmt: skip
    video = torch.randn(2, 4, 3, 8, 8)  # (batch, channels, frames, h, w): one mask per frame
    assert masked_mse(video, video + 1, mask).item() == pytest.approx(1.0)


def test_the_cache_keeps_each_mask_at_the_latents_size(demo_dir, tmp_path) -> None:
    from diffusers import AutoencoderKL

    from zerotuner import families

    folder = _copy(_demo_files(demo_dir, 0, 2), tmp_path / "data")
    image = sorted(folder.glob("*.png"))[0]
    with Image.open(image) as opened:
        _halves(opened.size, 255, 0, "L").save(image.with_name(f"{image.stem}.mask.png"))
    dataset = scan(folder, log_skipped=False)
    buckets = dataset_buckets(dataset, 64, multiple=8)
    bucket_of = {i: size for size, ix in buckets.items() for i in ix}
    items = [
        caching.feature_cache.CacheItem(
            item.name, item.content, item.caption, bucket_of[i], caching._loader(item, bucket_of[i])
        )  # fmt: skip
        for i, item in enumerate(dataset.items)
    ]
    vae = AutoencoderKL.from_pretrained(demo_dir / "model" / "vae")
    cache = FeatureCache(tmp_path / "cache", vae_key="v", text_key="t", flip=True)
    cache.encode_latents(items, lambda px: families.get("sdxl").encode_latents(vae, px))
    batch = cache.load_batch(items, torch.Generator().manual_seed(0), texts=False)
    latents, mask = batch["latents"], batch["mask"]
    assert mask.shape == (2, 1, *latents.shape[-2:])
    masked = 0 if items[0].name == image.name else 1
    assert torch.all(mask[1 - masked] == 1)  # the image without a mask trains everywhere
    assert mask[masked].mean().item() == pytest.approx(0.5, abs=0.1)


# --- S3 ---------------------------------------------------------------------------------------


def _s3_settings(s3: S3Server, monkeypatch, tmp_path: Path, url: str) -> Settings:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return Settings(data_dir=url, cache_dir=tmp_path / "cache", secrets_dir=tmp_path / "none")


def test_an_s3_dataset_is_fetched_once_verified_and_goes_on_after_an_interruption(
    s3, demo_dir, tmp_path, monkeypatch
) -> None:
    files = _demo_files(demo_dir, 0, 8)
    _upload(s3, "fetch", files)
    settings = _s3_settings(s3, monkeypatch, tmp_path, f"s3://{BUCKET}/fetch")
    found = sources(settings)
    listed = fetch_all(found, settings, listing_only=True).sources[0]
    assert (listed.files, listed.complete) == (16, False)
    first = fetch_all(found, settings).sources[0]
    assert (first.fetched_files, first.complete) == (16, True)
    folder = local_folder(found[0], settings.cache_dir)
    assert all((folder / f.name).read_bytes() == f.read_bytes() for f in files)
    assert fetch_all(found, settings).sources[0].fetched_files == 0  # a restart: nothing new
    # An interruption leaves a manifest without the last files and half a file.
    manifest = json.loads((folder / MANIFEST).read_text())
    for key in sorted(manifest)[-5:]:
        del manifest[key]
        (folder / key).unlink()
    (folder / MANIFEST).write_text(json.dumps(manifest))
    (folder / f".{files[0].name}.part").write_bytes(b"half")
    again = fetch_all(found, settings).sources[0]
    assert again.fetched_files == 5
    assert not list(folder.glob("*.part")) and not list(folder.glob(".*.part"))
    # The bucket changes: one image replaced, one caption deleted.
    client = _client(s3)
    client.put_object(Bucket=BUCKET, Key=f"fetch/{files[2].name}", Body=files[4].read_bytes())
    client.delete_object(Bucket=BUCKET, Key=f"fetch/{files[1].name}")
    changed = fetch_all(found, settings).sources[0]
    assert changed.fetched_files == 1 and changed.files == 15
    assert not (folder / files[1].name).exists()
    assert (folder / files[2].name).read_bytes() == files[4].read_bytes()
    dataset = scan_sources(found, settings.cache_dir, log_skipped=False)
    assert len(dataset) == 8


def test_a_dataset_not_fetched_yet_is_refused_by_the_ranks(s3, tmp_path, monkeypatch) -> None:
    settings = _s3_settings(s3, monkeypatch, tmp_path, f"s3://{BUCKET}/never")
    with pytest.raises(ConfigError, match="not fetched into .* yet"):
        scan_sources(sources(settings), settings.cache_dir)


def test_an_empty_or_unreachable_s3_prefix_is_one_line(s3, tmp_path, monkeypatch) -> None:
    from zerotuner.errors import ConfigError, EnvironmentUnfit

    settings = _s3_settings(s3, monkeypatch, tmp_path, f"s3://{BUCKET}/nothing-here")
    with pytest.raises(ConfigError, match="no objects under this prefix"):
        fetch_all(sources(settings), settings)
    settings = _s3_settings(s3, monkeypatch, tmp_path, "s3://no-such-bucket/x")
    with pytest.raises(EnvironmentUnfit, match="cannot fetch it: list : NoSuchBucket"):
        fetch_all(sources(settings), settings)


# --- Hugging Face datasets ------------------------------------------------------------------


def test_a_hub_dataset_of_parquet_shards_is_read_as_a_folder(
    demo_dir, tmp_path, monkeypatch
) -> None:
    repo = tmp_path / "repo"
    captions = _parquet_repo(repo, demo_dir)
    with FakeHub({"datasets/acme/shapes": repo}) as hub:
        hub.use_in_this_process(monkeypatch)
        settings = Settings(data_dir="hf://datasets/acme/shapes", cache_dir=tmp_path / "cache")
        found = sources(settings)
        first = fetch_all(found, settings).sources[0]
        assert (first.fetched_files, first.complete) == (7, True)  # 6 images and the broken row
        downloads = len(hub.fetched())
        assert fetch_all(found, settings).sources[0].fetched_files == 0
        assert len(hub.fetched()) == downloads  # nothing fetched again
    dataset = scan_sources(found, settings.cache_dir, log_skipped=False)
    assert sorted(item.caption for item in dataset.items) == sorted(captions)
    (skipped,) = dataset.skipped
    assert skipped[0].suffix == ".unknown" and "'.unknown' files are not read" in skipped[1]
    folder = local_folder(found[0], settings.cache_dir)
    assert folder.is_relative_to(tmp_path / "cache" / "datasets")


def test_a_parquet_shard_without_a_caption_column_says_which_it_has(
    demo_dir, tmp_path, monkeypatch
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zerotuner.errors import ConfigError

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    image = next((demo_dir / "data").glob("*.png")).read_bytes()
    table = pa.table({"picture": [{"bytes": image, "path": "a.png"}], "words": ["a caption"]})
    pq.write_table(table, repo / "data" / "train.parquet")
    with FakeHub({"datasets/acme/odd": repo}) as hub:
        hub.use_in_this_process(monkeypatch)
        settings = Settings(data_dir="hf://datasets/acme/odd", cache_dir=tmp_path / "cache")
        with pytest.raises(ConfigError, match=r"no caption column \(its columns: picture, "
                           r"words\); name it with `caption_column`"):  # fmt: skip
            fetch_all(sources(settings), settings)
        path = _datasets_file(tmp_path, {"datasets": [
            {"path": "hf://datasets/acme/odd", "caption_column": "words"}]})  # fmt: skip
        named = Settings(datasets_file=path, cache_dir=tmp_path / "cache")
        fetch_all(sources(named), named)
        dataset = scan_sources(sources(named), named.cache_dir, log_skipped=False)
        assert [item.caption for item in dataset.items] == ["a caption"]


def _edit_repo(folder: Path, demo_dir: Path, control: str) -> dict[bytes, bytes]:
    """An edit dataset of parquet shards: each row a target, its instruction and its control
    image in column `control`; one row's control cell is empty. Returns target -> control
    bytes of the rows that have both."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    targets = sorted((demo_dir / "data").glob("*.png"))[:4]
    inputs = []  # each target mirrored: its input, of its own size
    for path in targets:
        out = io.BytesIO()
        Image.open(path).transpose(Image.Transpose.FLIP_LEFT_RIGHT).save(out, format="PNG")
        inputs.append(out.getvalue())
    cells = [{"bytes": b, "path": None} for b in inputs[:-1]] + [None]
    table = pa.table({
        "edited": [{"bytes": p.read_bytes(), "path": p.name} for p in targets],
        "instruction": [f"edit {i}" for i in range(len(targets))],
        control: cells,
    })  # fmt: skip
    (folder / "data").mkdir(parents=True)
    pq.write_table(table, folder / "data" / "train.parquet")
    return {t.read_bytes(): c for t, c in zip(targets[:-1], inputs[:-1], strict=True)}


@pytest.mark.parametrize("named", [True, False], ids=["control_column", "control"])
def test_parquet_control_columns_become_the_targets_controls(
    demo_dir, tmp_path, monkeypatch, named
) -> None:
    """Issue 43: an edit dataset on the hub, its control image in a column the datasets entry
    names (`control_column`) or named `control` as metadata.jsonl's: each row's control is
    written beside its target and paired with it by scan as a local folder's; a row whose
    control cell is empty is skipped with why; a control column on a text-to-image family is
    refused as control files are; a column that holds no images is one line."""
    repo = tmp_path / "repo"
    pairs = _edit_repo(repo, demo_dir, "input_image" if named else "control")
    entry = {"path": "hf://datasets/acme/edits", "image_column": "edited",
             "caption_column": "instruction"}  # fmt: skip
    entry |= {"control_column": "input_image"} if named else {}
    with FakeHub({"datasets/acme/edits": repo}) as hub:
        hub.use_in_this_process(monkeypatch)
        settings = Settings(datasets_file=_datasets_file(tmp_path, {"datasets": [entry]}),
                            cache_dir=tmp_path / "cache")  # fmt: skip
        found = sources(settings)
        fetch_all(found, settings)
        dataset = scan_sources(found, settings.cache_dir, log_skipped=False, control_count=1)
        assert {i.path.read_bytes(): i.controls[0].read_bytes() for i in dataset.items} == pairs
        assert {i.caption for i in dataset.items} == {"edit 0", "edit 1", "edit 2"}
        (skipped,) = dataset.skipped
        assert skipped[0].name == "0000004.png" and "control" in skipped[1]
        with pytest.raises(ConfigError, match="control"):
            scan_sources(found, settings.cache_dir, log_skipped=False, control_count=0)
        if named:
            wrong = entry | {"control_column": "instruction"}
            path = _datasets_file(tmp_path, {"datasets": [wrong]})
            bad = Settings(datasets_file=path, cache_dir=tmp_path / "cache-2")
            with pytest.raises(ConfigError) as refused:
                fetch_all(sources(bad), bad)
            assert (
                "control_column='instruction' is a column of string, not of images; its "
                "image columns: input_image" in str(refused.value)
            )


def test_a_parquet_list_of_control_images_is_each_targets_references(
    demo_dir, tmp_path, monkeypatch
) -> None:
    """A multi-reference edit dataset on the hub (Qwen-Image-Edit Plus' kind): its `control`
    column holds each row's references as a list of images (the hub's Sequence(Image)); they
    become the target's controls in the list's order, as `control`, `control_1`, ... columns
    would."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    def png(path: Path, turn: Image.Transpose) -> bytes:
        out = io.BytesIO()
        Image.open(path).transpose(turn).save(out, format="PNG")
        return out.getvalue()

    targets = sorted((demo_dir / "data").glob("*.png"))[:3]
    references = [[png(t, Image.Transpose.FLIP_LEFT_RIGHT), png(t, Image.Transpose.FLIP_TOP_BOTTOM)]
                  for t in targets]  # fmt: skip
    table = pa.table({
        "image": [{"bytes": t.read_bytes(), "path": t.name} for t in targets],
        "prompt": [f"combine {i}" for i in range(len(targets))],
        "control": [[{"bytes": b, "path": None} for b in pair] for pair in references],
    })  # fmt: skip
    (tmp_path / "repo" / "data").mkdir(parents=True)
    pq.write_table(table, tmp_path / "repo" / "data" / "train.parquet")
    entry = {"path": "hf://datasets/acme/references"}
    with FakeHub({"datasets/acme/references": tmp_path / "repo"}) as hub:
        hub.use_in_this_process(monkeypatch)
        settings = Settings(datasets_file=_datasets_file(tmp_path, {"datasets": [entry]}),
                            cache_dir=tmp_path / "cache")  # fmt: skip
        found = sources(settings)
        fetch_all(found, settings)
        dataset = scan_sources(found, settings.cache_dir, log_skipped=False,
                               control_count=range(1, 4))  # fmt: skip
    got = {i.path.read_bytes(): [c.read_bytes() for c in i.controls] for i in dataset.items}
    assert got == {t.read_bytes(): pair for t, pair in zip(targets, references, strict=True)}
    assert [c.name for c in dataset.items[0].controls] == ["0000001.control.png",
                                                          "0000001.control_1.png"]  # fmt: skip


# --- the run --------------------------------------------------------------------------


@pytest.mark.slow
def test_three_datasets_train_on_two_ranks_and_resume_mid_epoch_on_one(
    s3, demo_dir, tmp_path
) -> None:
    """A local dataset with repeats 3 and a trigger word, one on the S3-compatible server and
    one of parquet shards on the (fake) hub, caption dropout 0.1: `check` lists them, two
    CPU ranks train 4 steps, one rank resumes mid-epoch from the checkpoint at step 4."""
    local = _copy(_demo_files(demo_dir, 0, 8), tmp_path / "local")
    first_image = sorted(local.glob("*.png"))[0]
    with Image.open(first_image) as opened:  # one image trains on its left half only
        _halves(opened.size, 255, 0, "L").save(local / f"{first_image.stem}.mask.png")
    _upload(s3, "run", _demo_files(demo_dir, 8, 8))
    repo = tmp_path / "repo"
    _parquet_repo(repo, demo_dir, count=4)
    entries = {"datasets": [
        {"path": str(local), "repeats": 3, "caption_template": "sks {caption}"},
        f"s3://{BUCKET}/run",
        "hf://datasets/acme/shapes",
    ]}  # fmt: skip
    with FakeHub({"datasets/acme/shapes": repo}) as hub:
        env = tk.entrypoint_env(
            demo_dir, tmp_path, ZT_DATASETS_FILE=str(_datasets_file(tmp_path, entries)),
            ZT_CAPTION_DROPOUT="0.1", ZT_MAX_STEPS="4", ZT_CHECKPOINT_EVERY_STEPS="4",
            ZT_TRAIN_BATCH_SIZE="2", HF_HUB_OFFLINE="0", HF_ENDPOINT=hub.url, **s3.env(),
        )  # fmt: skip
        check = subprocess.run([tk.ENTRYPOINT, "check"], env=env, capture_output=True,
                               text=True, timeout=300)  # fmt: skip
        assert check.returncode == 0, check.stdout + check.stderr
        line = next(x for x in check.stdout.splitlines() if x.startswith("OK   dataset"))
        assert f"s3://{BUCKET}/run: 16 files, " in line
        assert "hf://datasets/acme/shapes: 2 files, " in line
        assert line.count("not fetched yet (train fetches it)") == 2
        first = subprocess.run([tk.ENTRYPOINT, "train"], env=env, capture_output=True,
                               text=True, timeout=600)  # fmt: skip
    log = first.stdout + first.stderr
    assert first.returncode == 0, log[-5000:]
    assert f"fetching s3://{BUCKET}/run: done, 16 files" in log
    assert (
        f"dataset: 20 images in 3 datasets: 8 images in {local} (x3), 8 images in "
        f"s3://{BUCKET}/run, 4 images in hf://datasets/acme/shapes, 1 skipped" in log
    )
    assert "1 image with a loss mask" in log
    run = tmp_path / "output" / "run"
    record = tk.read_json(run / "dataset.json")
    assert [d["images"] for d in record["datasets"]] == [8, 8, 4]
    assert sum(record["buckets"].values()) == 8 * 3 + 8 + 4  # each local image three times
    captions = {f"sks {p.read_text().strip()}" for p in local.glob("*.txt")}
    captions |= {p.read_text().strip() for p in _demo_files(demo_dir, 8, 8) if p.suffix == ".txt"}
    captions |= {f"hub caption {i}" for i in range(4)} | {""}  # the empty caption once
    assert tk.read_json(run / "cache.json")["texts_encoded"] == len(captions)
    # `check` again: every dataset fetched, counted, the cache sized.
    check = subprocess.run([tk.ENTRYPOINT, "check"], env=env, capture_output=True, text=True,
                           timeout=300)  # fmt: skip
    assert check.returncode == 0, check.stdout + check.stderr
    line = next(x for x in check.stdout.splitlines() if x.startswith("OK   dataset"))
    assert "20 images in 3 datasets" in line and line.count(", fetched") == 2
    assert "of fetched copies in ZT_CACHE_DIR/datasets" in line
    assert "OK   text cache" in check.stdout
    # One rank resumes mid-epoch: 4 steps x 2 ranks were 8 of the epoch's 16 global batches.
    manifest = tk.read_json(tmp_path / "output" / "checkpoints" / "step-4" / "zerotuner.json")
    assert manifest["position"] == {"epoch": 0, "batch": 8}
    resumed = subprocess.run(
        [tk.ENTRYPOINT, "train"], capture_output=True, text=True, timeout=600,
        env=env | {"ZT_NUM_PROCESSES": "1", "ZT_MAX_STEPS": "6", "ZT_RESUME": "auto",
                   "ZT_CHECKPOINT_EVERY_STEPS": "6", "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-5000:]
    assert "resumed from" in log and "at step 4" in log
    assert "fetching" not in log and "writing out" not in log  # the copies were complete
    after = tk.read_json(tmp_path / "output" / "checkpoints" / "step-6" / "zerotuner.json")
    assert after["position"] == {"epoch": 0, "batch": 10}  # the next two global batches


def test_the_builder_shows_the_data_settings_and_keeps_a_remote_dataset_in_the_job() -> None:
    from zerotuner.builder.exports import kubernetes_job
    from zerotuner.builder.form import form_fields

    sections = {s["title"]: [f["name"] for f in s["fields"]] for s in form_fields()}
    assert sections["Data"] == ["ZT_DATA_DIR", "ZT_DATASETS_FILE"]
    assert sections["Recipes"][:2] == ["ZT_CAPTION_TEMPLATE", "ZT_CAPTION_DROPOUT"]

    def config_block(text: str) -> str:
        return text.split("zerotuner.yaml: |", 1)[1].split("---", 1)[0]

    remote = kubernetes_job({"ZT_DATA_DIR": f"s3://{BUCKET}/images"}, gpus=1)
    assert f"data_dir: s3://{BUCKET}/images" in config_block(remote)
    local = kubernetes_job({"ZT_DATA_DIR": "/data/images"}, gpus=1)
    assert "data_dir" not in config_block(local)  # a mount: the Job's volume gives it


def test_a_missing_dataset_folder_names_the_datasets_file(demo_job_env, tmp_path, capsys):
    from zerotuner.cli import main

    path = _datasets_file(tmp_path, {"datasets": [str(tmp_path / "nowhere")]})
    demo_job_env.setenv("ZT_DATASETS_FILE", str(path))
    assert main(["check"]) == 2
    out = capsys.readouterr().out
    assert f"FAIL dataset          ZT_DATASETS_FILE={path}: path={tmp_path / 'nowhere'}: no " in out
    assert "Traceback" not in out
