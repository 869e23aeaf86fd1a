"""Tiny Hugging Face mixture-of-experts models for the MoE tests (nothing downloaded).

Each family keeps every dim that a tp or ep of 2 splits even: 4 experts, 2 per token, 4 heads
of 8, 2 key/value heads. `factory(family)` is picklable (a functools.partial), so gloo ranks and
the single-process reference build the same seeded weights.
"""

from __future__ import annotations

import functools

import torch

FAMILIES = ("mixtral", "qwen3_moe", "deepseek_v3")

_COMMON = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)


def config(family: str, **overrides):
    """The tiny transformers config of `family` (sdpa attention)."""
    import transformers

    if family == "mixtral":
        cfg = dict(_COMMON, num_key_value_heads=2, intermediate_size=64, num_local_experts=4,
                   num_experts_per_tok=2, head_dim=8)
        cls = transformers.MixtralConfig
    elif family == "qwen3_moe":
        cfg = dict(_COMMON, num_key_value_heads=2, intermediate_size=64, head_dim=8,
                   num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   norm_topk_prob=True)
        cls = transformers.Qwen3MoeConfig
    elif family == "deepseek_v3":
        # Multi-head latent attention (q/kv LoRA ranks), layer 0 dense, layer 1 MoE with one
        # shared expert and group-limited routing (2 groups, 1 chosen).
        cfg = dict(_COMMON, num_key_value_heads=4, intermediate_size=64, n_routed_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                   n_group=2, topk_group=1, first_k_dense_replace=1, q_lora_rank=16,
                   kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8)
        cls = transformers.DeepseekV3Config
    else:
        raise ValueError(f"unknown MoE family {family!r}; known: {', '.join(FAMILIES)}")
    cfg.update(overrides)
    return cls(**cfg, attn_implementation="sdpa")


def _build(family: str, seed: int, overrides: dict):
    import transformers

    classes = {"mixtral": transformers.MixtralForCausalLM,
               "qwen3_moe": transformers.Qwen3MoeForCausalLM,
               "deepseek_v3": transformers.DeepseekV3ForCausalLM}
    torch.manual_seed(seed)
    model = classes[family](config(family, **overrides))
    if family == "deepseek_v3":
        # HF zero-initialises the router's score-correction bias; a non-zero one makes the
        # test see it used (it is a buffer: read by the routing, never trained).
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.linspace(-0.1, 0.1, buf.numel()))
    return model


def factory(family: str, seed: int = 0, **overrides):
    """Picklable factory: the tiny model of `family` with weights seeded by `seed`."""
    return functools.partial(_build, family, seed, overrides)


def assert_matches(results, ref):
    """Every rank's losses and parameters of `_jobs.train` `results` equal the one-process
    `_jobs.reference` `ref` (fp32 rtol 1e-5 / atol 1e-6, AdamW's rounding allowance), and
    every parameter is held by some rank."""
    from autoplan.testing import assert_params_close

    for losses, params, *_ in results:
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref[0]), rtol=1e-5,
                                   atol=1e-6)
        assert_params_close(params, ref[1], ref[3])  # [Note: AdamW rounding allowance]
    held = set().union(*(r[1] for r in results))
    assert held == set(ref[1]), "some parameters are held by no rank"
