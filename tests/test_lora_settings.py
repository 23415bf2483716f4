"""LoRA settings (ZT_TRAINING_TYPE=lora, ZT_LORA_*): one exit-2 line for each bad value, the
targets checked against the model's own UNet, and the defaults."""

from __future__ import annotations

import pytest
import trainkit as tk

from zerotuner.settings.schema import Settings
from zerotuner.weights import lora


def errors(err: str) -> list[str]:
    return [line for line in err.strip().splitlines() if line.startswith("zerotuner: error")]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"ZT_LORA_RANK": "0"}, "ZT_LORA_RANK='0': expected greater than or equal to 1"),
        ({"ZT_LORA_ALPHA": "0"}, "ZT_LORA_ALPHA='0': expected greater than 0"),
        ({"ZT_LORA_ALPHA": "-2"}, "ZT_LORA_ALPHA='-2': expected greater than 0"),
        ({"ZT_LORA_DROPOUT": "1"}, "ZT_LORA_DROPOUT='1': expected less than 1"),
        ({"ZT_TRAINING_TYPE": "qlora"}, "ZT_TRAINING_TYPE='qlora': expected 'full' or 'lora'"),
        ({"ZT_LORA_TARGETS": " , "}, "ZT_LORA_TARGETS=' , ': expected a preset"),
    ],
)
def test_bad_lora_settings_are_one_line_and_exit_2(monkeypatch, capsys, tmp_path, env, expected):
    code, out, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, **{"ZT_TRAINING_TYPE": "lora", **env}
    )
    assert code == 2 and out == ""
    assert len(errors(err)) == 1, err
    assert errors(err)[0].startswith(f"zerotuner: error: {expected}"), err


def test_lora_settings_with_full_training_are_an_error(monkeypatch, capsys, tmp_path):
    code, out, err = tk.config_explain(monkeypatch, capsys, tmp_path, ZT_LORA_RANK="8")
    assert code == 2 and out == ""
    assert errors(err) == [
        "zerotuner: error: ZT_LORA_RANK is set but ZT_TRAINING_TYPE=full: set "
        "ZT_TRAINING_TYPE=lora or unset ZT_LORA_RANK"
    ]


def test_variants_and_ema_with_lora_pass_and_are_said(monkeypatch, capsys, tmp_path, demo_dir):
    code, out, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, ZT_TRAINING_TYPE="lora", ZT_MODEL=str(demo_dir / "model"),
        ZT_LORA_DORA="true", ZT_LORA_RSLORA="true", ZT_LORA_MERGE="true", ZT_EMA="true",
        ZT_LORA_RANK="4", ZT_LORA_TEXT_ENCODER="true",
    )  # fmt: skip
    assert code == 0, err
    assert "LoRA rank 4, alpha 4 (DoRA, rsLoRA) on to_k" in err
    assert "ZT_LORA_TEXT_ENCODER: the text encoders train adapters too" in err
    assert "captions are not cached" in err
    code, out, err = tk.config_explain(monkeypatch, capsys, tmp_path, ZT_TRAINING_TYPE="full")
    assert code == 2
    for name in ("ZT_LORA_DORA", "ZT_LORA_RSLORA", "ZT_LORA_MERGE", "ZT_LORA_TEXT_ENCODER"):
        assert f"zerotuner: error: {name} is set but ZT_TRAINING_TYPE=full: set " in err, err


def test_a_target_the_unet_lacks_lists_the_valid_names(monkeypatch, capsys, tmp_path, demo_dir):
    code, out, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, ZT_TRAINING_TYPE="lora", ZT_MODEL=str(demo_dir / "model"),
        ZT_LORA_TARGETS="to_q,to_query,attn9",
    )  # fmt: skip
    assert code == 2 and out == ""
    (line,) = errors(err)
    assert line.startswith(
        "zerotuner: error: ZT_LORA_TARGETS: no layer of this UNet is called to_query, attn9; "
        "valid names: "
    )
    for name in ("to_q", "to_out.0", "proj_in", "conv1", "attention+ff"):
        assert name in line


@pytest.mark.parametrize("targets", ["attention", "attention+ff", "to_q, to_v ,proj_in"])
def test_valid_lora_settings_pass(monkeypatch, capsys, tmp_path, demo_dir, targets):
    code, out, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, ZT_TRAINING_TYPE="lora", ZT_MODEL=str(demo_dir / "model"),
        ZT_LORA_TARGETS=targets, ZT_LORA_RANK="4",
    )  # fmt: skip
    assert code == 0, err
    assert f"LoRA rank 4, alpha 4 on {lora.parse_targets(targets)[0]}" in err


def test_targets_default_to_diffusers_sdxl_example_and_alpha_to_the_rank():
    settings = Settings(training_type="lora", lora_rank=8, config_file="/nonexistent")
    assert lora.parse_targets(settings.lora_targets) == ("to_k", "to_q", "to_v", "to_out.0")
    assert lora.alpha(settings) == 8
    config = lora.lora_config(settings)
    assert (config.r, config.lora_alpha) == (8, 8)
    assert lora.parse_targets("to_q,to_q, conv1") == ("to_q", "conv1")


def test_a_target_that_also_names_a_layer_lora_cannot_wrap_is_one_line(
    monkeypatch, capsys, tmp_path, family_demo_dir
):
    """Z-Image's `adaLN_modulation.0` is a Linear in its blocks and a SiLU in its final layer:
    peft refused the SiLU after caching (exit 1). A whole path to one Linear passes."""
    model = str(family_demo_dir("zimage") / "model")
    code, out, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, ZT_TRAINING_TYPE="lora", ZT_MODEL=model,
        ZT_LORA_TARGETS="to_q,adaLN_modulation.0",
    )  # fmt: skip
    assert code == 2 and out == ""
    (line,) = errors(err)
    assert line.startswith(
        "zerotuner: error: ZT_LORA_TARGETS: adaLN_modulation.0 also names "
        "all_final_layer.2-1.adaLN_modulation.0, a SiLU, and LoRA wraps only Linear and Conv2d "
        "layers"
    ), line
    code, out, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, ZT_LORA_TARGETS="layers.0.adaLN_modulation.0"
    )
    assert code == 0, err
