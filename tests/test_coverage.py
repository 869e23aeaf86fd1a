"""The coverage bench (bench/coverage.py) and its architectures (autoplan/models/architectures.py):
the table it writes, how a failure is named, and the architectures and batches it runs. The
bench itself runs for an hour; these are its pieces, in seconds."""

from __future__ import annotations


import pytest
import torch

from autoplan.models.architectures import (ARCHITECTURES, architecture_config,
                                           build_architecture, example_batch)
from autoplan.runtime import RankError

pytest.importorskip("transformers")



def _bench():
    from _helpers import load_bench

    return load_bench("coverage")


def test_the_issue_s_architectures_are_all_in_the_bench():
    wanted = {"gpt2", "llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma",
              "gemma2", "gemma3_text", "phi3", "falcon", "gpt_neox", "opt", "bloom", "stablelm",
              "olmo2", "starcoder2", "bert", "t5", "vit", "swin", "convnext", "whisper",
              "wav2vec2"}
    assert wanted <= set(ARCHITECTURES), sorted(wanted - set(ARCHITECTURES))
    assert {a.task for a in ARCHITECTURES.values()} == {
        "causal-lm", "masked-lm", "seq2seq-lm", "image-classification", "audio-classification"}
    assert "wav2vec2+layerdrop" in _bench().REFUSED


def test_markdown_names_each_check_and_why_it_failed():
    bench = _bench()
    ok = {"status": "pass", "detail": "", "seconds": 1.0}
    doc = {"steps": 3, "rows": {
        "llama": {"task": "causal-lm", "moe": False,
                  "checks": {"plan tp2": ok, "plan 7B": ok, "train dp2xtp2": ok}},
        "mixtral": {"task": "causal-lm", "moe": True, "checks": {
            "plan tp2": ok, "plan 7B": ok,
            "train dp2xtp2": {"status": "fail", "detail": "ValueError: a | b `c`",
                              "seconds": 2.0}}}}}
    lines = bench.markdown(doc).splitlines()
    assert lines[0] == ("| architecture | task | plan tp2 | plan 7B | train dp2xtp2 | "
                        "train dp2xep2 |")
    assert lines[2] == "| llama | causal-lm | pass | pass | pass | n/a |"
    assert lines[3] == ("| mixtral | causal-lm | pass | pass | fail: ValueError: a \\| b 'c' | "
                        "not run |")
    assert lines[-1] == "5 of 6 checks pass over 2 architectures (3 training steps)."


def test_a_failed_rank_is_named_by_its_own_cause_in_one_line():
    bench = _bench()
    e = RankError(2, "raised ValueError: materialize: 4 FQNs missing\nTraceback ...",
                  {0: "RuntimeError: Connection reset by peer"})
    assert bench._first_line(e) == "RankError: rank 2 raised ValueError: materialize: 4 FQNs missing"
    long = bench._first_line(ValueError("x" * 500))
    assert len(long) == bench.DETAIL_CHARS and long.endswith("...")


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_tiny_config_splits_for_tp2_and_its_batch_fits(name):
    """Every head count and width the tp2 / ep2 runs split is even, the batch's ids are inside
    the vocabulary and its shapes are what the model takes."""
    config = architecture_config(name, "tiny")
    for key in ("num_attention_heads", "num_key_value_heads", "intermediate_size",
                "num_local_experts", "num_experts", "n_routed_experts", "d_ff", "n_inner"):
        value = getattr(config, key, None)  # Swin: one head count per stage
        for v in value if isinstance(value, (list, tuple)) else [value]:
            assert v is None or v % 2 == 0, (key, value)
    batch = example_batch(name, batch=4, seq_len=16)
    if "input_ids" in batch:
        assert 0 <= int(batch["input_ids"].min()) and int(batch["input_ids"].max()) < \
            config.vocab_size
    meta = example_batch(name, "7b", batch=64, seq_len=4096, device="meta")
    assert all(t.is_meta for t in meta.values())
    assert {k: t.dtype for k, t in meta.items()} == {k: t.dtype for k, t in batch.items()}


def test_large_configs_are_7b_class_on_meta():
    for name in ("llama", "mixtral", "vit", "swin", "convnext", "whisper", "wav2vec2"):
        model = build_architecture(name, "7b")
        n = sum(p.numel() for p in model.parameters())
        assert 5e9 < n < 9e9, (name, n)
        assert all(p.is_meta for p in model.parameters())
    assert torch.get_default_device().type == "cpu"


def test_audio_models_take_float_features_and_one_class_per_clip():
    """The Whisper encoder reads (batch, mel bins, 2 x positions) log-mel features, wav2vec2
    seq_len frames' worth of samples; both float32, labels one class per clip."""
    for name, key, shape in (("whisper", "input_features", (4, 8, 32)),
                             ("wav2vec2", "input_values", (4, 16 * 8))):
        batch = example_batch(name, batch=4, seq_len=16)
        assert (tuple(batch[key].shape), batch[key].dtype) == (shape, torch.float32)
        assert tuple(batch["labels"].shape) == (4,)
        out = build_architecture(name, device="cpu")(**batch)
        assert tuple(out.logits.shape) == (4, 10) and out.loss.isfinite()


def test_a_refusal_row_passes_only_on_a_refusal_that_names_its_cause():
    bench = _bench()
    assert bench._architecture("wav2vec2+layerdrop") == "wav2vec2"
    assert bench._build("wav2vec2+layerdrop", "tiny").config.layerdrop == 0.1
    assert bench._build("wav2vec2", "tiny").config.layerdrop == 0.0

    def refused():
        raise ValueError("capture: a Python branch on a random draw (config.layerdrop = 0)")

    def other():
        raise ValueError("something else")

    assert bench._refused(refused, "wav2vec2+layerdrop") == (
        "refused before any rank starts (ValueError): ...capture: a Python branch on a random "
        "draw (config.layerdrop = 0)...")
    with pytest.raises(ValueError, match="something else"):
        bench._refused(other, "wav2vec2+layerdrop")
    with pytest.raises(AssertionError, match="planned, where a refusal naming 'layerdrop'"):
        bench._refused(lambda: "Plan(...)", "wav2vec2+layerdrop")


def test_the_fine_tuning_row_trains_lora_on_a_frozen_base():
    pytest.importorskip("peft")
    bench = _bench()
    assert bench._architecture("llama+lora") == "llama"
    model = bench._build("llama+lora", "tiny")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # every linear layer of the blocks has its adapter, the output head none
    assert sum(".lora_A." in n for n in trainable) == 7 * 2
    assert not any("lm_head" in n for n in trainable)
