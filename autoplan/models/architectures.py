"""Hugging Face architectures at two sizes: a tiny one that trains on CPU ranks in seconds and a
7B-class one that is only ever built on the meta device (planning).

    model = build_architecture("qwen3", "tiny", device="cpu")   # random weights, seeded by torch
    model = build_architecture("qwen3", "7b")                    # on meta: nothing allocated
    batch = example_batch("qwen3", "tiny", batch=4, seq_len=16)  # {"input_ids", "labels"}

`ARCHITECTURES` names each architecture by its transformers `model_type` and says which head it
is built with (`task`): causal LM (labels: the next tokens), masked LM (labels: -100 except at
the masked positions), seq2seq LM (T5: encoder ids, decoder ids, labels), image classification
(ViT, Swin, ConvNeXt: pixel values, one class per image) or audio classification (the Whisper
encoder on log-mel features, wav2vec2 on the waveform: float features, one class per clip).
Only the first takes autoplan's token batch `(input_ids, labels)`; the others need a batch of
named inputs (`example_batch` gives one).

Sizes. The tiny configs keep every dimension that must divide a tp of 2 (heads, key/value heads,
FFN width, experts) even, with the model's own ratios where it has a fixed one. The 7B class
follows Llama-2-7B (Touvron et al. 2023, Table 1 / the released config.json): hidden 4096, 32
layers, 32 heads of 128, FFN 11008, vocabulary 32000, here with 8 key/value heads where the
architecture has grouped-query attention and positions enough for 4096 tokens. Mixture-of-
experts models keep 8 experts, 2 per token, with an expert FFN of 1792 (8 x 3 x 4096 x 1792 x 32
= 5.6e9 expert weights; ~7e9 with attention and embeddings), so that they too are 7B-class in
total parameters. ViT at 7B takes 1024 x 1024 images in 16 x 16 patches: 4096 patches, the
same tokens per sample as the language models. The vision and audio models whose configs do
not follow the shared keys (`shared=False`) give their own: Swin at 7B is Swin-B's layout
(Liu et al. 2021, Table 1: depths 2/2/18/2, heads of 32) widened to 832 and deepened to 42
blocks in its third stage (6.9B, 384 x 384 images, windows of 12); ConvNeXt at 7B is
ConvNeXt-XXL's stage widths doubled (768/1536/3072/6144) with 75 blocks in the third stage
(6.9B, 512 x 512 images); the Whisper encoder at 7B has Llama-2-7B's width and depth with
128 mel bins over 3,000 frames (Whisper large-v3's input); wav2vec2 at 7B the same width and
depth over 4,096 frames of its 320-sample stride (82 s of 16 kHz audio).

Nothing is downloaded: every model is built from its config with random weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math

import torch
from torch import nn

__all__ = ["Architecture", "ARCHITECTURES", "TASKS", "SIZES", "ADAPTERS", "architecture_config",
           "build_architecture", "example_batch", "architecture_factory", "adapter_config",
           "build_fine_tuning", "fine_tuning_factory"]

TASKS = ("causal-lm", "masked-lm", "seq2seq-lm", "image-classification", "audio-classification")
SIZES = ("tiny", "7b")

# Shared by (almost) every architecture; `Architecture.tiny` / `.large` add or replace keys.
_TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, vocab_size=96,
             max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_LARGE = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, vocab_size=32000,
              max_position_embeddings=4096, bos_token_id=0, eos_token_id=0, pad_token_id=0)
_GQA_TINY = dict(num_key_value_heads=2, intermediate_size=64, head_dim=8)
_GQA_LARGE = dict(num_key_value_heads=8, intermediate_size=11008, head_dim=128)
_MOE_TINY = dict(num_experts_per_tok=2, intermediate_size=64)
_MOE_LARGE = dict(num_experts_per_tok=2)


@dataclasses.dataclass(frozen=True)
class Architecture:
    """One transformers architecture and how to build it at each size."""

    model_type: str
    """transformers' `model_type` (the key of `transformers.CONFIG_MAPPING`)."""
    task: str
    """One of TASKS: which head the model is built with and what its batch holds."""
    tiny: dict
    """Config keys on top of the shared tiny ones (hidden 32, 2 layers, 4 heads, vocab 96)."""
    large: dict
    """Config keys on top of the shared 7B-class ones (hidden 4096, 32 layers, 32 heads)."""
    moe: bool = False
    """A mixture-of-experts model (expert parallelism is its parallel axis)."""
    shared: bool = True
    """The shared keys apply (False: `tiny` and `large` are the whole configs, for models
    whose configs name their sizes otherwise: stage widths, mel bins, convolutions)."""

    def config_dict(self, size: str) -> dict:
        if size not in SIZES:
            raise ValueError(f"size {size!r}: expected one of {SIZES}")
        shared = {} if not self.shared else _TINY if size == "tiny" else _LARGE
        return {**shared, **(self.tiny if size == "tiny" else self.large)}


ARCHITECTURES: dict[str, Architecture] = {a.model_type: a for a in [
    Architecture("gpt2", "causal-lm", dict(n_inner=128, n_positions=64),
                 dict(n_inner=16384, n_positions=4096)),
    Architecture("llama", "causal-lm", _GQA_TINY, _GQA_LARGE),
    Architecture("mistral", "causal-lm", _GQA_TINY, _GQA_LARGE),
    Architecture("mixtral", "causal-lm", dict(_GQA_TINY, num_local_experts=4, **_MOE_TINY),
                 dict(_GQA_LARGE, num_local_experts=8, intermediate_size=1792, **_MOE_LARGE),
                 moe=True),
    Architecture("qwen2", "causal-lm", _GQA_TINY, _GQA_LARGE),
    Architecture("qwen3", "causal-lm", _GQA_TINY, _GQA_LARGE),
    Architecture("qwen3_moe", "causal-lm",
                 dict(_GQA_TINY, num_experts=4, moe_intermediate_size=32, **_MOE_TINY),
                 dict(_GQA_LARGE, num_experts=8, moe_intermediate_size=1792, **_MOE_LARGE),
                 moe=True),
    Architecture("gemma", "causal-lm", _GQA_TINY, _GQA_LARGE),
    Architecture("gemma2", "causal-lm", dict(_GQA_TINY, sliding_window=8),
                 dict(_GQA_LARGE, sliding_window=4096)),
    Architecture("gemma3_text", "causal-lm", dict(_GQA_TINY, sliding_window=8),
                 dict(_GQA_LARGE, sliding_window=1024)),
    Architecture("phi3", "causal-lm", dict(_GQA_TINY, pad_token_id=0),
                 dict(_GQA_LARGE, pad_token_id=0)),
    Architecture("phi", "causal-lm", dict(intermediate_size=64), dict(intermediate_size=16384)),
    Architecture("falcon", "causal-lm", dict(num_kv_heads=2, new_decoder_architecture=True),
                 dict(num_kv_heads=8, new_decoder_architecture=True)),
    Architecture("gpt_neox", "causal-lm", dict(intermediate_size=128),
                 dict(intermediate_size=16384)),
    Architecture("gptj", "causal-lm", dict(n_inner=128, rotary_dim=4, n_positions=64),
                 dict(n_inner=16384, rotary_dim=64, n_positions=4096)),
    Architecture("opt", "causal-lm", dict(ffn_dim=128, word_embed_proj_dim=32),
                 dict(ffn_dim=16384, word_embed_proj_dim=4096)),
    Architecture("bloom", "causal-lm", {}, {}),
    Architecture("stablelm", "causal-lm", dict(num_key_value_heads=2, intermediate_size=64),
                 dict(num_key_value_heads=8, intermediate_size=11008)),
    Architecture("olmo2", "causal-lm", _GQA_TINY, _GQA_LARGE),
    Architecture("starcoder2", "causal-lm", dict(num_key_value_heads=2, intermediate_size=128),
                 dict(num_key_value_heads=8, intermediate_size=16384)),
    Architecture("granite", "causal-lm", _GQA_TINY, _GQA_LARGE),
    Architecture("deepseek_v3", "causal-lm",
                 dict(num_key_value_heads=4, intermediate_size=64, q_lora_rank=16,
                      kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
                      head_dim=4, n_routed_experts=4, n_shared_experts=1,
                      moe_intermediate_size=32, first_k_dense_replace=1, n_group=2,
                      topk_group=1, num_experts_per_tok=2),
                 dict(num_key_value_heads=32, intermediate_size=11008, q_lora_rank=1536,
                      kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                      v_head_dim=128, head_dim=64, n_routed_experts=8, n_shared_experts=1,
                      moe_intermediate_size=1792, first_k_dense_replace=1, n_group=2,
                      topk_group=1, num_experts_per_tok=2),
                 moe=True),
    Architecture("bert", "masked-lm", dict(intermediate_size=128),
                 dict(intermediate_size=16384)),
    Architecture("t5", "seq2seq-lm", dict(d_kv=8, d_ff=64, decoder_start_token_id=0),
                 dict(d_kv=128, d_ff=11008, decoder_start_token_id=0)),
    Architecture("vit", "image-classification",
                 dict(intermediate_size=128, image_size=16, patch_size=4, num_labels=10),
                 dict(intermediate_size=16384, image_size=1024, patch_size=16, num_labels=1000)),
    # stochastic depth at Swin's default rate (0.1): a draw per sample in training
    Architecture("swin", "image-classification",
                 dict(embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=2,
                      image_size=16, patch_size=2, mlp_ratio=2.0, num_labels=10),
                 dict(embed_dim=832, depths=[2, 2, 42, 2], num_heads=[26, 52, 104, 208],
                      window_size=12, image_size=384, patch_size=4, num_labels=1000),
                 shared=False),
    Architecture("convnext", "image-classification",
                 dict(num_stages=2, hidden_sizes=[16, 32], depths=[1, 1], image_size=16,
                      num_labels=10),
                 dict(hidden_sizes=[768, 1536, 3072, 6144], depths=[3, 3, 75, 3],
                      image_size=512, num_labels=1000),
                 shared=False),
    Architecture("whisper", "audio-classification",
                 dict(d_model=32, encoder_layers=2, encoder_attention_heads=4,
                      encoder_ffn_dim=64, decoder_layers=1, decoder_attention_heads=4,
                      decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
                      vocab_size=96, pad_token_id=0, bos_token_id=0, eos_token_id=0,
                      decoder_start_token_id=0, num_labels=10),
                 dict(d_model=4096, encoder_layers=32, encoder_attention_heads=32,
                      encoder_ffn_dim=16384, decoder_layers=1, num_mel_bins=128,
                      max_source_positions=1500, num_labels=1000),
                 shared=False),
    # LayerDrop off (its default 0.1 skips whole layers by a Python draw: refused, see
    # bench/coverage.py) and no SpecAugment masking (numpy's generator, not torch's)
    Architecture("wav2vec2", "audio-classification",
                 dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                      intermediate_size=64, conv_dim=(16, 16), conv_stride=(4, 2),
                      conv_kernel=(8, 4), num_conv_pos_embeddings=4,
                      num_conv_pos_embedding_groups=2, layerdrop=0.0, mask_time_prob=0.0,
                      vocab_size=96, num_labels=10),
                 dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                      intermediate_size=16384, layerdrop=0.0, mask_time_prob=0.0,
                      num_labels=1000),
                 shared=False),
]}


def _architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {name!r}; known: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]


def architecture_config(name: str, size: str = "tiny", **overrides):
    """The transformers config (a PretrainedConfig) of architecture `name` at `size`, with
    `overrides` (config keys) on top.

    Raises ValueError for an unknown name or size."""
    from transformers import CONFIG_MAPPING

    arch = _architecture(name)
    return CONFIG_MAPPING[arch.model_type](**{**arch.config_dict(size), **overrides})


def _model_class(task: str):
    import transformers

    return {"causal-lm": transformers.AutoModelForCausalLM,
            "masked-lm": transformers.AutoModelForMaskedLM,
            "seq2seq-lm": transformers.AutoModelForSeq2SeqLM,
            "image-classification": transformers.AutoModelForImageClassification,
            "audio-classification": transformers.AutoModelForAudioClassification}[task]


def build_architecture(name: str, size: str = "tiny", *,
                       device: str | torch.device | None = "meta",
                       dtype: torch.dtype | None = None, **overrides) -> nn.Module:
    """Architecture `name` at `size` with random weights (torch's generator: seed it first for
    reproducible weights), on `device` ("meta": nothing allocated; None: torch's default
    device, which `@autoparallel` sets to meta while it records a factory), parameters in
    `dtype` (default float32); `overrides`: config keys (e.g. `layerdrop=0.1`).

    Raises ValueError for an unknown name or size; transformers' own errors for a config it
    refuses."""
    config = architecture_config(name, size, **overrides)
    # sdpa: one fused attention op per layer, as autoplan.models builds its presets; eager for
    # an architecture whose attention has no sdpa path in transformers (it refuses sdpa).
    with torch.device(device) if device is not None else contextlib.nullcontext():
        try:
            model = _model_class(_architecture(name).task).from_config(config,
                                                                     attn_implementation="sdpa")
        except ValueError as e:
            if "attention implementation" not in str(e):
                raise
            model = _model_class(_architecture(name).task).from_config(
                config, attn_implementation="eager")
    return model if dtype is None else model.to(dtype)


def architecture_factory(name: str, size: str = "tiny", **overrides):
    """A picklable factory (for gloo ranks and autoplan.testing) building architecture `name`
    (config `overrides` on top) on torch's default device with torch's generator: seed it
    before the call. Called, it builds on the CPU; decorated by `@autoparallel`, its
    construction is recorded on meta and each rank's replay on its shards gives the weights a
    plain call would."""
    _architecture(name)
    return functools.partial(build_architecture, name, size, device=None, **overrides)


ADAPTERS = ("lora",)
"""PEFT adapters a fine-tuning model is built with (`adapter_config`)."""


def adapter_config(adapter: str):
    """The PEFT config of `adapter`: "lora" is LoRA of rank 8 (alpha 16) on every linear layer
    but the output head (PEFT's "all-linear"), as QLoRA (Dettmers et al. 2023, section 4)
    fine-tunes. Raises ValueError for another name."""
    if adapter not in ADAPTERS:
        raise ValueError(f"unknown adapter {adapter!r}; known: {', '.join(ADAPTERS)}")
    from peft import LoraConfig

    return LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")


def build_fine_tuning(name: str, adapter: str, size: str = "tiny", *,
                      device: str | torch.device | None = "meta") -> nn.Module:
    """Architecture `name` at `size` (`build_architecture`) wrapped in PEFT's `adapter`
    (`get_peft_model`): the base frozen, the adapters trainable, initialised by PEFT."""
    from peft import get_peft_model

    return get_peft_model(build_architecture(name, size, device=device),
                          adapter_config(adapter))


def fine_tuning_factory(name: str, adapter: str, size: str = "tiny"):
    """A picklable factory of `build_fine_tuning` on torch's default device, as
    `architecture_factory` is for the architecture alone."""
    _architecture(name)
    adapter_config(adapter)
    return functools.partial(build_fine_tuning, name, adapter, size, device=None)


def _batch_shapes(task: str, config, batch: int, seq_len: int) -> dict[str, tuple]:
    if task == "image-classification":
        side = config.image_size
        return {"pixel_values": (batch, config.num_channels, side, side), "labels": (batch,)}
    if task == "audio-classification":
        return {_audio_input(config): (batch, *_audio_shape(config, seq_len)), "labels": (batch,)}
    names = ["input_ids", "labels"] + (["decoder_input_ids"] if task == "seq2seq-lm" else [])
    return {k: (batch, seq_len) for k in names}


def _audio_input(config) -> str:
    """The float input of an audio model: log-mel features (Whisper) or samples."""
    return "input_features" if hasattr(config, "num_mel_bins") else "input_values"


def _audio_shape(config, seq_len: int) -> tuple[int, ...]:
    """A sample's feature shape: Whisper's encoder takes exactly 2 max_source_positions mel
    frames; wav2vec2 seq_len frames' worth of samples (its convolutions' strides)."""
    if hasattr(config, "num_mel_bins"):
        return (config.num_mel_bins, 2 * config.max_source_positions)
    return (seq_len * math.prod(config.conv_stride),)


def example_batch(name: str, size: str = "tiny", *, batch: int, seq_len: int,
                  seed: int = 1, device: str | torch.device = "cpu") -> dict[str, torch.Tensor]:
    """A seeded random batch for architecture `name` (on `device`; on "meta" zeros of the same
    shapes and dtypes, for planning without allocating):

    - causal-lm: input_ids (batch, seq_len) int64, labels (batch, seq_len) the next tokens;
    - masked-lm: input_ids with every 4th position replaced by token 1 (the mask), labels
      (batch, seq_len): the original token there, -100 elsewhere;
    - seq2seq-lm: input_ids (batch, seq_len), decoder_input_ids (batch, seq_len) (the labels
      shifted right behind the start token), labels (batch, seq_len);
    - image-classification: pixel_values (batch, channels, image_size, image_size) float32 in
      [-1, 1), labels (batch,) class ids;
    - audio-classification: float32 standard-normal features -- input_features (batch,
      num_mel_bins, 2 max_source_positions) for Whisper's encoder, input_values (batch,
      seq_len x the feature encoder's stride) waveform samples for wav2vec2 (about seq_len
      frames) -- and labels (batch,) class ids.
    """
    arch = _architecture(name)
    config = architecture_config(name, size)
    if torch.device(device).type == "meta":  # shapes only: a 7B-class batch allocates nothing
        real = example_batch(name, "tiny", batch=1, seq_len=1, seed=seed)
        shapes = _batch_shapes(arch.task, config, batch, seq_len)
        return {k: torch.zeros(shapes[k], dtype=real[k].dtype, device="meta") for k in real}
    g = torch.Generator().manual_seed(seed)
    if arch.task == "image-classification":
        side = config.image_size
        out = {"pixel_values": torch.rand(batch, config.num_channels, side, side, generator=g)
               * 2 - 1,
               "labels": torch.randint(0, config.num_labels, (batch,), generator=g)}
    elif arch.task == "audio-classification":
        out = {_audio_input(config): torch.randn(batch, *_audio_shape(config, seq_len),
                                                 generator=g),
               "labels": torch.randint(0, config.num_labels, (batch,), generator=g)}
    else:
        tokens = torch.randint(2, config.vocab_size, (batch, seq_len + 1), generator=g)
        if arch.task == "causal-lm":
            out = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
        elif arch.task == "masked-lm":
            ids, labels = tokens[:, :-1].clone(), torch.full((batch, seq_len), -100)
            labels[:, ::4] = ids[:, ::4]
            ids[:, ::4] = 1
            out = {"input_ids": ids, "labels": labels}
        else:
            labels = tokens[:, 1:]
            start = torch.full((batch, 1), config.decoder_start_token_id)
            out = {"input_ids": tokens[:, :-1], "labels": labels,
                   "decoder_input_ids": torch.cat([start, labels[:, :-1]], dim=1)}
    return {k: v.contiguous().to(device) for k, v in out.items()}
