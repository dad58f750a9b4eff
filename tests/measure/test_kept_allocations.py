"""KeptAllocations counts what a forward leaves alive, whoever holds it; with it, PyTorch's
own selective checkpointing of transformers' Llama layer, under torchtitan's per-operation
policy, keeps exactly the bytes parlib.cost.memory predicts for recompute="op"."""

import textwrap

import pytest
import torch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

from parlib.cost.memory import (
    activation_bytes_per_layer,
    logits_bytes,
    loss_peak_bytes,
)
from parlib.measure import KeptAllocations


def test_counts_what_is_made_and_kept_only():
    weight = torch.randn(64, 32)
    x = torch.randn(8, 64)
    with KeptAllocations() as kept:
        view = weight.t()                # a view of an argument: nothing allocated
        tmp = x * 2                      # made, then freed below
        out = torch.relu(x @ weight)     # x @ weight is freed once relu has read it
        del tmp
    assert view.untyped_storage().data_ptr() == weight.untyped_storage().data_ptr()
    assert kept.nbytes == out.numel() * 4 == 8 * 32 * 4


def _llama_layer(h=64, heads=4, kv_heads=2, ffn=160, s=48, b=2):
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=h, intermediate_size=ffn, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, num_hidden_layers=1,
                      max_position_embeddings=s)
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0)
    x = torch.randn(b, s, h, requires_grad=True)
    rope = LlamaRotaryEmbedding(cfg)(x, torch.arange(s).unsqueeze(0).expand(b, s))

    def run(inp):
        out = layer(inp, position_embeddings=rope, attention_mask=None, is_causal=True)
        return out[0] if isinstance(out, tuple) else out

    return run, x


_ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
              torch.ops.aten._scaled_dot_product_flash_attention.default,
              torch.ops.aten._scaled_dot_product_efficient_attention.default}


def _policy(every_other: bool = True):
    """torchtitan's per-operation policy: keep attention's outputs and the matmuls' except
    every second one, counted in forward order; rerun the rest."""
    def context():
        count = {"mm": 0}

        def decide(ctx, func, *args, **kwargs):
            if func == torch.ops.aten.mm.default:
                count["mm"] += 1
                keep = count["mm"] % 2 == 1 or not every_other
                return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
            return (CheckpointPolicy.MUST_SAVE if func in _ATTENTION
                    else CheckpointPolicy.PREFER_RECOMPUTE)
        return create_selective_checkpoint_contexts(decide)
    return context


def _predicted(recompute, h=64, heads=4, kv_heads=2, ffn=160, s=48, b=2):
    return activation_bytes_per_layer(s, b, h, heads, recompute=recompute, dtype_bytes=4,
                                      ffn_dim=ffn, kv_dim=h // heads * kv_heads,
                                      gated_mlp=True, dropout=False)


def test_torchtitans_policy_keeps_what_the_model_counts():
    run, x = _llama_layer()
    with KeptAllocations() as kept:
        out = checkpoint(run, x, use_reentrant=False, context_fn=_policy())
    # the layer's output stands for its input (the same size), which the previous layer made
    assert kept.nbytes == _predicted("op") == 173_568
    out.sum().backward()  # the kept tensors serve a real backward
    assert x.grad is not None and torch.isfinite(x.grad).all()
    # full recomputation keeps the layer's input alone
    run, x = _llama_layer()
    with KeptAllocations() as kept:
        out = checkpoint(run, x, use_reentrant=False)
    assert kept.nbytes == _predicted("full") == 2 * 48 * 64 * 4
    # a policy that keeps every matmul's output keeps more than the count says
    run, x = _llama_layer()
    with KeptAllocations() as kept:
        out = checkpoint(run, x, use_reentrant=False, context_fn=_policy(every_other=False))
    assert kept.nbytes > _predicted("op")


def test_uneven_sizes_and_no_grouped_kv():
    # 5 heads of 12, no grouped KV, an FFN width that is no multiple of h, batch 3
    sizes = dict(h=60, heads=5, kv_heads=5, ffn=100, s=20, b=3)
    run, x = _llama_layer(**sizes)
    with KeptAllocations() as kept:
        out = checkpoint(run, x, use_reentrant=False, context_fn=_policy())
    assert kept.nbytes == _predicted("op", **sizes)
    assert out.shape == (3, 20, 60)  # what is kept lives as long as the output does


def test_the_docstring_example_runs_as_written(capsys):
    doc = KeptAllocations.__doc__
    example = textwrap.dedent(doc.split("example::")[1])
    namespace = {}
    exec(example, namespace)  # noqa: S102 - our own docstring
    assert namespace["kept"].nbytes == 1024 == namespace["out"].numel() * 4
    assert namespace["kept"].peak == 2048
    assert capsys.readouterr().out.strip() == "1024 2048"


def test_an_unfused_cross_entropy_peaks_at_what_the_model_counts():
    tokens, vocab, h = 256, 1000, 32
    hidden = torch.randn(tokens, h, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(vocab, h, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,))
    with KeptAllocations() as forward:
        logits = hidden @ weight.t()
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
    # the forward leaves the bf16 logits and the fp32 log-probabilities: logits_bytes
    # (and two fp32 scalars: the loss and NLL's total weight)
    assert forward.nbytes - 8 == logits_bytes(tokens, 1, vocab) == tokens * vocab * 6
    hidden.grad = weight.grad = None
    with KeptAllocations() as step:
        logits = hidden @ weight.t()
        loss = torch.nn.functional.cross_entropy(logits.float(), labels)
        del logits  # nothing needs them now; a training loop holds no reference either
        loss.backward()
    # the backward holds the saved log-probabilities, their gradient and the fp32 logits'
    # gradient at once: 12 bytes a logit, twice what the forward leaves, which is what the
    # model counts for loss="unfused"
    assert step.peak == pytest.approx(loss_peak_bytes(tokens, 1, vocab), rel=0.01)
    assert loss_peak_bytes(tokens, 1, vocab, loss="unfused") == 12 * tokens * vocab
    assert step.peak > 1.9 * logits_bytes(tokens, 1, vocab)
