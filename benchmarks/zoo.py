"""The model zoo: the random-init models the tests and benchmarks build, in one place; nothing is downloaded.

- :func:`vit`, :func:`llama`, :func:`bert` and :func:`lora`: the models of the tests and benchmarks, tiny by
  default (every size an argument), and :func:`images` / :func:`tokens` for their inputs.
- :data:`FAMILIES`: the families ``tests/test_coverage.py`` checks and ``benchmarks/surgery.py --zoo``
  measures for the table in docs/how-it-works.md. Every one is fp32, dropout 0, hidden size 64, two layers (one encoder
  and one decoder layer for encoder-decoders), batch 2, sequence length 16 (images 32x32 in patches of
  8; EVA 28x28 in patches of 14).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
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


# --- the breadth of the two libraries: every Hugging Face model type and one model per timm module, tiny ---------

TASKS = ("causal-lm", "sequence-classification", "image-classification")
_TINY_HF = {
    "vocab_size": 256, "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN, "embed_dim": HIDDEN,
    "intermediate_size": 2 * HIDDEN, "ffn_dim": 2 * HIDDEN, "encoder_ffn_dim": 2 * HIDDEN,
    "decoder_ffn_dim": 2 * HIDDEN, "d_ff": 2 * HIDDEN, "n_inner": 2 * HIDDEN, "moe_intermediate_size": HIDDEN,
    "shared_expert_intermediate_size": HIDDEN, "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2,
    "encoder_layers": 1, "decoder_layers": 1, "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "d_kv": 16,
    "max_position_embeddings": 128, "n_positions": 128, "image_size": 32, "patch_size": 8, "num_experts": 4,
    "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "num_labels": 2,
    "mamba_n_heads": 8, "mamba_num_heads": 8, "n_mamba_heads": 8, "mamba_d_head": 16, "mamba_head_dim": 16,
    "mamba_headdim": 16, "mamba_d_state": 16, "ssm_state_size": 16, "mamba_chunk_size": 16, "n_groups": 1,
    "attention_head_dim": 16, "num_query_groups": 4,
}  # fmt: skip


def hf_model_types(task: str) -> dict[str, str]:
    """Every Hugging Face model type with a ``task`` class (one of :data:`TASKS`): model type -> class name."""
    from transformers.models.auto import modeling_auto

    mapping = {
        "causal-lm": modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
        "sequence-classification": modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
        "image-classification": modeling_auto.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES,
    }[task]
    return {kind: name if isinstance(name, str) else name[0] for kind, name in mapping.items()}


def tiny_hf(model_type: str, task: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The ``task`` model of ``model_type`` built from its own config class shrunk to :data:`_TINY_HF` (the fields
    it has; every dropout 0), random init, fp32, and its input with labels; raises where it does not build so."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    torch.manual_seed(0)
    config = CONFIG_MAPPING[model_type]()
    for key, value in _TINY_HF.items():
        if isinstance(getattr(config, key, None), int) and not isinstance(getattr(config, key), bool):
            try:
                setattr(config, key, value)
            except (ValueError, AttributeError, NotImplementedError):  # a field its config refuses to set so
                pass
    for key in ("num_encoder_layers", "num_decoder_layers"):  # ProphetNet's, set only so
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, 1)
    if isinstance(getattr(config, "attn_layer_indices", None), list):  # Bamba-like hybrids: one attention layer
        config.attn_layer_indices = [1]
    if getattr(config, "use_cache", None):  # a training step: no cache (hybrids' caches need an attention layer)
        config.use_cache = False
    for key, value in vars(config).items():
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key):
            setattr(config, key, 0.0)
    for key in ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id"):
        if isinstance(getattr(config, key, None), int):
            setattr(config, key, 2)
    cls = getattr(transformers, hf_model_types(task)[model_type])
    _refuse_large(lambda: cls(config))
    model = cls(config).float().train()
    if task == "image-classification":
        size = getattr(config, "image_size", 32)
        size = size[0] if isinstance(size, (list, tuple)) else size
        channels = getattr(config, "num_channels", 3)
        return model, {"pixel_values": torch.randn(BATCH, channels, size, size), "labels": torch.tensor([0, 1])}
    ids = torch.randint(3, getattr(config, "vocab_size", VOCAB), (BATCH, SEQ))
    ids[:, -1] = 2  # an <eos> to pool on (BART's classification head)
    labels = ids.clone() if task == "causal-lm" else torch.tensor([0, 1])
    return model, {"input_ids": ids, "labels": labels}


LARGEST = 60_000_000  # parameters: a config whose sub-models the shrinking misses stays big (BLT: gigabytes)


def _refuse_large(build: Callable[[], nn.Module]) -> None:
    """Raise where the model ``build`` makes (on the meta device: nothing allocated) holds more than :data:`LARGEST`
    parameters; a model that cannot be built on the meta device is let through."""
    try:
        with torch.device("meta"):
            count = sum(p.numel() for p in build().parameters())
    except TypeError:
        raise
    except Exception:  # noqa: BLE001 - an init that touches data: built for real, unchecked
        return
    if count > LARGEST:
        raise ValueError(f"{count / 1e6:.0f}M parameters at tiny dims (more than {LARGEST / 1e6:.0f}M)")


_TIMM_SIZES = ("atto", "femto", "pico", "nano", "tiny", "xxs", "xs", "small", "s")


def timm_modules() -> dict[str, str]:
    """One model per timm architecture module, the smallest its name says (module -> model name)."""
    import timm

    chosen = {}
    for module in timm.list_modules():
        names = timm.list_models(module=module)
        if not names:
            continue
        rank = lambda name: next((i for i, size in enumerate(_TIMM_SIZES) if f"_{size}" in name), len(_TIMM_SIZES))
        chosen[module] = min(names, key=lambda name: (rank(name), len(name)))
    return chosen


def tiny_timm(model_name: str) -> tuple[nn.Module, torch.Tensor]:
    """The timm ``model_name``, random init, 10 classes, at 64x64 where it takes an ``img_size`` (else its own
    input size), and a batch of two images for it."""
    import timm

    torch.manual_seed(0)
    try:
        _refuse_large(lambda: timm.create_model(model_name, pretrained=False, num_classes=10, img_size=64))
        model, size = timm.create_model(model_name, pretrained=False, num_classes=10, img_size=64), 64
    except TypeError:
        _refuse_large(lambda: timm.create_model(model_name, pretrained=False, num_classes=10))
        model = timm.create_model(model_name, pretrained=False, num_classes=10)
        size = model.pretrained_cfg.get("input_size", (3, 224, 224))[-1]
    channels = model.pretrained_cfg.get("input_size", (3,))[0]
    return model.train(), torch.randn(BATCH, channels, size, size)


# --- the check every model of the breadth passes: converted = stock --------------------------------------------


@dataclass
class Outcome:
    """What became of one model: ``status`` "exact" (outputs, training loss, gradients with the activations'
    exact derivatives, strict loads both ways and every candidate reported), "differs", "crash" (``apply_lowmem``
    raised) or "skipped" (it does not build tiny, or stock fails on its input); ``problems`` say what."""

    status: str
    problems: list[str]
    converted: int = 0
    left_alone: int = 0
    head: str = ""


def _step(model: nn.Module, example: Any, exact: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The training loss (or outputs' fixed random weighting) on ``example`` and the trainable parameters' gradients,
    every dropout off (stock's and ours), the activations' exact derivatives when ``exact``."""
    from lightning_lowmem.ops.activation import exact_derivatives
    from lightning_lowmem.surgery.example import call, loss_in, tensors_in
    from lightning_lowmem.surgery.verify import dropout_off

    torch.manual_seed(0)  # routers' jitter and the like draw the same numbers in both models
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    with dropout_off(), exact_derivatives() if exact else torch.enable_grad():
        output = call(model.train(), example)
        loss = loss_in(output)
        if loss is None:
            outputs = [t for t in tensors_in(output) if t.is_floating_point() and t.requires_grad]
            loss = sum((t.float() * torch.randn(t.shape, generator=torch.Generator().manual_seed(i))).sum()
                       for i, t in enumerate(outputs))  # fmt: skip
        grads = torch.autograd.grad(loss, list(params.values()), allow_unused=True) if loss.requires_grad else ()
    return loss.detach(), {name: g for name, g in zip(params, grads) if g is not None}


def gradient_error(stock: dict[str, torch.Tensor], converted: dict[str, torch.Tensor]) -> float:
    """``|g - g_stock| / |g_stock|`` over all gradients together."""
    diff = sum(float((converted[n] - g).float().norm() ** 2) for n, g in stock.items() if n in converted)
    return (diff / max(sum(float(g.float().norm() ** 2) for g in stock.values()), 1e-30)) ** 0.5


def rounding_sensitivity(stock: nn.Module, example: Any, grads: dict[str, torch.Tensor]) -> float:
    """How far stock's own gradients move when its float inputs move by a few roundings (a relative 1e-6): where a
    max-pool's argmax or a router's choice flips on a tie, rounding-level differences in the forward (which every
    exact conversion has) move the gradients by more than rounding (NesT: 0.3%, stock against stock). ``grads``:
    stock's own on ``example`` (``_step`` with ``exact=False``)."""
    from torch.utils._pytree import tree_map

    nudged = tree_map(lambda t: t * (1 + 1e-6) if isinstance(t, torch.Tensor) and t.is_floating_point() else t, example)
    _, moved = _step(stock, nudged, exact=False)
    return gradient_error(grads, moved)


def unreported(model: nn.Module, report: Any) -> list[str]:
    """The candidates of ``model`` (norms, activations, training dropouts) that no report entry accounts for (an
    entry of their own or of a module holding them)."""
    from lightning_lowmem.surgery.identify import composite_norm, names_activation, names_norm

    named = {e.name for e in report.entries}
    missing = []
    for name, module in model.named_modules():
        dropout = isinstance(module, nn.Dropout) and module.p > 0
        if not (names_norm(module) or names_activation(module) or composite_norm(module) or dropout):
            continue
        parts = name.split(".")
        if not any(".".join(parts[:i]) in named for i in range(len(parts), -1, -1)):
            missing.append(f"{name} ({type(module).__name__})")
    return missing


def check_conversion(model: nn.Module, example: Any, **options: Any) -> Outcome:
    """Convert ``model`` on ``example`` with ``apply_lowmem`` and hold it to the stock copy: eval outputs, the
    training loss and gradients (the k-bit activations with their exact derivative), strict state-dict loads both
    ways, every candidate reported. ``model`` is left converted."""
    import copy

    from lightning_lowmem import apply_lowmem
    from lightning_lowmem.surgery.example import call, tensors_in
    from lightning_lowmem.surgery.verify import _differs

    stock = copy.deepcopy(model)
    try:
        with torch.no_grad():  # before any training step changes a BatchNorm's running statistics
            before = [t.float() for t in tensors_in(call(stock.eval(), example))]
        stock_loss, stock_grads = _step(stock, example, exact=False)
    except Exception as err:  # noqa: BLE001 - a model that cannot train on its tiny input is not ours to judge
        return Outcome("skipped", [f"stock step: {type(err).__name__}: {str(err)[:120]}"])
    try:
        report = apply_lowmem(model, example_input=example, **options)
    except Exception as err:  # noqa: BLE001 - the crash is the finding
        return Outcome("crash", [f"{type(err).__name__}: {str(err)[:200]}"])
    problems = []
    with torch.no_grad():
        after = [t.float() for t in tensors_in(call(model.eval(), example))]
    if len(before) != len(after) or any(_differs(a, b, 1e-4) for a, b in zip(before, after)):
        problems.append("eval outputs differ")
    loss, grads = _step(model, example, exact=True)
    if not torch.allclose(loss.float(), stock_loss.float(), rtol=1e-4, atol=1e-5):
        problems.append(f"loss {loss.item():.6g} vs stock's {stock_loss.item():.6g}")
    if set(grads) != set(stock_grads):
        problems.append(f"gradients of {sorted(set(grads) ^ set(stock_grads))[:3]} missing or extra")
    elif (error := gradient_error(stock_grads, grads)) > 1e-3 and error > 2 * rounding_sensitivity(
        stock, example, stock_grads
    ):
        problems.append(f"gradients {error:.3g} off stock's")
    for source, target in ((stock, model), (model, stock)):
        result = target.load_state_dict(source.state_dict(), strict=False)
        if result.missing_keys or result.unexpected_keys:
            problems.append(f"state dict: missing {result.missing_keys[:2]}, unexpected {result.unexpected_keys[:2]}")
    if missing := unreported(stock, report):
        problems.append(f"unreported: {', '.join(missing[:3])}")
    head = next((f"{e.status}: {e.detail}" for e in report.entries if e.kind == "head"), "")
    return Outcome("differs" if problems else "exact", problems, len(report.converted), len(report.left_alone), head)


def _cases(tasks: tuple[str, ...], timm_models: bool) -> list[tuple[str, str, Callable[[], tuple[nn.Module, Any]]]]:
    """(library, name, build) of every model of the sweep."""
    cases = [
        ("transformers", f"{kind} ({task})", lambda kind=kind, task=task: tiny_hf(kind, task))
        for task in tasks for kind in sorted(hf_model_types(task))
    ]  # fmt: skip
    if timm_models:
        cases += [("timm", f"{name} ({module})", lambda name=name: tiny_timm(name)) for module, name in
                  sorted(timm_modules().items())]  # fmt: skip
    return cases


def main() -> None:
    """The sweep: every Hugging Face model type (causal LM, sequence and image classification) and one model per
    timm module, tiny and random-init, converted with the default options but ``measure=False`` (nothing rolled back
    for what it costs: every change held to stock), the causal LMs also under peft LoRA (r 8 on every linear layer,
    dropout 0.05), each held to the stock copy by :func:`check_conversion`; a table of outcomes to RESULTS.md."""
    import argparse
    import gc
    import sys
    import time
    import warnings
    from collections import Counter

    from benchmarks.common import markdown_table, write_section

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--only", default="", help="a substring of the model names to run")
    parser.add_argument("--no-timm", action="store_true")
    parser.add_argument("--write", action="store_true", help="write the table into benchmarks/RESULTS.md")
    parser.add_argument(
        "--from-log", type=Path, help="a cut-short run's printed lines: its cases are taken from there, the rest run"
    )
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    rows, counts, start = [], Counter(), time.time()
    cases = _cases(TASKS, not args.no_timm)
    total = sum(1 + ("(causal-lm)" in name) for _, name, _ in cases if args.only in name)
    done = set()
    if args.from_log is not None:
        for line in args.from_log.read_text().splitlines():
            if found := re.match(r"\s*\d+s (\w+)\s+(.+?)( \+ LoRA)?: (.*)$", line):
                status, name, adapters, problems = found.groups()
                library = "transformers" if re.search(r"\((causal-lm|\S+-classification)\)$", name) else "timm"
                counts[(library, bool(adapters), status)] += 1
                done.add(f"{name}{adapters or ''}")
                if status in ("differs", "crash"):
                    rows.append([f"{name}{adapters or ''}", status, problems])
    for library, name, build in cases:
        if args.only not in name:
            continue
        for adapters in (False, True):
            if adapters and "(causal-lm)" not in name:  # LoRA on the causal LMs, where the head is in play
                continue
            label = f"{name}{' + LoRA' if adapters else ''}"
            if label in done:
                continue
            try:
                model, example = build()
                if adapters:
                    model = lora(model, "all-linear", r=8, lora_alpha=16, lora_dropout=0.05)
            except Exception as err:  # noqa: BLE001 - a model that does not build tiny is counted, not judged
                outcome = Outcome("skipped", [f"build: {type(err).__name__}: {str(err)[:100]}"])
            else:  # measure=False: nothing rolled back for what it costs, every change held to stock
                outcome = check_conversion(model, example, measure=False)
            model = example = None
            gc.collect()  # each case's models go before the next is built
            counts[(library, adapters, outcome.status)] += 1
            print(f"{time.time() - start:7.0f}s {outcome.status:8} {label}: {'; '.join(outcome.problems)}", flush=True)
            if outcome.status in ("differs", "crash"):
                rows.append([label, outcome.status, "; ".join(outcome.problems)])
    table = [[lib, "LoRA" if ad else "-", *(counts[(lib, ad, s)] for s in ("exact", "differs", "crash", "skipped"))]
             for lib, ad in sorted({(lib, ad) for lib, ad, _ in counts})]  # fmt: skip
    body = "## The breadth sweep: every Hugging Face model type and one model per timm module\n\n"
    body += "Tiny random-init models converted with the default options and `measure=False` (so nothing is rolled back "
    body += "for what it costs: every change is held to stock), the causal LMs with and without peft LoRA (r 8, all "
    body += "linear layers, dropout 0.05); exact = eval outputs, training loss and gradients (the "
    body += "k-bit activations with their exact derivative) equal stock's (gradients within 1e-3 relative, or within "
    body += "twice what stock's own move when its inputs move by a relative 1e-6: a max-pool's argmax flips on a "
    body += "tie), strict loads both ways, every candidate "
    body += "reported. Skipped: does not build at tiny dims, or stock cannot train on the tiny input. Crash: "
    body += "`apply_lowmem` raised (its checks refusing a conversion that computes something else count here).\n\n"
    ran = sum(counts.values())
    if ran < total:
        body += f"{ran} of the {total} cases ran (the run was cut short; the rest, in the order of `_cases`, next).\n\n"
    elif args.from_log is not None:
        body += "The run was resumed from a cut-short run's log (`--from-log`): each case ran once, in one of them.\n\n"
    body += markdown_table(["library", "adapters", "exact", "differs", "crash", "skipped"], table)
    if rows:
        body += "\n\n" + markdown_table(["model", "outcome", "what"], rows)
    print(body)
    if args.write:
        write_section("breadth", body, " ".join(["python -m benchmarks.zoo", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
