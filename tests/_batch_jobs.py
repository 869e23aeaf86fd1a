"""Jobs for batches of any form (tests/test_any_batch.py): tiny Hugging Face models of other
kinds than a causal LM on token ids -- a padded causal LM given a dict with an attention mask
and labels (its own `.loss`), an image classifier (ViT, `pixel_values`), a seq2seq model (T5) --
and a user's `loss_fn(output, batch)`; each with its one-process reference.

The reference computes what the plan computes: the global batch cut into dp x m consecutive
microbatches, the loss their mean (each microbatch's own mean loss, as the model returns it),
AdamW.
"""

from __future__ import annotations

import functools

import torch

from _jobs import adamw

SAMPLES = 4


def _model(kind: str):
    import transformers as tf

    torch.manual_seed(0)
    if kind == "llama":
        config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, max_position_embeddings=64)
        return tf.LlamaForCausalLM._from_config(config, attn_implementation="sdpa")
    if kind == "vit":
        config = tf.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                              num_hidden_layers=2, num_attention_heads=4,
                              intermediate_size=64, num_labels=5)
        return tf.ViTForImageClassification._from_config(config, attn_implementation="sdpa")
    if kind == "t5":
        config = tf.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                             num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                             pad_token_id=0)
        return tf.T5ForConditionalGeneration._from_config(config)
    raise ValueError(kind)


def model(kind: str):
    """A factory: the tiny model of `kind` with seeded weights."""
    return functools.partial(_model, kind)


def batches(kind: str, steps: int, samples: int = SAMPLES, seq: int = 16) -> list[dict]:
    """Seeded batches of the model's kind. llama: sample i padded at its end by i tokens
    (attention_mask 0, labels -100); vit: images and class labels; t5: source ids with a
    padding mask, target ids as labels."""
    g = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        if kind == "vit":
            out.append({"pixel_values": torch.randn(samples, 3, 16, 16, generator=g),
                        "labels": torch.randint(0, 5, (samples,), generator=g)})
            continue
        ids = torch.randint(1, 64, (samples, seq), generator=g)
        mask = torch.ones(samples, seq, dtype=torch.long)
        for i in range(samples):
            if i:
                mask[i, -i:] = 0
        if kind == "llama":
            labels = ids.masked_fill(mask == 0, -100)
            out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
        else:
            labels = torch.randint(1, 64, (samples, seq // 2), generator=g)
            out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def _chunks(batch: dict, n: int) -> list[dict]:
    return [{k: v.chunk(n)[j] for k, v in batch.items()} for j in range(n)]


def user_loss(output, batch):
    """A user's loss: the logits' cross-entropy against the batch's labels, shifted by one as
    for a causal LM, with label smoothing 0.1 (a mean per microbatch)."""
    logits = output.logits[:, :-1].float()
    labels = batch["labels"][:, 1:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             labels.reshape(-1), label_smoothing=0.1)


def reference(kind: str, steps: int, parts: int, with_user_loss: bool = False):
    """One process: (losses, parameters, [Note: AdamW rounding allowance]) of `steps` steps,
    each the mean loss over the batch cut into `parts` (dp x m) microbatches."""
    from autoplan.testing import adamw_allowance, record_gradients

    net = _model(kind)
    opt = adamw(net.parameters())
    losses, grads = [], {}
    for batch in batches(kind, steps):
        opt.zero_grad()
        total = 0.0
        for mb in _chunks(batch, parts):
            out = net(**mb)
            loss = (user_loss(out, mb) if with_user_loss else out.loss) / parts
            loss.backward()
            total += loss.item()
        record_gradients(net, grads)
        opt.step()
        losses.append(total)
    return (losses, {k: p.detach().clone() for k, p in net.named_parameters()},
            adamw_allowance(grads))


def train(kind: str, steps: int, overrides: dict, with_user_loss: bool = False,
          declared: bool = False):
    """On every rank: (losses, full parameters). `declared`: the batch given as
    example_batch= (on meta) rather than taken from the first step."""
    from autoplan import autoparallel

    data = batches(kind, steps)
    example = {k: torch.empty_like(v, device="meta") for k, v in data[0].items()} \
        if declared else None
    ap = autoparallel(_model(kind), global_batch=SAMPLES, optimizer=adamw,
                      loss_fn=user_loss if with_user_loss else None, example_batch=example,
                      **overrides)
    losses = [ap.step(batch) for batch in data]
    return losses, ap.state_dict()


def evaluate(kind: str, overrides: dict):
    """On every rank: eval_step's (loss, logits) of the first batch, before any training."""
    from autoplan import autoparallel

    batch = batches(kind, 1)[0]
    ap = autoparallel(_model(kind), global_batch=SAMPLES, optimizer=adamw, **overrides)
    loss, out = ap.eval_step(batch, return_outputs=True)
    return loss, out.logits


def reference_eval(kind: str, parts: int):
    """One process, model.eval(): the mean of the `parts` microbatches' losses, and the logits."""
    net = _model(kind).eval()
    batch = batches(kind, 1)[0]
    with torch.no_grad():
        outs = [net(**mb) for mb in _chunks(batch, parts)]
    return sum(o.loss.item() for o in outs) / parts, torch.cat([o.logits for o in outs])
