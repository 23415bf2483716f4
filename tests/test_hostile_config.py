"""Hostile and careless configuration inputs: every one is exit 2 with one line naming the
setting (or the file and key path), never a hang, a traceback or a NaN config.

The ways in: env variables, the config file (YAML, JSON, TOML), the DeepSpeed JSON (inline,
a file, the config file's block, the accelerate file's deepspeed_config_file) and the
accelerate YAML. Inputs that could hang or exhaust the process on a regression run as
subprocesses with a timeout, or under an alarm; the rest run the CLI in-process (milliseconds).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from zerotuner import cli
from zerotuner.commands import config as _config  # noqa: F401 (torch imported once, up front)
from zerotuner.machine import offload_volume as offload
from zerotuner.settings.files import MAX_FILE_BYTES

REPO = Path(__file__).resolve().parents[1]
ZEROTUNER = REPO / ".venv" / "bin" / "zerotuner"
BIG = "1" + "0" * 400  # 10**400


class Hung(BaseException):  # not an OSError: no `except OSError` may turn it into a verdict
    pass


def _alarm(signum, frame):
    raise Hung("the command blocked (it waits on a FIFO or reads forever)")


@pytest.fixture
def env(monkeypatch, demo_dir, tmp_path):
    """The demo model on this CPU; returns the monkeypatch to set the hostile input with."""
    monkeypatch.setenv("ZT_MODEL", str(demo_dir / "model"))
    monkeypatch.setenv("ZT_DATA_DIR", str(demo_dir / "data"))
    monkeypatch.setenv("ZT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("ZT_OFFLOAD_DIR", str(tmp_path / "offload"))
    monkeypatch.setenv("ZT_DEVICE", "cpu")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    return monkeypatch


def config(capsys, *args: str) -> tuple[int, str, str]:
    """`zerotuner config` in-process, under a 20 s alarm (a blocking open fails the test)."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(20)
    try:
        code = cli.main(["config", *args])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    out, err = capsys.readouterr()
    return code, out, err


def refused(code: int, out: str, err: str, *expected: str) -> str:
    """Exit 2, nothing on stdout, one error line holding every `expected` text: that line."""
    assert "Traceback" not in err, err
    assert (code, out) == (2, ""), (code, out, err)
    errors = [line for line in err.splitlines() if line.startswith("zerotuner: error: ")]
    assert len(errors) == 1, err
    for text in expected:
        assert text in errors[0], (text, errors[0])
    assert len(errors[0]) < 400, errors[0]  # a hostile value is not echoed whole
    return errors[0]


def subprocess_env(demo_dir: Path, tmp_path: Path, **settings: str) -> dict[str, str]:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("ZT_")}
    environ.pop("HF_TOKEN", None)
    environ.update(
        ZT_MODEL=str(demo_dir / "model"), ZT_DEVICE="cpu", ZT_CACHE_DIR=str(tmp_path / "cache"),
        ZT_OFFLOAD_DIR=str(tmp_path / "offload"), ZT_METRICS_PORT="0", **settings,
    )  # fmt: skip
    return environ


def zerotuner(command: str, environ: dict[str, str]) -> tuple[int, str, str]:
    try:
        done = subprocess.run(
            [str(ZEROTUNER), command], env=environ, capture_output=True, text=True, timeout=30
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"`zerotuner {command}` still running after 30 s")
    return done.returncode, done.stdout, done.stderr


# --- 1. a YAML alias bomb: kilobytes that expand to billions of values -------------------------


def alias_bomb(levels: int = 9) -> str:
    names = [chr(ord("a") + i) for i in range(levels)]
    parts = ["&a [" + ", ".join(["x"] * 9) + "]"]
    for prev, name in zip(names, names[1:], strict=False):
        parts.append(f"&{name} [" + ", ".join([f"*{prev}"] * 9) + "]")
    return "[" + ", ".join(parts) + "]"  # 9**9 = 387M strings once expanded


@pytest.mark.parametrize("where", ["ZT_CONFIG_FILE", "ZT_ACCELERATE_CONFIG"])
def test_a_yaml_alias_bomb_is_refused_in_seconds(demo_dir, tmp_path, where):
    path = tmp_path / "bomb.yaml"
    if where == "ZT_CONFIG_FILE":
        path.write_text(f"model: {alias_bomb()}\n")
    else:
        path.write_text(f"deepspeed_config:\n  zero_stage: {alias_bomb()}\n")
    code, out, err = zerotuner("config", subprocess_env(demo_dir, tmp_path, **{where: str(path)}))
    refused(code, out, err, f"{where}={path}", "expands to more than 100000 values")


def test_aliases_within_the_cap_still_work(env, capsys, tmp_path):
    path = tmp_path / "zerotuner.yaml"
    path.write_text("validation_prompts: &p [a cat, a dog]\nmax_steps: 3\n")
    env.setenv("ZT_CONFIG_FILE", str(path))
    code, out, err = config(capsys)
    assert code == 0, err


# --- 2. files that are no regular file, or too large -------------------------------------------


def _named_file(tmp_path: Path, kind: str) -> Path:
    if kind == "fifo":
        os.mkfifo(tmp_path / "fifo")
        return tmp_path / "fifo"
    if kind == "directory":
        (tmp_path / "folder.json").mkdir()
        return tmp_path / "folder.json"
    return Path("/dev/null")  # a character device (empty: reading it would pass the parsers)


@pytest.mark.parametrize("kind", ["fifo", "directory", "device"])
@pytest.mark.parametrize(
    "setting", ["ZT_CONFIG_FILE", "ZT_DEEPSPEED_CONFIG", "ZT_ACCELERATE_CONFIG", "via accelerate"]
)
def test_only_regular_files_are_read(env, capsys, tmp_path, setting, kind):
    path = _named_file(tmp_path, kind)
    if setting == "via accelerate":  # the accelerate file's deepspeed_config_file
        accelerate = tmp_path / "accelerate.yaml"
        accelerate.write_text(f"deepspeed_config:\n  deepspeed_config_file: {path}\n")
        env.setenv("ZT_ACCELERATE_CONFIG", str(accelerate))
        name = f"deepspeed_config.deepspeed_config_file={path}"
    else:
        env.setenv(setting, str(path))
        name = f"{setting}={path}"
    what = {
        "fifo": "a FIFO (named pipe)",
        "directory": "a directory",
        "device": "a character device",
    }[kind]
    refused(*config(capsys), name, f"is {what}, expected a regular file")


def test_dev_zero_as_the_config_file_is_refused_not_read_forever(demo_dir, tmp_path):
    environ = subprocess_env(demo_dir, tmp_path, ZT_CONFIG_FILE="/dev/zero")
    code, out, err = zerotuner("check", environ)
    assert code == 2 and "Traceback" not in err, (code, out, err)
    assert "ZT_CONFIG_FILE=/dev/zero: is a character device, expected a regular file" in out


@pytest.mark.parametrize("setting", ["ZT_CONFIG_FILE", "ZT_DEEPSPEED_CONFIG"])
def test_a_file_over_the_size_cap_is_refused(env, capsys, tmp_path, setting):
    path = tmp_path / "big.json"
    path.write_text("{}" + " " * MAX_FILE_BYTES)  # valid JSON, one byte too many
    env.setenv(setting, str(path))
    refused(*config(capsys), f"{setting}={path}", "larger than 4 MiB")


def test_a_secret_file_over_the_size_cap_is_refused_without_showing_it(env, capsys, tmp_path):
    """/run/secrets takes the same reader: a huge or binary hf_token is one line that shows
    none of its content."""
    secrets = tmp_path / "secrets"
    secrets.mkdir()
    (secrets / "hf_token").write_text("hf_" + "s" * MAX_FILE_BYTES)
    env.setenv("ZT_SECRETS_DIR", str(secrets))
    line = refused(*config(capsys), f"ZT_SECRETS_DIR={secrets / 'hf_token'}", "larger than 4 MiB")
    assert "sss" not in line


# --- 3. deep nesting, numbers too large, duplicate keys -----------------------------------------


def test_deepspeed_json_nested_10000_deep(env, capsys):
    env.setenv("ZT_DEEPSPEED_CONFIG", '{"a":' * 10000 + "1" + "}" * 10000)
    refused(*config(capsys), "ZT_DEEPSPEED_CONFIG", "nested more than 64 levels deep")


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("zerotuner.yaml", "model: " + "[" * 10000 + "]" * 10000),
        ("zerotuner.toml", "model = " + "[" * 10000 + "]" * 10000),
        ("zerotuner.json", '{"model": ' + "[" * 10000 + "]" * 10000 + "}"),
        ("zerotuner.yaml", "deepspeed_config: " + '{"a": ' * 100 + "1" + "}" * 100),
    ],
)
def test_deep_nesting_in_the_config_file(env, capsys, tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    env.setenv("ZT_CONFIG_FILE", str(path))
    refused(*config(capsys), f"ZT_CONFIG_FILE={path}", "nested more than 64 levels deep")


def test_deep_nesting_in_the_accelerate_file_and_the_prompt_list(env, capsys, tmp_path):
    path = tmp_path / "accelerate.yaml"
    path.write_text("deepspeed_config:\n  zero_stage: " + "[" * 5000 + "]" * 5000 + "\n")
    env.setenv("ZT_ACCELERATE_CONFIG", str(path))
    refused(*config(capsys), f"ZT_ACCELERATE_CONFIG={path}", "nested more than 64 levels deep")
    env.delenv("ZT_ACCELERATE_CONFIG")
    env.setenv("ZT_VALIDATION_PROMPTS", "[" * 10000 + "]" * 10000)
    refused(*config(capsys), "ZT_VALIDATION_PROMPTS=", "nested more than 64 levels deep")


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (f'{{"train_micro_batch_size_per_gpu": {BIG}}}', "train_micro_batch_size_per_gpu"),
        (f'{{"zero_optimization": {{"reduce_bucket_size": "{BIG}"}}}}', "reduce_bucket_size"),
        ('{"steps_per_print": ' + "9" * 5000 + "}", "a number too long to read"),
    ],
)
def test_deepspeed_numbers_too_large(env, capsys, value, expected):
    env.setenv("ZT_DEEPSPEED_CONFIG", value)
    refused(*config(capsys), expected)


@pytest.mark.parametrize(
    ("setting", "value", "expected"),
    [
        ("ZT_TRAIN_BATCH_SIZE", BIG, "expected a number below 2**63"),
        ("ZT_SEED", BIG, "expected a number below 2**63"),
        ("ZT_MAX_STEPS", "-" + BIG, "expected"),
        ("ZT_TRAIN_BATCH_SIZE", "1e400", "expected a valid integer"),
        ("ZT_LORA_RANK", "9" * 5000, "exceeded maximum size"),
    ],
)
def test_env_numbers_too_large(env, capsys, setting, value, expected):
    env.setenv(setting, value)
    line = refused(*config(capsys), f"{setting}=", expected)
    assert "characters)" in line or len(value) < 80  # the value shown shortened


@pytest.mark.parametrize(
    ("setting", "name", "text", "expected"),
    [
        ("ZT_DEEPSPEED_CONFIG", None, '{"gradient_clipping": 1, "gradient_clipping": 5}',
         "ZT_DEEPSPEED_CONFIG: duplicate key 'gradient_clipping'"),
        ("ZT_DEEPSPEED_CONFIG", "ds.json", '{"zero_optimization": {"stage": 1, "stage": 3}}',
         "duplicate key 'stage'"),
        ("ZT_CONFIG_FILE", "zerotuner.yaml", "max_steps: 5\nmax_steps: 6\n",
         "at line 2, column 1: duplicate key 'max_steps'"),
        ("ZT_CONFIG_FILE", "zerotuner.json", '{"max_steps": 5, "max_steps": 6}',
         "duplicate key 'max_steps'"),
        ("ZT_CONFIG_FILE", "zerotuner.yaml", "deepspeed_config:\n  fp16: {}\n  fp16: {}\n",
         "duplicate key 'fp16'"),
        ("ZT_CONFIG_FILE", "zerotuner.toml", "max_steps = 5\nmax_steps = 6\n",
         "invalid TOML"),  # tomllib refuses them itself: one line
        ("ZT_ACCELERATE_CONFIG", "accelerate.yaml",
         "deepspeed_config:\n  zero_stage: 2\n  zero_stage: 3\n", "duplicate key 'zero_stage'"),
    ],
)  # fmt: skip
def test_duplicate_keys_are_refused(env, capsys, tmp_path, setting, name, text, expected):
    value = text
    if name is not None:
        (tmp_path / name).write_text(text)
        value = str(tmp_path / name)
        expected = f"{setting}={value}: " if setting != "ZT_DEEPSPEED_CONFIG" else expected
    env.setenv(setting, value)
    refused(*config(capsys), setting, expected)


def test_a_yaml_merge_key_overridden_is_no_duplicate(env, capsys, tmp_path):
    path = tmp_path / "zerotuner.yaml"
    path.write_text(
        "deepspeed_config:\n  base: &b {stage: 1}\n  zero_optimization:\n    <<: *b\n    stage: 2\n"
    )
    env.setenv("ZT_CONFIG_FILE", str(path))
    code, out, err = config(capsys)
    assert "duplicate" not in err and "Traceback" not in err, err


# --- 4. NaN and infinity, every way in ----------------------------------------------------------

NON_FINITE = [
    ("ZT_LEARNING_RATE", "inf", "ZT_LEARNING_RATE='inf': expected a finite number"),
    ("ZT_LEARNING_RATE", "nan", "ZT_LEARNING_RATE='nan': expected a finite number"),
    ("ZT_GRADIENT_CLIPPING", "1e400", "ZT_GRADIENT_CLIPPING='1e400': expected a finite number"),
    ("ZT_WEIGHT_DECAY", "Infinity", "ZT_WEIGHT_DECAY='Infinity': expected a finite number"),
    ("ZT_NOISE_OFFSET", "NaN", "ZT_NOISE_OFFSET='NaN': expected a finite number"),
    ("ZT_DEEPSPEED_CONFIG", '{"gradient_clipping": NaN}',
     "ZT_DEEPSPEED_CONFIG: gradient_clipping=nan: expected a finite number"),
    ("ZT_DEEPSPEED_CONFIG", '{"optimizer": {"type": "AdamW", "params": {"lr": Infinity}}}',
     "ZT_DEEPSPEED_CONFIG: optimizer.params.lr=inf: expected a finite number"),
    ("ZT_DEEPSPEED_CONFIG", '{"optimizer": {"params": {"betas": [0.9, -Infinity]}}}',
     "optimizer.params.betas[1]=-inf"),
    ("ZT_DEEPSPEED_CONFIG", '{"gradient_clipping": 1e999}', "gradient_clipping=inf"),
    ("ZT_DEEPSPEED_CONFIG", '{"gradient_clipping": "nan"}',
     "gradient_clipping='nan': expected a finite number"),
    ("ZT_DEEPSPEED_CONFIG", '{"scheduler": {"type": "WarmupLR", "params": '
     '{"warmup_max_lr": "-inf"}}}', "scheduler.params.warmup_max_lr='-inf'"),
]  # fmt: skip


@pytest.mark.parametrize(("setting", "value", "expected"), NON_FINITE)
def test_non_finite_numbers_in_env_and_deepspeed_json(env, capsys, setting, value, expected):
    env.setenv(setting, value)
    refused(*config(capsys), expected)


@pytest.mark.parametrize(
    ("setting", "name", "text", "expected"),
    [
        ("ZT_CONFIG_FILE", "zerotuner.yaml", "learning_rate: .nan\n", "learning_rate=nan"),
        ("ZT_CONFIG_FILE", "zerotuner.yaml", "gradient_clipping: -.inf\n",
         "gradient_clipping=-inf"),
        ("ZT_CONFIG_FILE", "zerotuner.yaml", "ema_decay: '-Infinity'\n",
         "ZT_EMA_DECAY='-Infinity': expected a finite number"),
        ("ZT_CONFIG_FILE", "zerotuner.toml", "learning_rate = nan\n", "learning_rate=nan"),
        ("ZT_CONFIG_FILE", "zerotuner.toml", "[deepspeed_config]\ngradient_clipping = inf\n",
         "deepspeed_config.gradient_clipping=inf"),
        ("ZT_CONFIG_FILE", "zerotuner.yaml",
         "deepspeed_config:\n  optimizer: {params: {lr: .inf}}\n",
         "deepspeed_config.optimizer.params.lr=inf"),
        ("ZT_ACCELERATE_CONFIG", "accelerate.yaml",
         "deepspeed_config:\n  gradient_clipping: .nan\n",
         "deepspeed_config.gradient_clipping=nan"),
        ("ZT_ACCELERATE_CONFIG", "accelerate.yaml", "num_processes: .inf\n",
         "num_processes=inf"),
        ("ZT_DEEPSPEED_CONFIG", "ds.json", '{"optimizer": {"params": {"eps": NaN}}}',
         "optimizer.params.eps=nan"),
    ],
)  # fmt: skip
def test_non_finite_numbers_in_files(env, capsys, tmp_path, setting, name, text, expected):
    path = tmp_path / name
    path.write_text(text)
    env.setenv(setting, str(path))
    line = refused(*config(capsys), expected)
    assert str(path) in line or "ZT_EMA_DECAY" in line  # the file, or the setting it sets


def test_train_refuses_a_nan_deepspeed_config_before_any_rank(demo_dir, tmp_path):
    environ = subprocess_env(
        demo_dir, tmp_path, ZT_DATA_DIR=str(demo_dir / "data"),
        ZT_OUTPUT_DIR=str(tmp_path / "output"), ZT_MAX_STEPS="2",
        ZT_DEEPSPEED_CONFIG='{"gradient_clipping": NaN, "optimizer": {"params": {"lr": Infinity}}}',
    )  # fmt: skip
    code, out, err = zerotuner("train", environ)
    assert code == 2 and "Traceback" not in out + err, (code, out[-2000:], err[-2000:])
    assert "gradient_clipping=nan: expected a finite number" in out + err
    assert not (tmp_path / "output" / "final").exists()


# --- 5. the seed's nvme_path placeholder, and NVMe offload on a spinning disk ------------------


def test_the_seed_placeholder_nvme_path_is_reported_by_config(env, capsys, tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps(
            {
                "zero_optimization": {
                    "stage": 3,
                    "offload_param": {
                        "device": "nvme",
                        "nvme_path": "/path/to/nvme/storage",
                        "buffer_size": 1e8,
                        "pin_memory": True,
                    },
                }
            }
        )
    )  # fmt: skip  (SEED.md's NVMe example)
    env.setenv("ZT_DEEPSPEED_CONFIG", str(path))
    code, out, err = config(capsys)  # no --explain: the default output says it
    assert code == 0, err
    offload_dir = str(tmp_path / "offload")
    assert json.loads(out)["zero_optimization"]["offload_param"]["nvme_path"] == offload_dir
    lines = [line for line in err.splitlines() if "/path/to/nvme/storage" in line]
    assert lines == [
        "zerotuner: change: zero_optimization.offload_param.nvme_path placeholder "
        f"'/path/to/nvme/storage' -> {offload_dir} (ZT_OFFLOAD_DIR)"
    ], err


def fake_sysfs(root: Path, folder: Path, rotational: bool) -> Path:
    """A /sys where the disk holding `folder` (found by its device number) is a partition of
    a disk `sdz` with the given queue/rotational."""
    dev = os.stat(folder).st_dev
    if not os.major(dev):
        pytest.skip(f"{folder} is on an anonymous device (tmpfs/overlay): no disk to fake")
    disk = root / "devices" / "virtual" / "block" / "sdz"
    (disk / "queue").mkdir(parents=True)
    (disk / "queue" / "rotational").write_text("1\n" if rotational else "0\n")
    (disk / "sdz1").mkdir()
    (disk / "sdz1" / "partition").write_text("1\n")
    (root / "dev" / "block").mkdir(parents=True)
    (root / "dev" / "block" / f"{os.major(dev)}:{os.minor(dev)}").symlink_to(disk / "sdz1")
    return root


@pytest.mark.parametrize("spinning", [True, False])
def test_the_disk_is_found_by_device_number_whatever_the_mount_calls_it(tmp_path, spinning):
    sysfs = fake_sysfs(tmp_path / "sys", tmp_path, spinning)
    # /proc/mounts names the root filesystem /dev/root in many containers and VMs: no such
    # node in /dev, no such name in /sys/class/block.
    assert offload.rotational(tmp_path, "/dev/root", sysfs=sysfs) is spinning
    assert offload.rotational(tmp_path / "gone", "/dev/root", sysfs=sysfs) is None


@pytest.mark.parametrize(("spinning", "exists"), [(True, True), (True, False), (False, True)])
def test_check_warns_about_nvme_offload_on_a_rotational_disk(
    demo_job_env, capsys, tmp_path, monkeypatch, spinning, exists
):
    sysfs = fake_sysfs(tmp_path / "sys", tmp_path, spinning)
    monkeypatch.setattr(offload, "SYSFS", sysfs, raising=False)
    folder = tmp_path / "swap"
    if exists:
        folder.mkdir()
    nvme = {"ZT_ZERO_STAGE": "3", "ZT_OFFLOAD_PARAM": "nvme", "ZT_OFFLOAD_OPTIMIZER": "nvme"}
    for key, value in {"ZT_OFFLOAD_DIR": str(folder), **nvme}.items():
        demo_job_env.setenv(key, value)
    code = cli.main(["check"])
    out = capsys.readouterr().out
    offload_lines = [line for line in out.splitlines() if line[5:].startswith("offload ")]
    assert offload_lines and offload_lines[0].startswith("OK"), out
    warning = f"WARN offload          ZT_OFFLOAD_DIR={folder} is on a rotational disk"
    assert any(line.startswith(warning) for line in offload_lines) is spinning, out
    assert code == 0, out


# --- the model folder's own JSON files ---------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "damage", "expected"),
    [
        ("model_index.json", "{", "invalid JSON at line 1"),
        ("unet/config.json", '{"a": 1, "a": 2}', "duplicate key 'a'"),
        ("vae/config.json", "{}" + " " * MAX_FILE_BYTES, "larger than 4 MiB"),
    ],
)
def test_a_broken_model_folder_json_is_one_line(env, capsys, tmp_path, demo_dir, name, damage,
                                                expected):  # fmt: skip
    """The model's index and configs go through the same reader: a broken, duplicate-keyed or
    oversized file is one line naming ZT_MODEL (was: a JSONDecodeError traceback)."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(demo_dir / "model", model)
    target = model / name
    target.write_text(damage)
    env.setenv("ZT_MODEL", str(model))
    refused(*config(capsys), f"ZT_MODEL={target}", expected)


# --- settings that passed validation and then failed (issue 40) --------------------------------


def _datasets_file(tmp_path: Path, entries: list) -> Path:
    path = tmp_path / "datasets.json"
    path.write_text(json.dumps({"datasets": entries}))
    return path


def test_the_plan_sizes_the_largest_resolution_a_dataset_trains_at(monkeypatch, capsys, tmp_path):
    """An entry's own 4096 px with ZT_RESOLUTION=512 was planned at 512 px (7.9 GiB: fits 24
    GiB); at 4096 px it needs 50.7 GiB."""
    big = {"path": str(tmp_path / "big"), "resolution": 4096}
    monkeypatch.setenv("ZT_DATASETS_FILE", str(_datasets_file(tmp_path, [big, str(tmp_path)])))
    monkeypatch.setenv("ZT_RESOLUTION", "512")
    for name in ("ZT_DEVICE", "ZT_MODEL", "ZT_DATA_DIR"):
        monkeypatch.delenv(name, raising=False)
    base = ["plan", "--model-family", "sdxl", "--gpus", "1", "--host-memory", "128GiB"]
    assert cli.main([*base, "--gpu-memory", "80GiB", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["inputs"]["resolution"] == 4096
    assert cli.main([*base, "--gpu-memory", "24GiB"]) == 3
    err = capsys.readouterr().err
    assert "nothing fits" in err and "the `resolution` of a ZT_DATASETS_FILE entry" in err, err


def test_a_datasets_entry_resolution_is_bounded_as_zt_resolution(env, capsys, tmp_path):
    entry = {"path": str(tmp_path / "data"), "resolution": 8192}
    env.setenv("ZT_DATASETS_FILE", str(_datasets_file(tmp_path, [entry])))
    refused(*config(capsys), "datasets[0].resolution", "less than or equal to 4096")


def test_check_names_the_size_each_dataset_is_upscaled_to(env, capsys, tmp_path, demo_dir):
    """The upscale line named ZT_RESOLUTION's 64 px for a dataset trained at its own 1024."""
    entry = {"path": str(demo_dir / "data"), "resolution": 1024}
    env.setenv("ZT_DATASETS_FILE", str(_datasets_file(tmp_path, [entry])))
    env.setenv("ZT_RESOLUTION", "64")
    env.setenv("ZT_OUTPUT_DIR", str(tmp_path / "output"))
    env.setenv("ZT_METRICS_PORT", "0")
    assert cli.main(["check"]) == 0
    out = capsys.readouterr().out
    upscaled = [line for line in out.splitlines() if "will be upscaled" in line]
    assert len(upscaled) == 1, out
    assert f"{demo_dir / 'data'}: 64 of 64 images are smaller than 1024 px" in upscaled[0]


@pytest.mark.parametrize("value", ["0.9999-1", "0.9995-1"])
def test_a_timestep_range_that_holds_no_timestep_is_refused(env, capsys, value):
    """The DDPM loss drew timestep 1000 of 0-999: an IndexError at step 1."""
    env.setenv("ZT_TIMESTEP_RANGE", value)
    refused(*config(capsys), f"ZT_TIMESTEP_RANGE='{value}'", "low below 0.9995", "1000 timesteps")


def test_the_highest_timestep_range_that_holds_one_passes_and_trains(env, capsys):
    """0.9994-1 holds timestep 999 (of 0-999): accepted, and the DDPM loss draws it."""
    import torch
    from diffusers import DDPMScheduler

    from zerotuner.families.ddpm import LossConfig, diffusion_loss
    from zerotuner.settings.schema import load_settings

    env.setenv("ZT_TIMESTEP_RANGE", "0.9994-1")
    assert config(capsys)[0] == 0
    bounds = load_settings().timesteps

    def denoiser(noisy, timesteps):
        assert timesteps.tolist() == [999, 999]
        return type("Output", (), {"sample": noisy})

    loss = diffusion_loss(
        denoiser, DDPMScheduler(num_train_timesteps=1000), torch.zeros(2, 4, 8, 8), {},
        config=LossConfig("epsilon", None, 0.0, bounds), generator=torch.Generator(),
        dtype=torch.float32,
    )  # fmt: skip
    assert torch.isfinite(loss)


DURATIONS = ("ZT_STOP_GRACE_SECONDS", "ZT_HANG_TIMEOUT_SECONDS", "ZT_COLLECTIVE_TIMEOUT_SECONDS",
             "ZT_PEER_TIMEOUT_SECONDS")  # fmt: skip


@pytest.mark.parametrize("setting", DURATIONS)
def test_a_duration_past_what_its_users_accept_is_refused(env, capsys, setting):
    """1e300 s passed and killed the rank with OverflowError (timedelta, Thread.join)."""
    env.setenv(setting, "1e300")
    refused(*config(capsys), f"{setting}='1e300'", "less than or equal to 31536000")


def test_the_duration_ceiling_is_accepted_by_every_user():
    import datetime
    import threading

    from zerotuner.settings.schema import MAX_SECONDS

    datetime.timedelta(seconds=MAX_SECONDS)  # the process group's and the store's timeouts
    assert MAX_SECONDS < threading.TIMEOUT_MAX  # Thread.join, Event.wait
    assert MAX_SECONDS * 10**9 < 2**63 - 10**18  # C++ steady_clock in ns, from a ~30 y uptime


LONG_PART = "a" * 256


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("ZT_MODEL", f"/tmp/{LONG_PART}/model"),
        ("ZT_OUTPUT_DIR", f"/tmp/{LONG_PART}"),
        ("ZT_DATA_DIR", f"/tmp/{LONG_PART}"),
        ("ZT_CACHE_DIR", f"/tmp/{LONG_PART}"),
        ("ZT_OFFLOAD_DIR", f"/tmp/{LONG_PART}"),
        ("ZT_DATA_DIR", "/tmp/" + "/".join(["b" * 200] * 21)),  # parts fit, the path does not
    ],
)
def test_a_path_the_file_systems_cannot_name_is_one_line(env, capsys, tmp_path, setting, value):
    """A part over 255 bytes was an ENAMETOOLONG traceback from `config` and `train`."""
    env.setenv(setting, value)
    refused(*config(capsys), f"{setting}=", "each part (folder or file name) at most 255 bytes")


def test_check_and_the_builder_refuse_a_path_part_too_long(env, capsys):
    """`check` said "unexpected OSError" (exit 1); the builder answered 500."""
    from zerotuner.builder.evaluate import evaluate

    env.setenv("ZT_OUTPUT_DIR", f"/tmp/{LONG_PART}")
    assert cli.main(["check"]) == 2
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err and "unexpected" not in out + err
    assert "ZT_OUTPUT_DIR=" in out and "at most 255 bytes" in out, out
    result = evaluate({"settings": {"ZT_OUTPUT_DIR": f"/tmp/{LONG_PART}"}})
    assert result["exit_code"] == 2
    assert any("at most 255 bytes" in e["line"] for e in result["errors"]), result["errors"]
