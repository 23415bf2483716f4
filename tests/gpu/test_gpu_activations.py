"""ZT_OFFLOAD_ACTIVATIONS=cpu on CUDA: the checkpointed blocks' inputs leave the device (the peak
falls by about all but one block's input, what the planner counts), and the gradients are the
ones with the inputs on the device."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.gpu

LAYERS, HEADS, HEAD_DIM = 8, 2, 128
FRAMES, SIDE = 9, 128  # latent frames x height x width: 9 x 64 x 64 tokens after the 2x2 patch


def test_checkpointed_inputs_wait_in_host_memory(check):
    import torch
    from diffusers import WanTransformer3DModel

    from zerotuner.train.model import checkpoint_function

    config = {
        "patch_size": (1, 2, 2), "num_attention_heads": HEADS, "attention_head_dim": HEAD_DIM,
        "in_channels": 16, "out_channels": 16, "text_dim": 64, "freq_dim": 64, "ffn_dim": 512,
        "num_layers": LAYERS, "rope_max_seq_len": 1024,
    }  # fmt: skip
    tokens = FRAMES * (SIDE // 2) ** 2
    block_input = tokens * HEADS * HEAD_DIM * 4  # fp32 hidden states
    peaks, grads = {}, {}
    for how in ("none", "cpu"):
        torch.manual_seed(0)
        model = WanTransformer3DModel(**config).cuda()
        model.enable_gradient_checkpointing(checkpoint_function(how))
        model.train()
        gen = torch.Generator(device="cuda").manual_seed(1)
        clip = torch.randn(1, 16, FRAMES, SIDE, SIDE, device="cuda", generator=gen)
        text = torch.randn(1, 16, 64, device="cuda", generator=gen)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        out = model(hidden_states=clip, timestep=torch.tensor([500], device="cuda"),
                    encoder_hidden_states=text).sample  # fmt: skip
        out.square().mean().backward()
        torch.cuda.synchronize()
        peaks[how] = torch.cuda.max_memory_allocated() - start
        grads[how] = [p.grad.float().cpu() for p in model.parameters()]
        del model, out
        torch.cuda.empty_cache()
    saved = peaks["none"] - peaks["cpu"]
    check.table("peak device bytes of a forward and backward (MiB)", {
        "inputs on the device": round(peaks["none"] / 2**20, 1),
        "inputs in host memory": round(peaks["cpu"] / 2**20, 1),
        "saved": round(saved / 2**20, 1),
        "planned: all blocks' inputs but one": round((LAYERS - 1) * block_input / 2**20, 1),
    })  # fmt: skip
    check.expect(saved >= 0.5 * (LAYERS - 1) * block_input,
                 "the peak falls by at least half of the blocks' inputs")  # fmt: skip
    same = all(torch.allclose(a, b, rtol=1e-4, atol=1e-6)
               for a, b in zip(grads["none"], grads["cpu"], strict=True))  # fmt: skip
    check.expect(same, "the gradients equal those with the inputs on the device")
