"""Byte-level training text found on every machine: the Python standard library's own .py files.

Files are read at run time in sorted order (deterministic for one Python version) until `max_bytes`.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

from fa_forensics.errors import UserError


def stdlib_corpus(max_bytes: int = 2_000_000) -> torch.Tensor:
    """The first `max_bytes` bytes of the stdlib's top-level .py files, as token ids (N,) int64 in [0, 256)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks, total = [], 0
    for path in sorted(root.glob("*.py")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        if total >= max_bytes:
            break
    if total < 10_000:
        raise UserError(f"found only {total} bytes of Python source under {root}; demo-train needs the standard "
                        "library's .py files")
    buffer = bytearray(b"".join(chunks)[:max_bytes])
    return torch.frombuffer(buffer, dtype=torch.uint8).to(torch.int64)


def random_batch(tokens: torch.Tensor, batch_size: int, block_size: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), each (B, T): random windows of the corpus and the same windows shifted by one byte."""
    starts = torch.randint(0, tokens.numel() - block_size - 1, (batch_size,), generator=generator)
    offsets = torch.arange(block_size)
    x = tokens[starts[:, None] + offsets]  # (B, T)
    y = tokens[starts[:, None] + offsets + 1]  # (B, T)
    return x, y
