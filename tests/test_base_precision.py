"""ZT_BASE_PRECISION: a LoRA run's frozen base stored in 8 bits (weights/base_precision.py).

On a tiny real diffusers UNet: the stored bytes (measured equal to what the planner's table
says), which layers are stored so, the forward close to the full-precision one, LoRA steps that
lower a loss and leave the base as it was (plain torch, and a real DeepSpeed ZeRO-2 engine), a
backward that keeps the 8-bit weights rather than upcast copies of them, and the refusals, one
line each through `zerotuner config`.
"""

from __future__ import annotations

import copy
import textwrap
from pathlib import Path

import pytest
import torch
import trainkit as tk

from zerotuner.errors import ConfigError
from zerotuner.settings.schema import Settings
from zerotuner.weights import base_precision, lora

# The demo UNet's shape (demo/pipelines.py), SD 1.x-style conditioning: every stored layer
# has 32 to 256 inputs, so the fp32 scale per row adds 1/32 of fp32 bytes at most.
UNET = dict(
    sample_size=8, in_channels=4, out_channels=4, block_out_channels=(32, 64), layers_per_block=1,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"), attention_head_dim=(2, 4),
    cross_attention_dim=32, use_linear_projection=True, norm_num_groups=32,
)  # fmt: skip
PRECISIONS = ("fp8", "int8")
# Relative L2 error of the whole UNet's output against fp32, measured on this CPU: fp8 0.028
# (e4m3 keeps 3 mantissa bits), int8 0.0045; the bounds leave room for other seeds.
FORWARD_ERROR = {"fp8": 0.05, "int8": 0.01}


def unet():
    from diffusers import UNet2DConditionModel

    torch.manual_seed(0)
    return UNet2DConditionModel(**UNET)


def inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    sample, states = torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 7, 32, generator=gen)
    return sample, torch.tensor([10, 500]), states


def stored(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Each stored layer's 8-bit values and scales, copied (named as before peft wrapped it)."""
    return {
        f"{name.removesuffix('.base_layer')}.{part}": getattr(layer.weight, part).detach().clone()
        for name, layer in module.named_modules()
        if type(getattr(layer, "weight", None)).__module__.startswith("torchao.")
        for part in layer.weight.tensor_data_names
    }


@pytest.fixture(scope="module")
def reference():
    return unet()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_stored_bytes_are_a_quarter_of_fp32_and_what_the_planner_counts(reference, precision):
    from accelerate import init_empty_weights
    from diffusers import UNet2DConditionModel

    model = copy.deepcopy(reference)
    measured = base_precision.quantize_frozen_base(model, precision)
    with init_empty_weights():  # the planner sees the model's shapes only
        planned = base_precision.planned_bytes(UNet2DConditionModel(**UNET), precision, 4)
    assert measured == planned
    assert measured.layers == 56 and measured.kept_layers == 2
    ratio = measured.quantized_after / measured.quantized_before
    assert 0.25 < ratio <= 0.25 + 5 / (4 * 32), ratio  # 1 byte of 4, and each row's scale
    assert measured.before - measured.after == measured.quantized_before - measured.quantized_after
    assert measured.largest_upcast == max(
        m.weight.numel() * 4 for n, m in reference.named_modules()
        if base_precision.stored_low(n, m)
    )  # fmt: skip
    assert f"frozen base stored at {precision}: 56 Linear layers" in measured.line()


def test_the_blocks_linear_layers_are_stored_and_the_rest_kept(reference):
    model = copy.deepcopy(reference)
    base_precision.quantize_frozen_base(model, "fp8")
    kinds = {name: type(getattr(m, "weight", None)).__name__ for name, m in model.named_modules()}
    attention = "down_blocks.1.attentions.0.transformer_blocks.0.attn1"
    assert kinds[f"{attention}.to_q"] == kinds["up_blocks.0.attentions.0.proj_in"] == "Float8Tensor"
    assert kinds["down_blocks.0.resnets.0.time_emb_proj"] == "Float8Tensor"
    # outside the blocks (the time embedder), norms, convolutions: the run's precision
    kept = ("time_embedding.linear_1", "time_embedding.linear_2", "conv_in", "conv_out",
            "conv_norm_out", "down_blocks.1.attentions.0.norm",
            "up_blocks.1.resnets.0.conv1")  # fmt: skip
    for name in kept:
        assert kinds[name] == "Parameter", name
    weight = model.get_submodule(f"{attention}.to_q").weight
    assert weight.qdata.dtype == torch.float8_e4m3fn and weight.scale.shape == (64, 1)  # per row
    # the stored weights are buffers out of every state_dict: no checkpoint holds the base
    names = set(model.state_dict())
    assert f"{attention}.to_q.weight" not in names and "time_embedding.linear_1.weight" in names
    assert not any(p.dtype == torch.float8_e4m3fn for p in model.parameters())


def test_adaptive_norms_and_odd_sizes_are_kept():
    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm1 = torch.nn.Module()
            self.norm1.linear = torch.nn.Linear(32, 192)  # AdaLayerNormZero's modulation
            self.attn = torch.nn.Linear(32, 32)
            self.odd = torch.nn.Linear(32, 40)

    root = torch.nn.Module()
    root.blocks = torch.nn.ModuleList([Block()])
    root.proj_out = torch.nn.Linear(32, 16)  # the final layer
    stored_names = [n for n, m in root.named_modules() if base_precision.stored_low(n, m)]
    assert stored_names == ["blocks.0.attn"]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_forward_stays_close_to_full_precision(reference, precision):
    model = copy.deepcopy(reference)
    base_precision.quantize_frozen_base(model, precision)
    with torch.no_grad():
        full, low = reference(*inputs()).sample, model(*inputs()).sample
    error = ((low - full).norm() / full.norm()).item()
    assert error < FORWARD_ERROR[precision], error


@pytest.mark.parametrize(("precision", "dora"), [("fp8", False), ("int8", False), ("fp8", True)])
def test_lora_steps_lower_the_loss_and_leave_the_base(reference, precision, dora):
    model = copy.deepcopy(reference)
    base_precision.quantize_frozen_base(model, precision)
    base = stored(model)
    kept = {n: p.detach().clone() for n, p in model.named_parameters()}
    settings = Settings(training_type="lora", lora_rank=4, lora_targets="attention+ff,proj_in",
                        lora_dora=dora, base_precision=precision)  # fmt: skip
    trained = lora.add_adapter(model, settings)
    wrapped = model.get_submodule("down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q")
    assert type(wrapped).__name__ == "TorchaoLoraLinear"  # peft's LoRA on a torchao weight
    assert all(p.dtype == torch.float32 for p in trained)  # the adapter: the run's precision
    optimizer = torch.optim.AdamW(trained, lr=1e-2)
    target = torch.randn(2, 4, 8, 8, generator=torch.Generator().manual_seed(2))
    losses = []
    for _ in range(5):
        loss = torch.nn.functional.mse_loss(model(*inputs()).sample, target)
        loss.backward()
        assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.95 * losses[0], losses
    after = stored(model)
    assert base.keys() == after.keys() and len(base) == 2 * 56
    assert all(torch.equal(base[k], after[k]) for k in base)
    for name, param in model.named_parameters():
        if ".lora_" not in name:
            assert torch.equal(param, kept[name.replace(".base_layer", "")]), name


def saved_for_backward(model: torch.nn.Module) -> tuple[int, int]:
    """Bytes autograd keeps from one forward for the backward: (copies, stored), beside what
    aliases the model's own parameters and buffers (stored: its 8-bit weights)."""
    own = {t.data_ptr() for t in (*model.parameters(), *model.buffers())
           if not type(t).__module__.startswith("torchao")}  # fmt: skip
    kept = [0, 0]

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if type(tensor).__module__.startswith("torchao"):
            kept[1] += base_precision._tensor_bytes(tensor)
        elif tensor.data_ptr() not in own:
            kept[0] += tensor.numel() * tensor.element_size()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(*inputs()).sample.sum().backward()
    return kept[0], kept[1]


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_backward_keeps_the_stored_weights_not_upcast_copies(reference, precision):
    """Autograd keeps from the forward, beside the activations the full-precision base's run
    keeps too, the 8-bit weights themselves: no layer's upcast copy outlives its matmul. The
    adapter's gradients are those of the plain upcast matmul."""
    settings = Settings(training_type="lora", lora_rank=4, base_precision=precision)
    full = copy.deepcopy(reference)
    lora.add_adapter(full, settings)
    low = copy.deepcopy(reference)
    stats = base_precision.quantize_frozen_base(low, precision)
    lora.add_adapter(low, settings)
    plain = copy.deepcopy(low)  # autograd through torchao's own upcast
    for layer in plain.modules():
        if isinstance(layer, base_precision.StoredLinear):
            layer.__class__ = torch.nn.Linear
    (full_copies, _), (copies, stored) = saved_for_backward(full), saved_for_backward(low)
    assert copies == full_copies and 0 < stored <= stats.quantized_after
    plain_copies, _ = saved_for_backward(plain)
    assert plain_copies - full_copies >= stats.quantized_before / 2  # what it would keep
    grads = {n: p.grad for n, p in low.named_parameters() if p.grad is not None}
    assert grads and grads.keys() == {n for n, p in plain.named_parameters() if p.grad is not None}
    for name, param in plain.named_parameters():
        if param.grad is not None:
            torch.testing.assert_close(grads[name], param.grad, rtol=1e-4, atol=1e-6)


def test_a_partitioned_model_or_one_with_its_adapter_is_refused(reference):
    model = copy.deepcopy(reference)
    next(model.parameters()).ds_id = 0  # what ZeRO-3's zero.Init leaves on each parameter
    with pytest.raises(ConfigError, match="ZT_BASE_PRECISION=fp8: the model was built partitioned"):
        base_precision.quantize_frozen_base(model, "fp8")
    model = copy.deepcopy(reference)
    lora.add_adapter(model, Settings(training_type="lora", lora_rank=2))
    with pytest.raises(ValueError, match="before the LoRA adapter is added"):
        base_precision.quantize_frozen_base(model, "int8")


# A real DeepSpeed engine, as the worker builds it: the base quantized after loading, the
# adapter added, only its parameters given to deepspeed.initialize (bf16, ZeRO-2).
ENGINE = textwrap.dedent(
    """
    import json
    import deepspeed, torch
    from diffusers import UNet2DConditionModel
    from zerotuner.settings.schema import Settings
    from zerotuner.weights import base_precision, lora

    deepspeed.init_distributed(dist_backend="gloo")
    result = {}
    for precision in ("fp8", "int8"):
        torch.manual_seed(0)
        model = UNet2DConditionModel(**UNET).to(torch.bfloat16)  # loaded at the run's dtype
        stats = base_precision.quantize_frozen_base(model, precision)
        settings = Settings(training_type="lora", lora_rank=4, base_precision=precision)
        params = lora.add_adapter(model, settings)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
                  "zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=config)
        layer = engine.module.get_submodule(
            "down_blocks.1.attentions.0.transformer_blocks.0.attn1.to_q.base_layer")
        before = layer.weight.qdata.clone()
        gen = torch.Generator().manual_seed(1)
        x, states = torch.randn(2, 4, 8, 8, generator=gen), torch.randn(2, 7, 32, generator=gen)
        target = torch.randn(2, 4, 8, 8, generator=gen)
        losses = []
        for _ in range(4):
            out = engine(x.bfloat16(), torch.tensor([10, 500]), states.bfloat16()).sample
            loss = torch.nn.functional.mse_loss(out.float(), target)
            engine.backward(loss)
            engine.step()
            losses.append(loss.item())
        result[precision] = {
            "losses": losses, "layers": stats.layers,
            "weight": type(layer.weight).__name__, "dtype": str(layer.weight.dtype),
            "unchanged": bool(torch.equal(before, layer.weight.qdata)),
            "saved_base": any(k.endswith("to_q.base_layer.weight")
                              for k in engine.module_state_dict(exclude_frozen_parameters=True)),
        }
        engine.destroy()
    print("RESULT " + json.dumps(result))
    """
)


@pytest.mark.slow
def test_a_deepspeed_zero2_engine_trains_the_adapter_on_a_stored_base(tmp_path):
    result = tk.lone_rank_result(tmp_path, f"UNET = {UNET!r}\n" + ENGINE)
    for precision, seen in result.items():
        assert seen["weight"] == {"fp8": "Float8Tensor", "int8": "Int8Tensor"}[precision]
        assert seen["dtype"] == "torch.bfloat16" and seen["layers"] == 56
        assert seen["unchanged"] and not seen["saved_base"], seen
        assert seen["losses"][-1] < seen["losses"][0], seen


# --- settings -------------------------------------------------------------------------------


def errors(err: str) -> list[str]:
    return [line for line in err.strip().splitlines() if line.startswith("zerotuner: error")]


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"ZT_BASE_PRECISION": "nf4"},
         "ZT_BASE_PRECISION='nf4': expected 'auto', 'fp8' or 'int8'"),
        ({"ZT_BASE_PRECISION": "fp8", "ZT_TRAINING_TYPE": "full"},
         "ZT_BASE_PRECISION=fp8 with ZT_TRAINING_TYPE=full: full training writes the base "
         "weights, and a base stored at fp8 is read-only; set ZT_TRAINING_TYPE=lora or "
         "ZT_BASE_PRECISION=auto"),
        ({"ZT_BASE_PRECISION": "int8", "ZT_ZERO_STAGE": "3"},
         "ZT_BASE_PRECISION=int8 with ZT_ZERO_STAGE=3: ZeRO-3 partitions the base weights, and "
         "DeepSpeed cannot partition a base stored at int8; set ZT_ZERO_STAGE to 0-2 (with "
         "ZT_OFFLOAD_OPTIMIZER if it must fit) or ZT_BASE_PRECISION=auto"),
        ({"ZT_BASE_PRECISION": "fp8", "ZT_OFFLOAD_PARAM": "cpu"},
         "ZT_BASE_PRECISION=fp8 with ZT_OFFLOAD_PARAM=cpu: parameter offload is ZeRO-3's, and "
         "DeepSpeed cannot partition a base stored at fp8; set ZT_OFFLOAD_PARAM=none (the "
         "optimizer may still be offloaded) or ZT_BASE_PRECISION=auto"),
        ({"ZT_BASE_PRECISION": "fp8", "ZT_LORA_INIT": "pissa"},
         "ZT_BASE_PRECISION=fp8 with ZT_LORA_INIT=pissa: it moves part of each base weight "
         "into the adapter, and a base stored at fp8 is read-only; set ZT_LORA_INIT=gaussian "
         "or ZT_BASE_PRECISION=auto"),
    ],
)  # fmt: skip
def test_refusals_are_one_line_and_exit_2(monkeypatch, capsys, tmp_path, env, expected):
    env = {"ZT_TRAINING_TYPE": "lora", **env}
    code, out, err = tk.config_explain(monkeypatch, capsys, tmp_path, **env)
    assert code == 2 and out == "", err
    assert errors(err) == [f"zerotuner: error: {expected}"], err
    assert "Traceback" not in err


@pytest.mark.parametrize("precision", ["auto", "fp8", "int8"])
def test_a_lora_run_may_store_its_base_low(monkeypatch, capsys, tmp_path, demo_dir, precision):
    code, out, err = tk.config_explain(
        monkeypatch, capsys, tmp_path, ZT_TRAINING_TYPE="lora", ZT_MODEL=str(demo_dir / "model"),
        ZT_BASE_PRECISION=precision, ZT_ZERO_STAGE="2",
    )  # fmt: skip
    assert code == 0, err


def test_the_plans_zero3_is_refused_too():
    settings = Settings(training_type="lora", base_precision="fp8")
    with pytest.raises(ConfigError, match=r"^ZT_BASE_PRECISION=fp8 with ZeRO-3 \(the plan's"):
        lora.check_init_stage(settings, 3)
    lora.check_init_stage(settings, 2)
    lora.check_init_stage(Settings(training_type="lora"), 3)  # auto: any stage


def test_a_resume_keeps_the_base_precision(tmp_path: Path):
    fp8 = Settings(training_type="lora", base_precision="fp8")
    manifest = {"training_type": "lora", "lora": base_precision.manifest_entry(fp8)}
    base_precision.check_resume(manifest, fp8, tmp_path)
    with pytest.raises(ConfigError) as refused:
        base_precision.check_resume(manifest, Settings(training_type="lora"), tmp_path)
    assert str(refused.value) == (
        f"ZT_BASE_PRECISION=auto: the checkpoint to resume ({tmp_path}) trained its adapter on "
        "a base stored at fp8; set it back to continue, or ZT_RESUME=never or another "
        "ZT_OUTPUT_DIR to start afresh"
    )
    older = {"training_type": "lora", "lora": {"rank": 4}}  # from before the setting: auto
    base_precision.check_resume(older, Settings(training_type="lora"), tmp_path)
    with pytest.raises(ConfigError, match="a base stored at auto"):
        base_precision.check_resume(older, fp8, tmp_path)


def test_the_bench_row_measures_what_the_planner_counts(demo_dir):
    """bench/base_precision.py's row on the demo UNet: a process that loads it and stores it at
    fp8 holds the tensor bytes the planner counts for the base (the RSS beside them is the
    bench's to report: a ~1M-parameter UNet is below its noise)."""
    import json
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    from bench import runs
    from bench.base_precision import planned

    model = demo_dir / "model"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.base_precision", str(model), "bf16", "fp8"],
        cwd=repo, env=runs.base_env(), capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    measured = json.loads(proc.stdout.strip().splitlines()[-1])
    counted = planned(model, "bf16", "fp8")
    assert measured["tensor_bytes"] == counted["planned_bytes"]
    assert counted["planned_bytes"] < planned(model, "bf16", "auto")["planned_bytes"]
    assert measured["host_bytes"] == measured["anon_bytes"] + measured["file_bytes"]
