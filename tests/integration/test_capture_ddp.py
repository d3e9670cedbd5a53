"""Distributed data parallel: each rank writes its own rank_{r}/ tree; both read back (2 CPU processes, gloo)."""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from fa_forensics.dump import open_dump


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out: str, save_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    import fa_forensics
    from fa_forensics.demo.model import GPT, GPTConfig

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(GPT(GPTConfig(block_size=16, n_layer=2, n_head=2, n_embd=16,
                                                                    attention="sdpa")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    seen = {}
    with fa_forensics.capture(model, out=out, steps=[1], layers=[1], batch=None) as cap:
        for step in range(2):
            idx = torch.randint(0, 256, (2, 16), generator=gen)
            _, loss = model(idx, idx)
            loss.backward()
            seen[step] = model.module.transformer.h[1].attn.last_o.detach().clone()
            opt.step()
            opt.zero_grad()
            cap.step(loss)
    torch.save(seen, os.path.join(save_dir, f"seen{rank}.pt"))
    dist.destroy_process_group()


def test_ddp_two_ranks_write_their_own_trees(tmp_path):
    out = tmp_path / "run.zarr"
    mp.spawn(_worker, args=(2, _free_port(), str(out), str(tmp_path)), nprocs=2, join=True)
    assert (out / "rank_1").is_dir()
    outputs = []
    for rank in (0, 1):
        dump = open_dump(out, rank=rank)
        assert dump.steps == [1] and dump.layers(1) == [1]
        assert dump.layer_info(1, 1).module == "module.transformer.h.1.attn"
        o = dump.read(1, 1, "o")
        assert torch.equal(o, torch.load(tmp_path / f"seen{rank}.pt")[1])
        assert dump.read(1, 1, "do").shape == o.shape and dump.read(1, 1, "x").shape == (2, 16, 16)
        outputs.append(o)
    assert not torch.equal(outputs[0], outputs[1])  # different data per rank, never another rank's chunks
    assert open_dump(out).attrs["world_size"] == 2
