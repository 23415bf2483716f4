"""Data from buckets and hubs, tried as a hostile bucket or a careless user would (issue 40,
items 1-4): keys that would be written outside ZT_CACHE_DIR, a key that is a file where another
needs a folder, parquet columns of the wrong type, credentials in a dataset URL. The real moto
server, the fake hub and real parquet files; each test runs in seconds."""

from __future__ import annotations

import json
import logging
import re
import shutil

import pytest
import yaml
from fakehub import FakeHub
from s3server import KEY_ID, SECRET, S3Server, served

from zerotuner.data.scan import scan_sources
from zerotuner.errors import ConfigError
from zerotuner.preflight.fetch import fetch_all
from zerotuner.settings.datasets import local_folder, sources
from zerotuner.settings.files import short_repr
from zerotuner.settings.schema import Settings

BUCKET = "hostile"


s3 = served(BUCKET)


def _put(s3: S3Server, objects: dict[str, bytes]) -> None:
    import boto3

    client = boto3.client("s3", endpoint_url=s3.url, aws_access_key_id=KEY_ID,
                          aws_secret_access_key=SECRET, region_name="us-east-1")  # fmt: skip
    for key, body in objects.items():
        client.put_object(Bucket=BUCKET, Key=key, Body=body)
    return client


def _settings(s3: S3Server, monkeypatch, tmp_path, prefix: str) -> Settings:
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return Settings(data_dir=f"s3://{BUCKET}/{prefix}", cache_dir=tmp_path / "cache",
                    secrets_dir=tmp_path / "none")  # fmt: skip


def _image(demo_dir) -> bytes:
    return sorted((demo_dir / "data").glob("*.png"))[0].read_bytes()


# --- 1. names that leave the dataset's folder -------------------------------------------------


def test_s3_keys_that_would_leave_the_dataset_folder_are_listed_and_never_written(
    s3, demo_dir, tmp_path, monkeypatch, caplog
) -> None:
    victim = tmp_path / "victim.txt"  # a file of the user's, outside ZT_CACHE_DIR
    victim.write_text("mine")
    image = _image(demo_dir)
    _put(s3, {
        "escape/a.png": image, "escape/a.txt": b"a caption",
        f"escape/{victim}": b"overwritten",  # `escape//tmp/...`: absolute after the prefix
        "escape/sub//b.png": image, "escape/../c.png": image, "escape/./d.png": image,
        f"escape/{'n' * 260}.png": image, "escape/bell\x07.png": image,
    })  # fmt: skip
    settings = _settings(s3, monkeypatch, tmp_path, "escape")
    found = sources(settings)
    listed = fetch_all(found, settings, listing_only=True).sources[0]
    assert listed.files == 2 and len(listed.skipped) == 6
    assert listed.describe().startswith(  # what `check` says: the first names, by name
        f"s3://{BUCKET}/escape: 2 files, 0.0 MiB, not fetched yet (train fetches it), 6 not "
        f"written: '../c.png' (a . or .. part), './d.png' (a . or .. part), "
        f"{short_repr(str(victim))} (an absolute name), "  # a long tmp path is shortened
    )
    assert listed.describe().endswith(" and 1 more")
    with caplog.at_level(logging.WARNING, logger="zerotuner.preflight.fetch"):
        fetched = fetch_all(found, settings).sources[0]
    assert (fetched.fetched_files, fetched.complete) == (2, True)
    assert victim.read_text() == "mine"
    reasons = dict(fetched.skipped)
    assert reasons == {
        str(victim): "an absolute name", "sub//b.png": "an empty part (//)",
        "../c.png": "a . or .. part", "./d.png": "a . or .. part",
        f"{'n' * 260}.png": "a part over 249 bytes", "bell\x07.png": "a control character",
    }  # fmt: skip
    assert f"s3://{BUCKET}/escape: 6 not written: " in caplog.text
    assert "'bell\\x07.png' (a control character)" in caplog.text  # escaped: one line
    folder = local_folder(found[0], settings.cache_dir)
    written = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())
    assert [name for name in written if not name.startswith(".zerotuner")] == ["a.png", "a.txt"]
    assert len(scan_sources(found, settings.cache_dir, log_skipped=False)) == 1
    _put(s3, {f"only-bad/{victim}": b"overwritten"})  # nothing left to fetch: one line
    settings = _settings(s3, monkeypatch, tmp_path, "only-bad")
    shown = short_repr(str(victim))  # a long tmp path is shortened
    expected = f"no objects under this prefix to write (1 not written: {shown} (an absolute name))"
    with pytest.raises(ConfigError, match=re.escape(expected + "; check the URL")):
        fetch_all(sources(settings), settings)
    assert victim.read_text() == "mine"


def test_hub_files_and_parquet_paths_stay_inside_the_dataset_folder(
    demo_dir, tmp_path, monkeypatch
) -> None:
    """A parquet row's `path` names no file: `../../x.png` or `/tmp/x.png` only hint a suffix."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    image = _image(demo_dir)
    rows = [{"bytes": image, "path": "../../escaped.png"},
            {"bytes": image, "path": str(tmp_path / "escaped.png")}]  # fmt: skip
    pq.write_table(pa.table({"image": rows, "text": ["one", "two"]}), repo / "data" / "t.parquet")
    with FakeHub({"datasets/acme/paths": repo}) as hub:
        hub.use_in_this_process(monkeypatch)
        settings = Settings(data_dir="hf://datasets/acme/paths", cache_dir=tmp_path / "cache")
        assert fetch_all(sources(settings), settings).sources[0].fetched_files == 2
    assert not list(tmp_path.rglob("escaped.png"))
    dataset = scan_sources(sources(settings), settings.cache_dir, log_skipped=False)
    assert sorted(item.caption for item in dataset.items) == ["one", "two"]


# --- 2. a file where another key needs a folder ------------------------------------------------


def test_a_key_that_is_a_file_and_a_folder_is_listed_not_a_traceback(
    s3, demo_dir, tmp_path, monkeypatch
) -> None:
    image = _image(demo_dir)
    client = _put(s3, {"clash/x.png": image, "clash/x.png/y.png": image, "clash/z.png": image})
    settings = _settings(s3, monkeypatch, tmp_path, "clash")
    found = sources(settings)
    fetched = fetch_all(found, settings).sources[0]
    assert fetched.skipped == [("x.png", "a file where other names need a folder")]
    folder = local_folder(found[0], settings.cache_dir)
    assert (folder / "x.png" / "y.png").is_file() and (folder / "z.png").is_file()
    # The bucket changes: x.png is a file now, z.png a folder; the copy follows.
    client.delete_object(Bucket=BUCKET, Key="clash/x.png/y.png")
    client.delete_object(Bucket=BUCKET, Key="clash/z.png")
    _put(s3, {"clash/z.png/w.png": image})
    again = fetch_all(found, settings).sources[0]
    assert (again.fetched_files, again.skipped) == (2, [])
    assert (folder / "x.png").is_file() and (folder / "z.png" / "w.png").is_file()


# --- 3. parquet columns of the wrong type -----------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"image_column": "text"},
         "image_column='text' is a column of string, not of images (the hub's Image feature "
         "or bytes); its image columns: image"),
        ({"image_column": "tags"}, "image_column='tags' is a column of list<element: string>"),
        ({"image_column": "score"}, "image_column='score' is a column of int64"),
        ({"caption_column": "image"},
         "caption_column='image' is a column of struct<bytes: binary, path: string>, not of "
         "text; its caption columns: text"),
        ({"caption_column": "score"}, "caption_column='score' is a column of int64"),
    ],
)  # fmt: skip
def test_a_parquet_column_of_the_wrong_type_is_one_line_before_anything_is_written(
    demo_dir, tmp_path, monkeypatch, entry, message
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    table = pa.table({"image": [{"bytes": _image(demo_dir), "path": "a.png"}],
                      "text": ["a caption"], "tags": [["a", "b"]], "score": [7]})  # fmt: skip
    pq.write_table(table, repo / "data" / "a.parquet")
    path = tmp_path / "datasets.yaml"
    path.write_text(yaml.safe_dump({"datasets": [{"path": "hf://datasets/acme/t", **entry}]}))
    with FakeHub({"datasets/acme/t": repo}) as hub:
        hub.use_in_this_process(monkeypatch)
        settings = Settings(datasets_file=path, cache_dir=tmp_path / "cache")
        with pytest.raises(ConfigError) as refused:
            fetch_all(sources(settings), settings)
        assert str(refused.value).startswith(
            f"ZT_DATASETS_FILE={path}: hf://datasets/acme/t: data/a.parquet: {message}"
        )
        assert not local_folder(sources(settings)[0], settings.cache_dir).exists()
        # `check` reads the shards from the hub cache too: the same line, exit 2
        with pytest.raises(ConfigError, match="is a column of"):
            fetch_all(sources(settings), settings, listing_only=True)


def test_a_wrong_column_is_exit_2_from_train_before_any_shard_is_written(
    demo_job_env, demo_dir, tmp_path, monkeypatch, capsys
) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from zerotuner.cli import main

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    image = {"bytes": _image(demo_dir), "path": "a.png"}
    pq.write_table(pa.table({"image": [image], "text": ["hi"]}), repo / "data" / "a.parquet")
    pq.write_table(pa.table({"image": [image], "text": [7]}), repo / "data" / "b.parquet")
    with FakeHub({"datasets/acme/cli": repo}) as hub:
        hub.use_in_this_process(monkeypatch)
        demo_job_env.setenv("HF_HUB_OFFLINE", "0")
        demo_job_env.setenv("ZT_DATA_DIR", "hf://datasets/acme/cli")
        assert main(["train"]) == 2
    err = capsys.readouterr().err
    assert (
        "zerotuner: error: hf://datasets/acme/cli: data/b.parquet: caption_column='text' is a "
        "column of int64, not of text; its caption columns: none"
    ) in err
    assert "Traceback" not in err
    assert not (tmp_path / "cache" / "datasets").exists()  # a.parquet's rows were not written


# --- 4. credentials in a dataset URL ----------------------------------------------------------

LEAKY = "s3://AKIAEXAMPLEKEY:wJalr/K7MDENG+bPxRfi@bucket/images"  # AWS secrets may hold `/`
CREDENTIALS = ("AKIAEXAMPLEKEY", "wJalr", "bPxRfi")


@pytest.mark.parametrize("command", ["config", "check", "train"])
@pytest.mark.parametrize("where", ["ZT_DATA_DIR", "ZT_DATASETS_FILE"])
def test_credentials_in_a_dataset_url_are_refused_and_never_printed(
    demo_job_env, tmp_path, capsys, command, where
) -> None:
    from zerotuner.cli import main

    if where == "ZT_DATA_DIR":
        demo_job_env.setenv("ZT_DATA_DIR", LEAKY)
    else:
        path = tmp_path / "datasets.yaml"
        path.write_text(yaml.safe_dump({"datasets": [{"path": LEAKY, "repeats": 2}]}))
        demo_job_env.setenv("ZT_DATASETS_FILE", str(path))
    assert main([command]) == 2
    shown = capsys.readouterr()
    out = shown.out + shown.err
    assert "s3://***@bucket/images" in out and "credentials do not go in the URL" in out, out
    assert not any(secret in out for secret in CREDENTIALS), out
    assert "Traceback" not in out


def test_the_builder_masks_credentials_in_its_error_line() -> None:
    from zerotuner.builder.evaluate import evaluate

    result = evaluate({"settings": {"ZT_DATA_DIR": LEAKY}, "deepspeed": {}, "hardware": {}})
    text = json.dumps([result["errors"], result.get("plan_errors")])  # the lines it shows
    assert result["exit_code"] == 2 and "s3://***@bucket/images" in text, text
    assert not any(secret in text for secret in CREDENTIALS), text


def test_log_lines_mask_a_url_s_credentials_but_not_a_revision() -> None:
    from zerotuner.monitor.logs import mask

    line = f"endpoint http://user:pa/ss@minio:9000, data {LEAKY!r}, hf://datasets/a/b@v1"
    assert mask(line, []) == (
        "endpoint http://***@minio:9000, data 's3://***@bucket/images', hf://datasets/a/b@v1"
    )
    assert mask("s3://bucket/a@b and hf://datasets/o/n@main", []) == (
        "s3://bucket/a@b and hf://datasets/o/n@main"
    )


def test_a_copy_fetched_with_other_columns_is_written_again(demo_dir, tmp_path, monkeypatch):
    """The fix of a wrong `caption_column` reaches the copy (its marker names the columns)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    image = {"bytes": _image(demo_dir), "path": "a.png"}
    pq.write_table(pa.table({"image": [image], "text": ["t"], "prompt": ["p"]}),
                   repo / "data" / "train.parquet")  # fmt: skip
    path = tmp_path / "datasets.yaml"
    with FakeHub({"datasets/acme/cols": repo}) as hub:
        hub.use_in_this_process(monkeypatch)
        captions = []
        for column in ("text", "prompt"):
            path.write_text(yaml.safe_dump({"datasets": [
                {"path": "hf://datasets/acme/cols", "caption_column": column}]}))  # fmt: skip
            settings = Settings(datasets_file=path, cache_dir=tmp_path / "cache")
            fetch_all(sources(settings), settings)
            dataset = scan_sources(sources(settings), settings.cache_dir, log_skipped=False)
            captions += [item.caption for item in dataset.items]
    assert captions == ["t", "p"]
    shutil.rmtree(tmp_path / "cache")


def test_the_builder_s_initial_form_and_zt_push_to_mask_credentials(monkeypatch, capsys) -> None:
    """The page's /api/initial (the form from `docker run -e`) and a ZT_PUSH_TO with
    credentials: masked, and the push URL refused in one line."""
    from zerotuner.builder.server import initial_form
    from zerotuner.cli import main

    form = initial_form({"ZT_DATA_DIR": LEAKY, "ZT_PUSH_TO": LEAKY})
    shown = json.dumps(form)
    assert "s3://***@bucket/images" in shown
    assert not any(secret in shown for secret in CREDENTIALS), shown
    monkeypatch.setenv("ZT_PUSH_TO", LEAKY)
    assert main(["config"]) == 2
    out = "".join(capsys.readouterr())
    assert "ZT_PUSH_TO='s3://***@bucket/images': credentials do not go in the URL" in out, out
    assert not any(secret in out for secret in CREDENTIALS) and "Traceback" not in out
