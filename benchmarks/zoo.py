"""The model zoo: the random-init models the tests and benchmarks build, in one place; nothing is downloaded.

- :func:`vit`, :func:`llama`, :func:`bert` and :func:`lora`: the models of the tests and benchmarks, tiny by
  default (every size an argument), and :func:`images` / :func:`tokens` for their inputs.
- :data:`FAMILIES`: the families ``tests/test_coverage.py`` checks and ``benchmarks/surgery.py --zoo``
  measures for the README table. Every one is fp32, dropout 0, hidden size 64, two layers (one encoder
  and one decoder layer for encoder-decoders), batch 2, sequence length 16 (images 32x32 in patches of
  8; EVA 28x28 in patches of 14).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

BATCH, SEQ, HIDDEN, VOCAB = 2, 16, 64, 128
LLAMA_LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


TINY_VIT = {"depth": 2, "img_size": 32, "patch_size": 8, "num_classes": 10}
TINY_LLAMA = {
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
}  # fmt: skip


def vit(model_name: str = "vit_tiny_patch16_224", tiny: bool = True, **kwargs: Any) -> nn.Module:
    """A timm ViT, ``tiny``: 2 blocks on 32x32 images in patches of 8, 10 classes (else timm's own sizes);
    ``kwargs`` override."""
    import timm

    return timm.create_model(model_name, pretrained=False, **{**(TINY_VIT if tiny else {}), **kwargs})


def images(batch: int = BATCH, size: int = 32, seed: int | None = None) -> torch.Tensor:
    """A batch of random RGB images (from ``seed``'s own generator when given)."""
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.randn(batch, 3, size, size, generator=generator)


def llama(tiny: bool = True, **config: Any) -> nn.Module:
    """A Hugging Face ``LlamaForCausalLM``, ``tiny``: hidden 64, intermediate 128, 2 layers, 4 heads (2 for keys
    and values), vocabulary 128 (else ``LlamaConfig``'s defaults: LLaMA-7B); ``config`` overrides."""
    import transformers

    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**(TINY_LLAMA if tiny else {}), **config}))


def bert(cls_name: str = "BertForSequenceClassification", **config: Any) -> nn.Module:
    """A tiny Hugging Face BERT model (``cls_name``): hidden 64, intermediate 128, 2 layers, 4 heads, vocabulary
    128, 3 labels, dropout 0; ``config`` overrides any ``BertConfig`` field."""
    import transformers

    defaults = {**_BERTISH, "intermediate_size": 2 * HIDDEN}
    return getattr(transformers, cls_name)(transformers.BertConfig(**{**defaults, **config}))


def hidden_dropout(family: str, p: float) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A tiny ``family`` model ("bert", "gpt2" or "t5"; hidden 64, two layers) with hidden (residual, embedding)
    dropout ``p`` and attention dropout 0, and its input."""
    import transformers

    ids = tokens()
    if family == "bert":
        return bert(hidden_dropout_prob=p), {"input_ids": ids}
    if family == "gpt2":
        config = transformers.GPT2Config(
            vocab_size=VOCAB, n_embd=HIDDEN, n_layer=2, n_head=4, n_positions=64, resid_pdrop=p, embd_pdrop=p,
            attn_pdrop=0.0, bos_token_id=1, eos_token_id=2,
        )  # fmt: skip
        return transformers.GPT2LMHeadModel(config), {"input_ids": ids}
    config = transformers.T5Config(
        vocab_size=VOCAB, d_model=HIDDEN, d_kv=16, d_ff=2 * HIDDEN, num_layers=2, num_heads=4,
        feed_forward_proj="gated-gelu", dropout_rate=p,
    )  # fmt: skip
    model = transformers.T5ForConditionalGeneration(config)
    for module in model.modules():  # T5 drops attention weights at its one rate: hidden dropout alone here
        if isinstance(module, transformers.models.t5.modeling_t5.T5Attention):
            module.dropout = 0.0
    return model, {"input_ids": ids, "decoder_input_ids": ids}


def lora(model: nn.Module, targets: list[str], random_b: bool = False, **config: Any) -> nn.Module:
    """``model`` with peft LoRA adapters on ``targets``: by default r 4, alpha 8, dropout 0 (``config``
    overrides any ``LoraConfig`` field); ``random_b`` draws B at random, so that the adapters change the
    function from the start."""
    import peft

    defaults = {"r": 4, "lora_alpha": 8, "lora_dropout": 0.0}
    model = peft.get_peft_model(model, peft.LoraConfig(target_modules=targets, **{**defaults, **config}))
    if random_b:
        for name, param in model.named_parameters():
            if "lora_B" in name:
                nn.init.normal_(param, std=0.02)
    return model


@dataclass(frozen=True)
class Family:
    """A model family: how to build its tiny model and its example input, and where its hidden states are."""

    name: str
    build: Callable[[], nn.Module]
    example: Callable[[], Any]  # a tensor, or a dict of keyword arguments
    source: str  # "transformers", "timm" or "litgpt"

    def call(self, model: nn.Module, example: Any, hidden_states: bool = False) -> Any:
        """The model's output; with ``hidden_states`` also every hidden state it can return."""
        if self.source == "timm":
            return (
                model.forward_intermediates(example, norm=True, output_fmt="NLC") if hidden_states else model(example)
            )
        if self.source == "litgpt":  # returns the logits alone
            return model(example)
        extra = {"output_hidden_states": True} if hidden_states else {}
        return model(**example, **extra)


def tokens(eos: int | None = None) -> torch.Tensor:
    ids = torch.randint(3, VOCAB, (BATCH, SEQ))
    if eos is not None:  # BART's classification head pools the last <eos> of each row
        ids[:, -1] = eos
    return ids


def _text(cls_name: str, config_name: str, eos: int | None = None, causal: bool = False, **config: Any) -> Family:
    def build() -> nn.Module:
        import transformers

        return getattr(transformers, cls_name)(getattr(transformers, config_name)(**config))

    def example() -> dict[str, torch.Tensor]:
        inputs = {"input_ids": tokens(eos)}
        if cls_name.startswith("T5"):
            inputs["decoder_input_ids"] = tokens()
        if causal:
            inputs["use_cache"] = False
        return inputs

    return Family(cls_name, build, example, "transformers")


def _image(model_name: str, size: int = 32, patch: int = 8) -> Family:
    def build() -> nn.Module:
        import timm

        return timm.create_model(
            model_name, pretrained=False, depth=2, img_size=size, patch_size=patch, embed_dim=HIDDEN, num_heads=2,
            num_classes=5,
        )  # fmt: skip

    return Family(model_name, build, lambda: torch.randn(BATCH, 3, size, size), "timm")


def litgpt_config(name: str, lora: bool = False, **overrides: Any) -> Any:
    """LitGPT's config of ``name`` (``litgpt.Config.from_name``) at the zoo's size: hidden 64 in 4 heads of 16 (as
    many for keys and values), intermediate 128 for gated MLPs, 2 layers, vocabulary 128; with ``lora``,
    ``litgpt.lora.Config`` with adapters of r 4, alpha 8 on every linear layer and the head, dropout 0;
    ``overrides`` win."""
    import litgpt
    import litgpt.lora

    base = litgpt.Config.from_name(name)
    sizes = {
        "n_layer": 2,
        "n_embd": HIDDEN,
        "n_head": 4,
        "n_query_groups": 4,
        "head_size": 16,
        "padded_vocab_size": VOCAB,
    }
    if base.mlp_class_name in ("LLaMAMLP", "GemmaMLP"):
        sizes["intermediate_size"] = 2 * HIDDEN
    if not lora:
        return litgpt.Config.from_name(name, **{**sizes, **overrides})
    adapters = {f"lora_{part}": True for part in ("query", "key", "value", "projection", "mlp", "head")}
    return litgpt.lora.Config.from_name(
        name, **{**sizes, "lora_r": 4, "lora_alpha": 8, "lora_dropout": 0.0, **adapters, **overrides}
    )


def litgpt_model(name: str, lora: bool = False, **overrides: Any) -> nn.Module:
    """A random-init LitGPT ``GPT`` (``litgpt.lora.GPT`` with ``lora``, only the adapters trainable) of
    :func:`litgpt_config`."""
    import litgpt
    import litgpt.lora

    config = litgpt_config(name, lora, **overrides)
    if not lora:
        return litgpt.GPT(config)
    model = litgpt.lora.GPT(config)
    litgpt.lora.mark_only_lora_as_trainable(model)
    return model


LITGPT_TWINS = {  # LitGPT's name -> the Hugging Face config and model classes of the same architecture
    "Llama-2-7b-hf": ("LlamaConfig", "LlamaForCausalLM"),
    "pythia-160m": ("GPTNeoXConfig", "GPTNeoXForCausalLM"),
    "phi-2": ("PhiConfig", "PhiForCausalLM"),
    "Gemma-2b": ("GemmaConfig", "GemmaForCausalLM"),
}


def hf_twin(name: str, lora: bool = False, **overrides: Any) -> nn.Module:
    """The Hugging Face model of LitGPT's ``name`` at the sizes of :func:`litgpt_config` (``overrides`` go to it);
    with ``lora``, peft adapters as LitGPT's (r, alpha, dropout of the config) on every linear layer and the
    head."""
    import transformers

    config = litgpt_config(name, lora, **overrides)
    config_cls, model_cls = LITGPT_TWINS[name]
    sizes = {
        "vocab_size": config.padded_vocab_size, "hidden_size": config.n_embd, "num_hidden_layers": config.n_layer,
        "intermediate_size": config.intermediate_size, "num_attention_heads": config.n_head,
        "num_key_value_heads": config.n_query_groups, "head_dim": config.head_size,
    }  # fmt: skip
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**sizes))
    if not lora:
        return model
    targets = sorted({name.rpartition(".")[2] for name, m in model.named_modules() if isinstance(m, nn.Linear)})
    return globals()["lora"](
        model, targets, r=config.lora_r, lora_alpha=config.lora_alpha, lora_dropout=config.lora_dropout
    )


def _litgpt(name: str) -> Family:
    return Family(f"litgpt {name}", lambda: litgpt_model(name), tokens, "litgpt")


class TitanFeedForward(nn.Module):
    """torchtitan's LLaMA ``FeedForward``: SwiGLU written with functions, ``w2(F.silu(w1(x)) * w3(x))``."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(torch.nn.functional.silu(self.w1(x)) * self.w3(x))


class TitanAttention(nn.Module):
    """torchtitan's LLaMA ``Attention`` without RoPE: ``wq``, ``wk``, ``wv``, ``wo`` around causal SDPA."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, dim = x.shape
        q, k, v = (w(x).view(batch, length, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(batch, length, dim))


class TitanBlock(nn.Module):
    """torchtitan's ``TransformerBlock``: pre-norm ``nn.RMSNorm``, attention and feed-forward."""

    def __init__(self, dim: int, heads: int, hidden_dim: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim, eps=1e-5), nn.RMSNorm(dim, eps=1e-5)
        self.attention, self.feed_forward = TitanAttention(dim, heads), TitanFeedForward(dim, hidden_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class TitanTransformer(nn.Module):
    """A torchtitan-style LLaMA, hand-written as research code is: the zoo's LLaMA sizes (:data:`TINY_LLAMA`,
    but as many key/value heads as heads) unless given."""

    def __init__(self, layers: int = 2, dim: int = HIDDEN, heads: int = 4, hidden_dim: int = 2 * HIDDEN) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, dim)
        self.layers = nn.ModuleList(TitanBlock(dim, heads, hidden_dim) for _ in range(layers))
        self.norm, self.output = nn.RMSNorm(dim, eps=1e-5), nn.Linear(dim, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


_BERTISH = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "intermediate_size": 4 * HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 64,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
    "num_labels": 3,
}
_DECODER = {**TINY_LLAMA, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}

FAMILIES: dict[str, Family] = {
    family.name: family
    for family in (
        _text("BertForSequenceClassification", "BertConfig", **_BERTISH),
        _text("RobertaForSequenceClassification", "RobertaConfig", pad_token_id=1, **_BERTISH),
        _text("ElectraForSequenceClassification", "ElectraConfig", embedding_size=32, **_BERTISH),
        _text("DebertaV2ForSequenceClassification", "DebertaV2Config", pooler_dropout=0.0, **_BERTISH),
        _text(
            "DistilBertForSequenceClassification",
            "DistilBertConfig",
            vocab_size=VOCAB,
            dim=HIDDEN,
            hidden_dim=4 * HIDDEN,
            n_layers=2,
            n_heads=4,
            max_position_embeddings=64,
            dropout=0.0,
            attention_dropout=0.0,
            seq_classif_dropout=0.0,
            num_labels=3,
        ),
        _text(
            "BartForSequenceClassification",
            "BartConfig",
            eos=2,
            vocab_size=VOCAB,
            d_model=HIDDEN,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=4,
            decoder_attention_heads=4,
            encoder_ffn_dim=4 * HIDDEN,
            decoder_ffn_dim=4 * HIDDEN,
            dropout=0.0,
            attention_dropout=0.0,
            activation_dropout=0.0,
            classifier_dropout=0.0,
            max_position_embeddings=64,
            num_labels=3,
        ),
        _text(
            "T5ForConditionalGeneration",
            "T5Config",
            vocab_size=VOCAB,
            d_model=HIDDEN,
            d_kv=16,
            d_ff=2 * HIDDEN,
            num_layers=1,
            num_decoder_layers=1,
            num_heads=4,
            feed_forward_proj="gated-gelu",
            dropout_rate=0.0,
        ),
        _text(
            "GPT2LMHeadModel",
            "GPT2Config",
            causal=True,
            vocab_size=VOCAB,
            n_embd=HIDDEN,
            n_layer=2,
            n_head=4,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        _text(
            "FalconForCausalLM",
            "FalconConfig",
            causal=True,
            vocab_size=VOCAB,
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=4,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            bos_token_id=1,
            eos_token_id=2,
        ),
        _text("LlamaForCausalLM", "LlamaConfig", causal=True, **_DECODER),
        _text("Phi3ForCausalLM", "Phi3Config", causal=True, **_DECODER),
        _text("GemmaForCausalLM", "GemmaConfig", causal=True, head_dim=16, **_DECODER),
        _text("Gemma2ForCausalLM", "Gemma2Config", causal=True, head_dim=16, **_DECODER),
        _litgpt("Llama-2-7b-hf"),
        _litgpt("pythia-160m"),
        _litgpt("phi-2"),
        _litgpt("Gemma-2b"),
        _image("vit_small_patch16_224"),
        _image("beit_base_patch16_224"),
        _image("eva02_tiny_patch14_224", size=28, patch=14),
    )
}
