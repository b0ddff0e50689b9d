"""linear_log_probs: stock's per-token log-probs and entropies, and their gradients, without the logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_lowmem import kernels
from lightning_lowmem.functional import linear_log_probs
from lightning_lowmem.kernels import torch_ops
from lightning_lowmem.ops import cross_entropy

VOCAB, FEATURES = 96, 24


def stock(hidden, weight, target, bias=None, temperature=1.0, ignore_index=-100):
    """What TRL computes: the log-softmax of the fp32 logits, gathered; the entropy of the same distribution."""
    log_p = F.log_softmax(F.linear(hidden, weight, bias).float() / temperature, dim=-1)
    kept = target != ignore_index
    picked = log_p.gather(-1, target.masked_fill(~kept, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return picked * kept, entropy * kept


def inputs(dtype=torch.float32, rows=3, tokens=10, bias=True):
    hidden = torch.randn(rows, tokens, FEATURES, dtype=dtype, requires_grad=True)
    weight = (torch.randn(VOCAB, FEATURES) / FEATURES**0.5).to(dtype).requires_grad_()
    b = torch.randn(VOCAB, dtype=dtype, requires_grad=True) if bias else None
    target = torch.randint(0, VOCAB, (rows, tokens))
    target[0, :4] = -100  # a prompt
    return hidden, weight, target, b


def value_and_grads(fn, tensors, upstream):
    log_probs, entropy = fn()
    (log_probs * upstream[0] + entropy * upstream[1]).sum().backward()
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return (log_probs.detach(), entropy.detach()), grads


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("chunk", [None, 7], ids=["one_chunk", "chunks_of_7"])
def test_log_probs_entropies_and_gradients_are_stocks(temperature, bias, chunk, monkeypatch):
    """fp32: values to fp32 rounding, gradients of a loss on both outputs within 4x stock's own error from fp64."""
    if chunk:
        monkeypatch.setattr(cross_entropy, "chunk_rows", lambda *args: chunk)
    hidden, weight, target, b = inputs(bias=bias)
    tensors = [t for t in (hidden, weight, b) if t is not None]
    upstream = torch.randn(2, *target.shape)
    ours, grads = value_and_grads(
        lambda: linear_log_probs(hidden, weight, target, b, temperature=temperature, return_entropy=True),
        tensors, upstream,
    )  # fmt: skip
    theirs, stock_grads = value_and_grads(lambda: stock(hidden, weight, target, b, temperature), tensors, upstream)
    exact = [t.detach().double().requires_grad_() for t in tensors]
    as_fp64 = (*exact[:2], target, exact[2] if bias else None)
    _, fp64_grads = value_and_grads(lambda: stock(*as_fp64, temperature), exact, upstream.double())
    for a, s in zip(ours, theirs):
        torch.testing.assert_close(a, s, rtol=1e-5, atol=1e-5)
    for g, s, e in zip(grads, stock_grads, fp64_grads):
        assert (g.double() - e).abs().max() <= 4 * (s.double() - e).abs().max() + 1e-7


def test_masked_tokens_give_zero_and_no_gradient():
    hidden, weight, target, _ = inputs()
    log_probs, entropy = linear_log_probs(hidden, weight, target, return_entropy=True)
    ignored = target == -100
    assert (log_probs[ignored] == 0).all() and (entropy[ignored] == 0).all() and (log_probs[~ignored] < 0).all()
    (log_probs.sum() + entropy.sum()).backward()
    assert (hidden.grad[ignored] == 0).all() and (hidden.grad[~ignored] != 0).any()


def test_the_top1_is_whether_the_target_is_the_largest_logit(monkeypatch):
    monkeypatch.setattr(cross_entropy, "chunk_rows", lambda *args: 7)
    hidden, weight, target, b = inputs()
    logits = F.linear(hidden, weight, b)
    target[1, :5] = logits[1, :5].argmax(-1)  # some hits
    log_probs, top1 = linear_log_probs(hidden, weight, target, b, return_top1=True)
    expected = (logits.argmax(-1) == target) & (target != -100)
    assert top1.dtype == torch.bool and torch.equal(top1, expected) and expected.sum() >= 5
    assert not top1.requires_grad and log_probs.requires_grad


def test_bf16_follows_stocks_bf16_logits():
    """bf16 hidden states and weight: the logits rounded to bf16 as stock's are before their ``.float()``."""
    hidden, weight, target, b = inputs(torch.bfloat16)
    ours = linear_log_probs(hidden, weight, target, b, return_entropy=True)
    for a, s in zip(ours, stock(hidden, weight, target, b)):
        torch.testing.assert_close(a, s, rtol=1e-5, atol=1e-5)
    ours[0].sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16


def test_no_row_by_vocabulary_tensor_is_saved(recorder):
    """Saved for backward: the hidden states (which the stock linear saves too), the targets and fp32 values per row;
    stock saves the logits' log-softmax (rows x vocabulary)."""
    hidden, weight, target, b = inputs(rows=4, tokens=32)
    rows = target.numel()
    with recorder() as ours:
        linear_log_probs(hidden, weight, target, b, return_entropy=True)
    with recorder() as theirs:
        stock(hidden, weight, target, b)
    assert max(t.numel() for t in ours.saved) <= max(rows * FEATURES, VOCAB * FEATURES) < rows * VOCAB
    assert max(t.numel() for t in theirs.saved) >= rows * VOCAB


def test_only_the_log_probs_or_only_the_entropy_train():
    hidden, weight, target, _ = inputs(bias=False)
    log_probs, entropy = linear_log_probs(hidden, weight, target, return_entropy=True)
    (entropy.sum() * 0 + log_probs.sum()).backward()
    grad = hidden.grad.clone()
    hidden.grad = None
    stock(hidden, weight, target)[0].sum().backward()
    torch.testing.assert_close(grad, hidden.grad, rtol=1e-5, atol=1e-6)
    hidden.grad = None
    linear_log_probs(hidden, weight, target, return_entropy=True)[1].sum().backward()  # the entropy alone
    ours = hidden.grad.clone()
    hidden.grad = None
    stock(hidden, weight, target)[1].sum().backward()
    torch.testing.assert_close(ours, hidden.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [40, 5000], ids=["one_block", "blocks"])
@pytest.mark.parametrize("entropy", [True, False], ids=["entropy", "log_probs_only"])
@pytest.mark.parametrize("scale", [3.0, 2000.0], ids=["logits", "logits_in_the_thousands"])
def test_every_backend_computes_the_reference(kernel_backend, dtype, vocab, entropy, scale):
    """The ops as each compiled backend runs them (C++, Triton): the values to fp32 rounding (the entropy of a peaked
    row too: the kernels sum ``p (s - max)``, no cancellation of large numbers), the gradient chunks to one rounding
    in their dtype."""
    device = kernel_backend.device
    logits = (scale * torch.randn(6, vocab, device=device)).to(dtype)
    target = torch.tensor([1, 2, -100, vocab - 1, 0, 5], device=device)
    found = kernel_backend.module.token_log_probs(logits, target, -100, 0.7)
    for a, s in zip(found, torch_ops.token_log_probs(logits, target, -100, 0.7)):
        torch.testing.assert_close(a, s, rtol=1e-5, atol=1e-5)
    grads = [logits.clone(), logits.clone()]
    upstream = torch.randn(2, 6, device=device)
    per_row = (found[2], found[1], upstream[0], upstream[1] if entropy else None)
    kernel_backend.module.token_log_probs_grad_(grads[0], target, *per_row, -100, 0.7)
    torch_ops.token_log_probs_grad_(grads[1], target, *per_row, -100, 0.7)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-6, rtol={torch.float32: 1e-5}.get(dtype, 1e-2))
    assert (grads[0][2] == 0).all()  # the ignored row


def test_an_out_of_bounds_target_asserts_on_the_device_under_triton(monkeypatch):
    """The GPU's side of the target check, forced on the CPU through Triton's interpreter: the kernels' wrappers do
    not read targets back to the host (a device-side assert, as stock's cross-entropy), the reference on a CPU tensor
    names the target."""
    triton_ops = pytest.importorskip("lightning_lowmem.kernels.triton_ops")
    if not triton_ops.INTERPRETED:
        pytest.skip("a GPU: the assert fires asynchronously")
    asserted = []
    monkeypatch.setattr(torch, "_assert_async", lambda condition, message: asserted.append((bool(condition), message)))
    logits, target = torch.randn(3, 40), torch.tensor([1, 40, -100])
    triton_ops.token_log_probs(logits, target, -100, 1.0)
    triton_ops.token_log_probs_grad_(logits.clone(), target, *[torch.zeros(3)] * 3, None, -100, 1.0)
    assert asserted == [(False, "token_log_probs: a target is out of bounds for 40 classes")] + [
        (False, "token_log_probs_grad_: a target is out of bounds for 40 classes")
    ]
    with pytest.raises(IndexError, match="token_log_probs: target 40 is out of bounds for 40 classes"):
        torch_ops.token_log_probs(logits, target, -100, 1.0)


def test_bad_input_gets_a_clear_error():
    hidden, weight, target, _ = inputs()
    with pytest.raises(ValueError, match="temperature must be positive"):
        linear_log_probs(hidden, weight, target, temperature=0.0)
    with pytest.raises(ValueError, match="target must be int64 of shape"):
        linear_log_probs(hidden, weight, target.int())
    with pytest.raises(ValueError, match="do not match"):
        linear_log_probs(hidden, weight.t(), target)
    with pytest.raises(IndexError, match=f"token_log_probs: target {VOCAB} is out of bounds for {VOCAB} classes"):
        linear_log_probs(hidden, weight, target.masked_fill(target == target[1, 0], VOCAB))
    with pytest.raises(TypeError, match="unsupported dtype"):
        linear_log_probs(hidden.int(), weight, target)
    log_probs = linear_log_probs(hidden, weight, target)
    with pytest.raises(RuntimeError, match="linear_log_probs does not support double backward"):
        torch.autograd.grad(log_probs.sum(), hidden, create_graph=True)
    with pytest.raises(ValueError, match="token_log_probs: logits must be contiguous"):
        torch_ops.token_log_probs(torch.randn(40, 6).t(), target[0, :6], -100, 1.0)


def test_compiles_whole():
    hidden, weight, target, b = inputs()
    torch._dynamo.reset()
    compiled = torch.compile(linear_log_probs, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(hidden, weight, target, b), linear_log_probs(hidden, weight, target, b))
    assert kernels.backend("cpu") in kernels.BACKENDS


def tiny_llama(**extra):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, **extra
    )
    return transformers.LlamaForCausalLM(config)


def test_a_causal_lms_log_probs_are_trls_from_its_logits_and_a_reference_saves_nothing(recorder):
    """As TRL scores completions: ``selective_log_softmax`` of the logits of each position against the next label;
    a LoRA body (peft) trains through them; under ``no_grad`` (the frozen reference) nothing is saved."""
    peft = pytest.importorskip("peft")
    trl_utils = pytest.importorskip("trl.trainer.utils")
    from lightning_lowmem.hf import causal_lm_log_probs

    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    ids = torch.randint(0, 300, (2, 12))
    labels = ids.masked_fill(torch.arange(12) < 4, -100)  # the prompt
    mask = torch.ones_like(ids).index_fill_(1, torch.tensor([0, 1]), 0)
    log_probs, entropy = causal_lm_log_probs(model, ids, labels, attention_mask=mask, return_entropy=True)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    kept = labels[:, 1:] != -100
    expected = trl_utils.selective_log_softmax(logits, labels[:, 1:].clamp(min=0)) * kept
    torch.testing.assert_close(log_probs, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, trl_utils.entropy_from_logits(logits) * kept, rtol=1e-5, atol=1e-5)
    log_probs.sum().backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "lora_A" in n)
    with torch.no_grad(), model.disable_adapter(), recorder() as saved:
        causal_lm_log_probs(model, ids, labels)
    assert not saved.saved


def test_a_causal_lm_whose_logits_are_capped_or_whose_head_is_adapted_is_refused():
    peft = pytest.importorskip("peft")
    from lightning_lowmem.hf import causal_lm_log_probs

    ids = torch.randint(0, 300, (1, 8))
    capped = tiny_llama()
    capped.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="LlamaForCausalLM is not supported: its logits are changed by final_logit"):
        causal_lm_log_probs(capped, ids, ids)
    adapted = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["lm_head"]))
    with pytest.raises(ValueError, match="a head with a LoRA adapter is not supported yet"):
        causal_lm_log_probs(adapted, ids, ids)


def test_the_dpo_example_trains_with_stocks_losses_under_lowmem_bp():
    """examples/dpo.py: DPO on a LightningModule (peft LoRA, the reference with its adapters off): with LowMemBP
    the losses are stock's (LoRA dropout off: stock's and the seeded dropout draw different masks), and with
    dropout it trains."""
    pytest.importorskip("peft")
    from examples import dpo

    stock, converted = (dpo.train(3, lowmem=lowmem, lora_dropout=0.0) for lowmem in (False, True))
    assert stock[0] == pytest.approx(0.693147, abs=1e-6)  # the policy is the reference at the start: log 2
    assert converted == pytest.approx(stock, abs=1e-5) and converted[-1] < converted[0]
    assert dpo.train(2, lowmem=True)[-1] < 0.6931


@pytest.mark.parametrize(
    "case",
    ["every_row_ignored", "extreme_logits", "one_class", "no_rows"],
)
def test_edge_cases_as_the_peers_test_them(case):
    """TRL's and Liger's edge cases for log-probs of a head: nothing to score (zeros, zero gradients, no NaN),
    logits in the thousands (the log-sum-exp's shift), a single class (log-prob 0, entropy 0), no rows at all."""
    hidden, weight, target, b = inputs()
    if case == "every_row_ignored":
        target.fill_(-100)
    elif case == "extreme_logits":
        weight = (weight.detach() * 500).requires_grad_()
    elif case == "one_class":
        weight, b, target = weight[:1].detach().requires_grad_(), None, torch.zeros_like(target)
    else:
        hidden, target = hidden[:0].detach().requires_grad_(), target[:0]
    log_probs, entropy = linear_log_probs(hidden, weight, target, b, return_entropy=True)
    expected = stock(hidden, weight, target, b)
    torch.testing.assert_close(log_probs, expected[0], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(entropy, expected[1], rtol=1e-5, atol=1e-4)
    (log_probs.sum() + entropy.sum()).backward()
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
    if case in ("every_row_ignored", "one_class"):
        assert (log_probs == 0).all() and (entropy == 0).all() and (hidden.grad == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_trls_chunked_log_prob_grid(dtype, temperature, monkeypatch):
    """TRL's grid for its chunked log-prob head (64 rows, hidden 32, vocabulary 128, chunks of 32 rows, no bias):
    log-probs and entropies to 1e-5 (bf16: 1e-2) of the fp32 log-softmax of the logits, and the gradients of the
    log-probs' sum to 1e-5 in fp32; in bf16 (where TRL allows 1e-2, and one weight-gradient element of 4,096 differs
    from stock's by 1.4e-2 here) as close to the fp64 gradients as stock's bf16 ones are."""
    monkeypatch.setattr(cross_entropy, "chunk_rows", lambda *args: 32)
    torch.manual_seed(42)
    hidden = torch.randn(64, 32, dtype=dtype, requires_grad=True)
    weight = torch.randn(128, 32, dtype=dtype, requires_grad=True)
    labels = torch.randint(0, 128, (64,))
    log_probs, entropy = linear_log_probs(hidden, weight, labels, temperature=temperature, return_entropy=True)
    expected = stock(hidden, weight, labels, temperature=temperature)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(log_probs, expected[0], atol=tolerance, rtol=tolerance)
    torch.testing.assert_close(entropy, expected[1], atol=tolerance, rtol=tolerance)
    ours = torch.autograd.grad(log_probs.sum(), (hidden, weight))
    theirs = torch.autograd.grad(expected[0].sum(), (hidden, weight))
    exact = [t.detach().double().requires_grad_() for t in (hidden, weight)]
    fp64 = torch.autograd.grad(stock(*exact, labels, temperature=temperature)[0].sum(), exact)
    for a, s, e in zip(ours, theirs, fp64):
        if dtype == torch.float32:
            torch.testing.assert_close(a, s, atol=tolerance, rtol=tolerance)
        assert (a.double() - e).abs().max() <= 1.05 * (s.double() - e).abs().max() + 1e-6


def grpo_loss(policy, reference, target, mask, advantages, old, beta, low, high):
    """The GRPO loss of Liger Kernel's grid, on per-token log-probs: the clipped importance-sampling term, plus beta
    times the k3 estimate of the KL to the reference, averaged over the unmasked tokens; and the metrics Liger reports
    (the mean KL where beta > 0, the share of clipped tokens)."""
    old = policy.detach() if old is None else old
    ratio = torch.exp(policy - old)
    per_token = -torch.min(ratio * advantages[:, None], ratio.clamp(1 - low, 1 + high) * advantages[:, None])
    tokens = mask.sum().clamp(min=1.0)
    metrics = []
    if beta:
        kl = torch.exp(reference - policy) - (reference - policy) - 1.0
        per_token = per_token + beta * kl
        metrics.append((kl * mask).sum() / tokens)
    clipped = ((ratio < 1 - low) & (advantages[:, None] < 0)) | ((ratio > 1 + high) & (advantages[:, None] > 0))
    metrics.append((clipped * mask).sum() / tokens)
    return (per_token * mask).sum() / tokens, metrics


@pytest.mark.parametrize(("rows", "tokens", "features", "vocab"), [(8, 128, 1024, 4096), (3, 47, 31, 123)])
@pytest.mark.parametrize(("dtype", "atol", "rtol"), [(torch.bfloat16, 5e-2, 5e-1), (torch.float32, 1e-5, 5e-4)])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize(("beta", "low", "high", "temperature"), [(0.1, 0.2, 0.2, 1.0), (0.0, 0.1, 0.1, 2.0)])
@pytest.mark.parametrize("reference", ["log_probs", "model", "none"])
@pytest.mark.parametrize("old", [True, False], ids=["old_log_probs", "on_policy"])
def test_ligers_grpo_grid(rows, tokens, features, vocab, dtype, atol, rtol, bias, beta, low, high, temperature,
                          reference, old):  # fmt: skip
    """Liger Kernel's grid for its fused GRPO loss (``test/chunked_loss/test_grpo_loss.py``: shapes, dtypes and
    tolerances, bias, beta / clipping / temperature, the reference's log-probs given, computed from a reference head
    or absent, old log-probs or on-policy, random padding), the loss written on ``linear_log_probs`` (the reference's
    under ``no_grad``) against the same loss on stock's log-softmax of the logits: loss, metrics, and the gradients
    of the hidden states, the weight and the bias."""
    torch.manual_seed(0)
    weight = torch.randn(vocab, features, dtype=dtype)
    b = torch.randn(vocab, dtype=dtype) if bias else None
    ref_weight = weight + torch.randn(vocab, features, dtype=dtype) * 0.01
    ref_bias = b + torch.randn(vocab, dtype=dtype) * 0.01 if bias else None
    hidden = torch.randn(rows, tokens, features, dtype=dtype)
    target = torch.randint(0, vocab, (rows, tokens))
    mask = torch.ones(rows, tokens)
    mask.view(-1)[torch.randperm(rows * tokens)[: int(torch.randint(1, rows * tokens // 2, (1,)))]] = 0
    advantages = torch.rand(rows, dtype=dtype)
    with torch.no_grad():
        current = stock(hidden, weight, target, b, temperature)[0]
    given = current + torch.randn(rows, tokens) * 0.01 if reference == "log_probs" else None
    ref_hidden = hidden + torch.randn(rows, tokens, features, dtype=dtype) * 0.01 if reference == "model" else None
    old_log_probs = current + torch.randn(rows, tokens) * 0.01 if old else None

    def run(log_probs):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, *([b] if bias else []))]
        policy = log_probs(leaves[0], leaves[1], target, leaves[2] if bias else None, temperature)
        if reference == "model":
            with torch.no_grad():
                ref = log_probs(ref_hidden, ref_weight, target, ref_bias, temperature)
        else:
            ref = policy.detach() if given is None else given
        loss, metrics = grpo_loss(policy, ref, target, mask, advantages.float(), old_log_probs, beta, low, high)
        return loss, metrics, torch.autograd.grad(loss, leaves)

    ours = run(lambda h, w, t, bias_, temp: linear_log_probs(h, w, t, bias_, temperature=temp))
    theirs = run(lambda h, w, t, bias_, temp: stock(h, w, t, bias_, temp)[0])
    assert torch.isfinite(ours[0])
    torch.testing.assert_close(ours[0], theirs[0], atol=atol, rtol=rtol)
    for a, s in zip(ours[1], theirs[1], strict=True):
        torch.testing.assert_close(a, s, atol=atol, rtol=rtol)
    for a, s in zip(ours[2], theirs[2], strict=True):
        torch.testing.assert_close(a, s, atol=atol, rtol=rtol)
