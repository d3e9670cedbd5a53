"""Shared set-up of the benchmarks that time training steps of the demo model.

`DemoBench(args)` builds the demo GPT, AdamW, the demo corpus and a scratch folder, and times one
training step (forward + backward + AdamW) with `one_step(cap=None, read_loss=False)`; `rotated`
runs the cases of one repeat in rotating order so that no case always runs first.
"""
from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import torch

from fa_forensics.demo.data import demo_corpus, random_batch
from fa_forensics.demo.model import GPT, GPTConfig
from fa_forensics.demo.train import train_step


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Options every demo-step benchmark takes."""
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--capture-batch", default="0:2", help="batch slice that is captured / monitored")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda exercises the pinned-memory async copies)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (1: steady timings on a shared machine)")
    parser.add_argument("--json", type=Path, default=None)


class DemoBench:
    """The demo model, its optimizer and data, and a timer for one training step."""

    def __init__(self, args: argparse.Namespace, scratch_prefix: str) -> None:
        torch.set_num_threads(args.threads)
        self.args = args
        self.config = GPTConfig()
        torch.manual_seed(0)
        self.device = torch.device(args.device)
        self.model = GPT(self.config).to(self.device)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
        self.tokens = demo_corpus(500_000)
        self.generator = torch.Generator().manual_seed(0)
        self.scratch = Path(tempfile.mkdtemp(prefix=scratch_prefix))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def one_step(self, cap=None, read_loss: bool = False) -> float:
        """Seconds of one training step; with `cap`, report its loss to the session; `read_loss`
        reads the loss on the host (as demo-train does every step)."""
        x, y = (t.to(self.device) for t in random_batch(self.tokens, self.args.batch_size, self.config.block_size,
                                                        self.generator))
        self.sync()
        t0 = time.perf_counter()
        loss = train_step(self.model, self.optimizer, x, y, 1.0)
        if cap is not None:
            cap.step(loss)
        if read_loss:
            float(loss)
        self.sync()
        return time.perf_counter() - t0

    def device_name(self) -> str:
        return str(self.device) if self.device.type == "cpu" else torch.cuda.get_device_name(self.device)

    def cleanup(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)


def rotated(cases: list, r: int) -> list:
    """The cases of repeat r, rotated by r: no case always runs first."""
    k = r % len(cases)
    return cases[k:] + cases[:k]
