"""One GRPO step's memory: per-token log-probs through the head as TRL computes them, and without the logits.

A Qwen2.5-7B decoder layer and head at their real dimensions (hidden 3,584, intermediate 18,944, 28 heads, 4 KV
heads, vocabulary 152,064; bf16, random init), 8 completions of ``--tokens`` tokens after a 64-token prompt, the
GRPO loss of one iteration (``-exp(logp - logp.detach()) * advantage``, averaged over the completion tokens):

- **stock**: what TRL's ``GRPOTrainer._get_per_token_logps_and_entropies`` runs: the model's logits of the kept
  positions (``logits_to_keep``), divided by the temperature, ``trl.trainer.utils.selective_log_softmax`` and,
  without gradient, ``entropy_from_logits``;
- **TRL's fused head**: what the trainers of TRL 1.16 run instead (``trl.trainer.utils.add_fused_lm_head``, then
  ``model(..., labels=labels, fused_lm_head=True)``: log-probs and entropies by chunks, no logits);
- **linear_log_probs**: the same body, then :func:`lightning_lowmem.functional.linear_log_probs` on its last
  hidden states with the head's weight (log-probs and entropies, no logits);
- **Liger's fused GRPO loss**: the same body, then Liger Kernel's ``LigerFusedLinearGRPOLoss`` (its chunked loss,
  torch code compiled by ``torch.compile`` as by default, so it runs on a CPU too; ``beta=0``, no reference model,
  ``loss_type="grpo"``: the same loss) on the same hidden states and weight; it returns no entropies.

Each runs in a fresh process; the figure is the allocation peak of the step (forward, loss, backward) above what
was allocated before it (the profiler's allocation events, :func:`lightning_lowmem.memory.peak.allocation_peak`),
beside the loss and a gradient's norm (the same in all three: the same computation). The embedding and head are
frozen, as a LoRA fine-tune leaves them, so the peak is the activations' and not a weight gradient's.

    python benchmarks/log_probs.py [--tokens 1024] [--smoke]    (Liger's variant where ``liger-kernel`` is installed)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import markdown_table, write_section
from lightning_lowmem.functional import linear_log_probs
from lightning_lowmem.memory.peak import allocation_peak

QWEN25_7B = {"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28, "num_key_value_heads": 4,
             "vocab_size": 152_064}  # fmt: skip
COMPLETIONS, PROMPT, TEMPERATURE = 8, 64, 0.9


def model_and_batch(tokens: int, smoke: bool) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    import transformers

    dims = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
            "vocab_size": 1000} if smoke else QWEN25_7B  # fmt: skip
    config = transformers.Qwen2Config(**dims, num_hidden_layers=1, max_position_embeddings=PROMPT + tokens + 1)
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).to(torch.bfloat16).train()
    for frozen in (model.model.embed_tokens, model.lm_head):  # as LoRA leaves them: the peak is the activations'
        frozen.weight.requires_grad_(False)
    ids = torch.randint(0, config.vocab_size, (COMPLETIONS, PROMPT + tokens))
    advantages = torch.randn(COMPLETIONS, 1)
    return model, ids, advantages


def grpo_loss(logps: torch.Tensor, advantages: torch.Tensor) -> torch.Tensor:
    return (-torch.exp(logps - logps.detach()) * advantages).mean()


def step(variant: str, tokens: int, smoke: bool) -> dict[str, float]:
    from trl.trainer.utils import add_fused_lm_head, entropy_from_logits, selective_log_softmax

    model, ids, advantages = model_and_batch(tokens, smoke)
    completion = ids[:, -tokens:]
    if variant == "trl_fused":
        add_fused_lm_head(model, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    labels = ids.clone()
    labels[:, :-tokens] = -100  # only the completion is scored, as GRPO masks it

    def run() -> tuple[float, float, float]:
        if variant == "stock":
            logits = model(input_ids=ids, logits_to_keep=tokens + 1).logits[:, :-1, :] / TEMPERATURE
            logps = selective_log_softmax(logits, completion)
            with torch.no_grad():
                entropy = entropy_from_logits(logits)
        elif variant == "trl_fused":
            outputs = model(input_ids=ids, labels=labels, fused_lm_head=True)
            logps, entropy = outputs.log_probs[:, -tokens:], outputs.entropy[:, -tokens:]
        else:
            hidden = model.model(input_ids=ids).last_hidden_state[:, -tokens - 1 : -1]
            if variant == "liger_grpo":
                from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

                liger = LigerFusedLinearGRPOLoss(
                    beta=0.0, use_ref_model=False, loss_type="grpo", temperature=TEMPERATURE
                )
                loss = liger(hidden, model.lm_head.weight, completion, torch.ones_like(completion), advantages[:, 0])[0]
                loss.backward()
                return loss.item(), float("nan"), model.model.layers[0].mlp.down_proj.weight.grad.norm().item()
            logps, entropy = linear_log_probs(
                hidden, model.lm_head.weight, completion, temperature=TEMPERATURE, return_entropy=True
            )
        loss = grpo_loss(logps, advantages)
        loss.backward()
        return loss.item(), entropy.float().mean().item(), model.model.layers[0].mlp.down_proj.weight.grad.norm().item()

    peak, (loss, entropy, grad_norm) = allocation_peak(run)
    return {"peak_mib": peak / 2**20, "loss": loss, "entropy": entropy, "grad_norm": grad_norm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024, help="completion tokens (8 completions)")
    parser.add_argument("--smoke", action="store_true", help="tiny dims, no RESULTS.md update")
    parser.add_argument("--variant", help=argparse.SUPPRESS)  # a worker: prints JSON
    args = parser.parse_args()
    tokens = 16 if args.smoke else args.tokens
    if args.variant:
        print(json.dumps(step(args.variant, tokens, args.smoke)))
        return
    worker = [sys.executable, str(Path(__file__).resolve()), "--tokens", str(tokens), "--variant"]
    found = {}
    liger = importlib.util.find_spec("liger_kernel") is not None  # not a dependency: measured where installed
    for variant in ("stock", "trl_fused", "linear_log_probs", *(["liger_grpo"] if liger else [])):
        run = subprocess.run(
            [*worker, variant, *(["--smoke"] if args.smoke else [])], capture_output=True, text=True, check=False
        )
        if run.returncode:
            raise RuntimeError(f"{variant}: {run.stderr[-2000:]}")
        found[variant] = json.loads(run.stdout.splitlines()[-1])
        print(variant, found[variant], flush=True)
    vocab = 1000 if args.smoke else QWEN25_7B["vocab_size"]
    logits_mib = COMPLETIONS * (tokens + 1) * vocab * 2 / 2**20
    table = markdown_table(
        ["GRPO step", "allocation peak, MiB", "share of stock's", "loss", "mean entropy", "down_proj grad norm"],
        [[name, f"{r['peak_mib']:,.0f}", f"{r['peak_mib'] / found['stock']['peak_mib']:.1%}", f"{r['loss']:.6f}",
          f"{r['entropy']:.4f}", f"{r['grad_norm']:.6g}"] for name, r in found.items()],
    )  # fmt: skip
    print(table)
    if args.smoke:
        return
    body = (
        "## Per-token log-probs for preference and RL fine-tuning (one GRPO step)\n\n"
        f"A Qwen2.5-7B layer and head (real dims, bf16; embedding and head frozen), {COMPLETIONS} completions x {tokens} tokens after a "
        f"{PROMPT}-token prompt, temperature {TEMPERATURE}: TRL's own log-prob path (bf16 logits of the kept "
        f"positions, {logits_mib:,.0f} MiB, `selective_log_softmax`, `entropy_from_logits`), TRL 1.16's fused LM "
        "head (`add_fused_lm_head`, which its DPO, KTO, GRPO, RLOO trainers install), `linear_log_probs` and Liger "
        "Kernel's `LigerFusedLinearGRPOLoss` (torch code, compiled; no entropies: nan) on the same hidden states; "
        "allocation peak of forward, GRPO loss and backward, each in a fresh process. Where the fused paths peak alike, "
        "the peak is the decoder layer's own (their heads' chunks stay below it).\n\n" + table
    )
    write_section("log_probs", body, f"python benchmarks/log_probs.py --tokens {tokens}")


if __name__ == "__main__":
    main()
