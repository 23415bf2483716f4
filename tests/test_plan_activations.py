"""The planner's activations of the image families measured per block (issue 47): Krea 2's and
HiDream-I1's real diffusers blocks, tiny, recounted on the CPU at two widths, save per image and
per text token what shapes.MEASURED_BLOCKS counts, and the planner plans with those counts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from zerotuner.families import REGISTRY, model_shape, shapes
from zerotuner.machine.hardware import GPU, GiB, Hardware
from zerotuner.preflight.plan import PlanRequest, make_plan

# two tiny widths of each family (Krea 2 keeps its 4 query heads per key/value head; HiDream its
# 4 routed experts, 2 per token; 128 wide rounds its SwiGLUs' hidden units up, 384 does not)
KREA2 = (
    {"num_attention_heads": 4, "num_key_value_heads": 1, "attention_head_dim": 32,
     "intermediate_size": 256, "text_hidden_dim": 64, "num_text_layers": 3,
     "text_num_attention_heads": 2, "text_num_key_value_heads": 2, "text_intermediate_size": 128},
    {"num_attention_heads": 8, "num_key_value_heads": 2, "attention_head_dim": 32,
     "intermediate_size": 512, "text_hidden_dim": 128, "num_text_layers": 4,
     "text_num_attention_heads": 4, "text_num_key_value_heads": 4, "text_intermediate_size": 192},
)  # fmt: skip
HIDREAM = (
    {"num_attention_heads": 2, "attention_head_dim": 64},
    {"num_attention_heads": 6, "attention_head_dim": 64},
)


def saved_bytes(module: Any, run: Callable[[], Any], shared: tuple[Any, ...] = ()) -> int:
    """Bytes autograd saves for backward in `run()`: each storage once, less the `module`'s
    parameters and the `shared` tensors (RoPE's tables: every layer's); SDPA stood in for by what
    a fused kernel saves (query, key, value, output and each head's fp32 logsumexp)."""
    import torch
    import torch.nn.functional as F

    class Fused(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = torch.empty_like(q), torch.empty(q.shape[:-1], dtype=torch.float32)
            ctx.save_for_backward(q, k, v, out, lse)
            return out

        @staticmethod
        def backward(ctx, grad):
            return tuple(torch.empty_like(t) for t in ctx.saved_tensors[:3])

    def sdpa(query, key, value, *args, **kwargs):
        calls.append(1)
        return Fused.apply(query, key, value)

    skipped = {t.untyped_storage().data_ptr() for t in (*module.parameters(), *shared)}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in skipped:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    calls: list[int] = []
    real, F.scaled_dot_product_attention = F.scaled_dot_product_attention, sdpa
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        F.scaled_dot_product_attention = real
    assert calls, "the block attended without F.scaled_dot_product_attention"
    return sum(seen.values())


def krea2_block_bytes(config: dict[str, Any], tokens: int) -> int:
    """One Krea2TransformerBlock of `config` in bf16 on `tokens` (masked, as Krea 2 attends)."""
    import torch
    from diffusers.models.transformers.transformer_krea2 import (
        Krea2RotaryPosEmbed,
        Krea2TransformerBlock,
    )

    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    width, bf16 = heads * head_dim, {"dtype": torch.bfloat16}
    block = Krea2TransformerBlock(
        width, config["intermediate_size"], heads, config["num_key_value_heads"], 1e-5
    ).to(torch.bfloat16)
    x = torch.randn(1, tokens, width, requires_grad=True, **bf16)
    temb = torch.randn(1, 1, 6 * width, requires_grad=True, **bf16)
    ids = torch.zeros(tokens, 3)
    ids[:, 1] = torch.arange(tokens)
    rope = Krea2RotaryPosEmbed(1000, [head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8])(ids)
    mask = torch.ones(1, 1, 1, tokens, dtype=torch.bool)
    return saved_bytes(block, lambda: block(x, temb, rope, mask), rope)


def krea2_caption_bytes(config: dict[str, Any], tokens: int) -> int:
    """Krea 2's text fusion and txt_in (2 layerwise, 2 refiner blocks) on `tokens` cached ones."""
    import torch
    from diffusers.models.transformers.transformer_krea2 import (
        Krea2TextFusion,
        Krea2TextProjection,
    )

    text_width, layers = config["text_hidden_dim"], config["num_text_layers"]
    heads = config["text_num_attention_heads"]
    fusion = Krea2TextFusion(
        layers, text_width, heads, config["text_num_key_value_heads"],
        config["text_intermediate_size"], 2, 2, 1e-5,
    ).to(torch.bfloat16)  # fmt: skip
    width = config["num_attention_heads"] * config["attention_head_dim"]
    projection = Krea2TextProjection(text_width, width, 1e-5).to(torch.bfloat16)
    both = torch.nn.ModuleList([fusion, projection])
    states = torch.randn(1, tokens, layers, text_width, dtype=torch.bfloat16)
    mask = torch.ones(1, 1, 1, tokens, dtype=torch.bool)
    return saved_bytes(both, lambda: projection(fusion(states, attention_mask=mask)))


def hidream_block_bytes(config: dict[str, Any], single: bool, image: int, text: int) -> int:
    """One HiDream double- or `single`-stream block of `config` in bf16 and training mode (its
    experts' differentiable path) on `image` and `text` tokens (a square image: no mask)."""
    import torch
    from diffusers.models.transformers.transformer_hidream_image import (
        HiDreamImageEmbedND,
        HiDreamImageSingleTransformerBlock,
        HiDreamImageTransformerBlock,
    )

    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    width, bf16 = heads * head_dim, {"dtype": torch.bfloat16}
    cls = HiDreamImageSingleTransformerBlock if single else HiDreamImageTransformerBlock
    torch.manual_seed(0)  # the router's choices: the experts see tokens x 2 whatever they are
    block = cls(width, heads, head_dim, 4, 2).to(torch.bfloat16).train()
    x = torch.randn(1, image + text if single else image, width, requires_grad=True, **bf16)
    words = None if single else torch.randn(1, text, width, requires_grad=True, **bf16)
    temb = torch.randn(1, width, requires_grad=True, **bf16)
    ids = torch.zeros(1, image + text, 3)
    ids[0, :image, 1] = torch.arange(image)
    rope = HiDreamImageEmbedND(10000, [head_dim // 2, head_dim // 4, head_dim // 4])(ids)
    return saved_bytes(block, lambda: block(x, None, words, temb, rope), (rope,))


@pytest.mark.parametrize("config", KREA2)
def test_a_krea2_block_and_its_text_fusion_save_what_the_planner_counts(config):
    """Per token and layer (text and image tokens pass the blocks alike), and per caption token
    once through the text-fusion stage, within 1 %."""
    planned = shapes.krea2_blocks(config)
    (blocks,) = planned.kinds
    per_token = (krea2_block_bytes(config, 128) - krea2_block_bytes(config, 64)) / 64
    assert per_token == pytest.approx(blocks.image_bytes, rel=0.01)
    assert blocks.text_bytes == blocks.image_bytes
    caption = (krea2_caption_bytes(config, 64) - krea2_caption_bytes(config, 32)) / 32
    assert caption == pytest.approx(planned.caption_bytes, rel=0.01)


@pytest.mark.parametrize("config", HIDREAM)
def test_hidreams_double_and_single_blocks_save_what_the_planner_counts(config):
    """Per image token (its routed experts' share included) and per text token of a double- and
    a single-stream block, within 1 %."""
    double, single = shapes.hidream_blocks(config).kinds
    for kind, is_single in ((double, False), (single, True)):
        base = hidream_block_bytes(config, is_single, 64, 32)
        image = (hidream_block_bytes(config, is_single, 128, 32) - base) / 64
        text = (hidream_block_bytes(config, is_single, 64, 64) - base) / 32
        assert image == pytest.approx(kind.image_bytes, rel=0.01)
        assert text == pytest.approx(kind.text_bytes, rel=0.01)


def test_the_planner_plans_the_measured_blocks():
    """model_shape's activations of Krea 2 and HiDream are their MeasuredBlocks' at 1024 px
    (4096 image tokens): each block's saved tensors, or with checkpointing the blocks' inputs
    and the biggest recomputed, plus Krea 2's text fusion; 2-3x Korthikanti's 34 x width. A
    family without measurements keeps Korthikanti's."""
    for family, korthikanti in (("krea2", 26_952_597_504), ("hidream", 17_647_534_080)):
        shape, config = model_shape(family), REGISTRY[family].builtin_config
        assert shape.activations_1024 == shapes.MEASURED_BLOCKS[family](config).activations(4096)
        assert 2 * korthikanti < shape.activations_1024[0] < 3.5 * korthikanti
    krea2 = shapes.krea2_blocks(REGISTRY["krea2"].builtin_config)
    assert (krea2.kinds[0].image_bytes, krea2.caption_bytes) == (438_712, 4_627_716)
    double, single = shapes.hidream_blocks(REGISTRY["hidream"].builtin_config).kinds
    assert (double.image_bytes, double.text_bytes, single.text_bytes) == (262_284, 157_792, 262_284)
    assert (double.text_tokens, single.text_tokens) == (384, 384)  # T5's, Llama's last, its own
    assert "flux" not in shapes.MEASURED_BLOCKS  # Korthikanti's: 34 x tokens x width a layer
    flux = model_shape("flux").activations_1024[0]
    assert flux == (19 + 38) * 34 * (4096 + REGISTRY["flux"].clip_tokens + 512) * 3072


def test_the_planner_counts_the_images_tokens_at_its_resolution_and_the_captions_as_they_are():
    """At 512 px a plan's activations are the measured blocks' on 1024 image tokens (a quarter
    of 1024 px's), the caption's 512 (Krea 2) or 3 x 128 (HiDream) tokens unchanged: more than
    a quarter of 1024 px's."""
    h100 = GPU(0, "H100", 80 * GiB, 80 * GiB, (9, 0))
    hardware = Hardware("cuda", (h100,), host_memory=256 * GiB)
    for family in ("krea2", "hidream"):
        shape = model_shape(family)
        plan = make_plan(
            shape=shape, hardware=hardware, offload_disk_free=2 * 10**12, require_fit=False,
            request=PlanRequest(resolution=512, micro_batch=1, world_size=1),
        )  # fmt: skip
        for row in plan.rows:
            measured = shape.blocks.activations(1024)[int(row.gradient_checkpointing)]
            assert row.parts["device.activations"] == measured  # bf16, one image
            assert measured > shape.activations_1024[int(row.gradient_checkpointing)] / 4
