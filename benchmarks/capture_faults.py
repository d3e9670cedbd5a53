"""Capture under faults: N SIGKILL trials, and two captures into one path at once.

SIGKILL trials: a tiny GPT trains with every step selected and a slowed writer (a disk that cannot
keep up, so steps wait in the queue); it is killed after a random step k in 2..8. Every step 0..k
must be either complete and bit-exact (its stored O equals the O training computed, saved beside
the run) or listed as incomplete. Concurrent captures: a second capture into the path of a running
one must exit 2 naming the holder, and the first must finish whole.

    python benchmarks/capture_faults.py [--trials 20] [--seed 0]
"""
from __future__ import annotations

import argparse
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings
from pathlib import Path

import torch

TRAIN = textwrap.dedent('''
    import os, signal, sys, time, torch
    import fa_forensics
    from fa_forensics.demo.model import GPT, GPTConfig
    from fa_forensics.dump import DumpWriter

    out, side, kill_after, delay = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    real = DumpWriter.write_array
    def slow(self, step, *args, **kwargs):
        time.sleep(delay)
        return real(self, step, *args, **kwargs)
    DumpWriter.write_array = slow
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16, attention="sdpa"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    with fa_forensics.capture(model, out=out, steps=range(0, 1000), batch=None, max_queue=1000) as cap:
        for it in range(1000 if kill_after >= 0 else 12):
            idx = torch.randint(0, 256, (2, 16))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                _, loss = model(idx, idx)
            torch.save(model.transformer.h[0].attn.last_o.detach().clone(), os.path.join(side, f"o_{it}.pt"))
            loss.backward(); opt.step(); opt.zero_grad()
            cap.step(loss)
            if it == kill_after:
                os.kill(os.getpid(), signal.SIGKILL)
''')


def check(out: Path, side: Path, last: int) -> tuple[int, int, list[int]]:
    """(complete and bit-exact, listed incomplete, steps that vanished or differ) for steps 0..last."""
    from fa_forensics.dump import open_dump

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dump = open_dump(out)
    exact = [s for s in dump.steps if s <= last and torch.equal(dump.read(s, 0, "o").view(torch.int16),
                                                                torch.load(side / f"o_{s}.pt").view(torch.int16))]
    listed = [s for s in dump.incomplete_steps if s <= last]
    bad = [s for s in range(last + 1) if s not in exact and s not in listed]
    return len(exact), len(listed), bad


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(TRAIN)
        totals = [0, 0, 0]
        for trial in range(args.trials):
            out, side = Path(tmp) / f"t{trial}.zarr", Path(tmp) / f"side{trial}"
            side.mkdir()
            k = rng.randint(2, 8)
            proc = subprocess.run([sys.executable, str(script), str(out), str(side), str(k), "0.05"],
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode == -signal.SIGKILL, proc.stderr
            exact, listed, bad = check(out, side, k)
            totals[0] += exact
            totals[1] += listed
            totals[2] += len(bad)
            print(f"trial {trial:2d}: killed after step {k}: {exact} complete and bit-exact, {listed} listed "
                  f"incomplete, {len(bad)} lost {bad}")
        print(f"SIGKILL: {args.trials} trials, {totals[0]} steps complete and bit-exact, {totals[1]} listed "
              f"incomplete, {totals[2]} lost")

        out, side = Path(tmp) / "shared.zarr", Path(tmp) / "side_shared"
        side.mkdir()
        first = subprocess.Popen([sys.executable, str(script), str(out), str(side), "-1", "0.2"],
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        while not (Path(tmp) / "shared.zarr.lock").exists() and first.poll() is None:
            time.sleep(0.05)
        side2 = Path(tmp) / "side_second"
        side2.mkdir()
        plain = Path(tmp) / "plain.py"
        plain.write_text("import torch\nfrom fa_forensics.demo.model import GPT, GPTConfig\n"
                         "m = GPT(GPTConfig(block_size=16, n_layer=1, n_head=2, n_embd=16, attention='sdpa'))\n"
                         "idx = torch.randint(0, 256, (2, 16)); m(idx, idx)[1].backward()\n")
        second = subprocess.run([sys.executable, "-m", "fa_forensics", "capture", "--out", str(out), "--steps", "0",
                                 "--", sys.executable, str(plain)],
                                capture_output=True, text=True, timeout=300)
        first.wait(timeout=300)
        exact, listed, bad = check(out, side, 11)
        refusal = [line for line in second.stderr.splitlines() if "being written by another process" in line]
        lines = [line for line in second.stderr.splitlines() if line.strip()]
        print(f"concurrent: second capture (CLI) exit {second.returncode}, {len(lines)} stderr line(s): "
              f"{refusal[-1] if refusal else lines!r}")
        print(f"concurrent: first capture exit {first.returncode}: {exact} of 12 steps complete and bit-exact, "
              f"{listed} incomplete, {len(bad)} lost")


if __name__ == "__main__":
    main()
