"""The project's own small training run, used to make real dumps.

- `model.GPT`: a nanoGPT-style GPT whose attention is the paper's reference FlashAttention-2 as it
  trains under CUDA BF16 autocast, forward and backward (the replay emulator under preset
  "bf16-autocast-train"), or torch's scaled_dot_product_attention (`attention="sdpa"`).
- `data.demo_corpus`: byte-level text generated from a documented grammar and a fixed seed (`corpus`), the
  same bytes on every machine.
- `train.train(DemoConfig(...))`: AdamW training loop with an optional capture session and a
  per-step callback (the place for per-step statistics).
"""
from fa_forensics.demo.model import GPT, GPTConfig, flash_attention_bf16  # noqa: F401
from fa_forensics.demo.train import DemoConfig, StepInfo, train  # noqa: F401
