"""LitGPT's command line with lightning-lowmem: ``python -m lightning_lowmem.litgpt finetune_lora <checkpoint>
<LitGPT's arguments>`` (or ``lowmem-litgpt ...``) runs LitGPT's own finetune script, its model converted at the
first training forward and its loss through the fused head (:mod:`~lightning_lowmem.litgpt.finetune`)."""
