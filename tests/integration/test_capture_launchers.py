"""`fa-forensics capture` under every common way of starting DDP ranks: torchrun, python -m
torch.distributed.run, python -m torch.distributed.launch (which passes --local-rank=N to the script), and a
script that spawns its ranks (torch.multiprocessing.spawn). Each trains a tiny 2-layer GPT under
DistributedDataParallel on 2 CPU ranks (gloo): the losses equal those of the same run without capture bit
for bit on both ranks, each rank's tree holds every selected step whole, the stored O is SDPA of the stored
Q, K, V, and the root attributes are rank 0's."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from fa_forensics.dump import open_dump

SCRIPT = textwrap.dedent('''
    import json, os, socket, sys
    import torch, torch.distributed as dist
    from fa_forensics.demo.model import GPT, GPTConfig

    def train(rank, world, save):
        torch.set_num_threads(1)
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(
            GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16, attention="sdpa")))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
        losses = []
        for step in range(3):
            idx = torch.randint(0, 256, (2, 16), generator=gen)
            _, loss = model(idx, idx)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with open(os.path.join(save, f"losses_{rank}.json"), "w") as fh:
            json.dump(losses, fh)
        dist.destroy_process_group()

    def spawned(index, world, port, save):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=index, world_size=world)
        train(index, world, save)

    if __name__ == "__main__":
        save = [a for a in sys.argv[1:] if not a.startswith("--")][0]  # torch.distributed.launch adds --local-rank
        if "--spawn" in sys.argv:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            torch.multiprocessing.spawn(spawned, args=(2, port, save), nprocs=2, join=True)
        else:
            dist.init_process_group("gloo")  # env:// from the launcher
            train(dist.get_rank(), dist.get_world_size(), save)
''')

RANKS_2 = ["--standalone", "--nproc_per_node", "2"]  # standalone: a free port, whatever else runs here
LAUNCHERS = {
    "torchrun": ["torchrun", *RANKS_2],
    "torch.distributed.run": [sys.executable, "-m", "torch.distributed.run", *RANKS_2],
    "torch.distributed.launch": [sys.executable, "-m", "torch.distributed.launch", *RANKS_2],
    "mp.spawn": [sys.executable],
}


def _training(launcher: str, script, save) -> list[str]:
    return [*LAUNCHERS[launcher], str(script), str(save), *(["--spawn"] if launcher == "mp.spawn" else [])]


def _losses(folder) -> dict[int, list[float]]:
    return {r: json.loads((folder / f"losses_{r}.json").read_text()) for r in (0, 1)}


@pytest.fixture(scope="module")
def uncaptured(tmp_path_factory):
    """The script and the losses of both ranks of the run without capture."""
    where = tmp_path_factory.mktemp("ddp")
    script = where / "train_ddp.py"
    script.write_text(SCRIPT)
    (where / "plain").mkdir()
    done = subprocess.run(_training("mp.spawn", script, where / "plain"), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return script, _losses(where / "plain")


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_capture_records_every_rank_under_the_launcher(launcher, uncaptured, tmp_path):
    script, plain = uncaptured
    out, js = tmp_path / "run.zarr", tmp_path / "capture.json"
    done = subprocess.run([sys.executable, "-m", "fa_forensics.cli", "capture", "--out", str(out), "--steps", "1,2",
                           "--batch", "0:2", "--json", str(js), "--", *_training(launcher, script, tmp_path)],
                          capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert _losses(tmp_path) == plain  # bit for bit: capture changes nothing the ranks compute

    summary = json.loads(js.read_text())
    assert summary["world_size"] == 2 and summary["warnings"] == []
    assert [(r["rank"], r["steps"], r["steps_run"]) for r in summary["ranks"]] == [(0, [1, 2], 3), (1, [1, 2], 3)]
    assert "rank 0: steps [1, 2]" in done.stdout and "rank 1: steps [1, 2]" in done.stdout

    root = open_dump(out)
    assert root.attrs["capture"]["rank"] == 0 and root.attrs["world_size"] == 2 and root.ranks == [0, 1]
    stored_o = {}
    for rank in (0, 1):
        dump = open_dump(out, rank=rank)
        assert dump.steps == [1, 2] and dump.incomplete_steps == [] and dump.layers() == [0, 1]
        for step in (1, 2):
            assert dump.step_attrs(step)["rank"] == rank and dump.step_attrs(step)["loss"] == plain[rank][step]
            for layer in (0, 1):
                assert dump.layer_info(step, layer).module == f"module.transformer.h.{layer}.attn"
                q, k, v, o = (dump.read(step, layer, n) for n in "qkvo")
                assert torch.equal(o, F.scaled_dot_product_attention(q, k, v, is_causal=True))
                assert dump.read(step, layer, "do").shape == o.shape
                assert dump.read(step, layer, "x").shape == (2, 16, 16)
                stored_o[rank, step, layer] = o
    assert not torch.equal(stored_o[0, 1, 0], stored_o[1, 1, 0])  # each rank its own data, never another's chunks
