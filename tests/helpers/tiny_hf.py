"""Tiny Hugging Face runs built from small configs (no download), as the capture and verdict tests train them."""
from __future__ import annotations

from pathlib import Path

import torch

import fa_forensics


def tiny_gpt2(seq: int, *, implementation: str = "sdpa", n_layer: int = 2, attn_pdrop: float = 0.0):
    """A GPT-2 of 2 heads of 16 over a 64-token vocabulary and `seq` positions, seeded, no residual or embedding
    dropout; `attn_pdrop` is its attention dropout."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=64, n_positions=seq, n_embd=32, n_layer=n_layer, n_head=2, attn_pdrop=attn_pdrop,
                     resid_pdrop=0.0, embd_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    cfg._attn_implementation = implementation
    return GPT2LMHeadModel(cfg)


def padded_batch(seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two seeded rows of `seq` token ids and their attention mask: row 1 is left-padded by 5 tokens."""
    ids = torch.randint(0, 64, (2, seq), generator=torch.Generator().manual_seed(1))
    attention_mask = torch.ones(2, seq, dtype=torch.long)
    attention_mask[1, :5] = 0
    return ids, attention_mask


def capture_training(model, out: Path, ids: torch.Tensor, *, steps: int, record: list[int],
                     autocast: bool) -> Path:
    """`steps` real AdamW steps (lr 1e-3) of a causal LM on `ids` as input and labels, forward under CPU bf16
    autocast when `autocast`, under capture recording the steps in `record` (every batch row); the dump's path."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with fa_forensics.capture(model, out=out, steps=record, batch=None) as cap:
        for _ in range(steps):
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            cap.step(loss)
    return out


def tiny_llama(seq: int, *, implementation: str = "sdpa", n_layer: int = 2):
    """A Llama of 4 query heads sharing 2 key/value heads of 8 over a 64-token vocabulary and `seq` positions,
    seeded."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=n_layer,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=seq, bos_token_id=0,
                      eos_token_id=0)
    cfg._attn_implementation = implementation
    return LlamaForCausalLM(cfg)
