"""Run in its own process (ZeRO-3 slows later work in a process): LoRA under a ZeRO-3 engine,
merged with and without gathering. Prints one JSON line."""

import json

import deepspeed
import torch

from dschat_lib import config, lora, models, runtime

runtime.init_distributed()
results = {}
for gather in (True, False):
    model = models.build_causal_lm("cpu-tiny", vocab_size=64, seed=0, num_hidden_layers=1,
                                   hidden_size=32, ffn_dim=64, num_attention_heads=2)
    model = lora.apply_lora(model, lora.LoraSettings(dim=4, module_name="decoder.layers."))
    for name, p in model.named_parameters():       # make B non-zero so the merge matters
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.5)
    x = torch.randint(0, 64, (2, 8))
    with torch.no_grad():
        before = model(input_ids=x).logits
    cfg = config.ds_config(stage=3, micro_batch_size=2, dtype="fp32", optimizer=config.adamw(1e-3))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()
                                                                      if p.requires_grad], config=cfg)
    merged = lora.merge(engine.module, zero_stage=3 if gather else 0)
    with deepspeed.zero.GatheredParameters(list(merged.parameters())):
        sizes = [p.numel() for p in merged.parameters()]
        after = merged(input_ids=x).logits
    results["gathered" if gather else "not_gathered"] = {
        "max_abs_diff": (after - before).abs().max().item(),
        "weights_after_merge_nonempty": all(n > 0 for n in sizes)}
    runtime.teardown(engine)
    runtime.init_distributed()
print(json.dumps(results))
