"""Byte-level training text that is the same on every machine: the demo corpus (`demo.corpus`), and batches of it."""
from __future__ import annotations

import hashlib

import torch

from fa_forensics.demo.corpus import CORPUS_BYTES, CORPUS_SHA256, corpus_bytes
from fa_forensics.errors import UserError

MIN_CORPUS_BYTES = 10_000  # the demo's context (256) and a few thousand distinct windows


def demo_corpus(max_bytes: int = CORPUS_BYTES) -> torch.Tensor:
    """The first `max_bytes` bytes of the demo corpus, as token ids (N,) int64 in [0, 256).

    The default corpus is checked against its recorded sha256, so a run never trains on other bytes unnoticed.
    """
    if max_bytes < MIN_CORPUS_BYTES:
        raise UserError(f"the demo corpus needs at least {MIN_CORPUS_BYTES} bytes, got {max_bytes}")
    data = corpus_bytes(max_bytes)
    if max_bytes == CORPUS_BYTES and hashlib.sha256(data).hexdigest() != CORPUS_SHA256:
        raise UserError("the generated demo corpus does not have its recorded sha256; the generator in "
                        "fa_forensics/demo/corpus.py was changed, so demo runs are not comparable to the bundled dump")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


def random_batch(tokens: torch.Tensor, batch_size: int, block_size: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (B, T): random windows of the corpus and the same windows shifted by one byte."""
    starts = torch.randint(0, tokens.numel() - block_size - 1, (batch_size,), generator=generator)
    offsets = torch.arange(block_size)
    x = tokens[starts[:, None] + offsets]  # (B, T)
    y = tokens[starts[:, None] + offsets + 1]  # (B, T)
    return x, y
