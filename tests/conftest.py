"""Shared fixtures: the planted sample dump and a factory for small fresh dumps."""
from __future__ import annotations

import os

# Triton fixes its interpreter mode when first imported, and test modules import it at collection
# (transformers does): set the mode here, before any of them, so tests/triton runs interpreted.
os.environ["TRITON_INTERPRET"] = "1"

import math
from collections.abc import Iterable, Sequence
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config) -> None:
    """One torch thread per xdist worker: `-n 2` on 2 cores with 2 threads each oversubscribes the
    CPU, and torch's OpenMP threads then slow down by an order of magnitude."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


# Slow tests (real training, Triton's interpreter, subprocesses, about 3 s of CPU or more) are marked where they are
# defined: `pytestmark = pytest.mark.slow` in a file, `@pytest.mark.slow` on a test, a directory's conftest.py for
# tests/integration and tests/triton. The fast loop (`python -m pytest -q -m "not slow"`) leaves them out; CI runs all.


PLANTED_DUMP = REPO / "sample_dumps" / "planted.zarr"


def build_dump(
    path: Path,
    *,
    steps: Iterable[int] = (0, 1),
    layers: Iterable[int] = (0,),
    batch: int = 1,
    heads: int = 2,
    seq: int = 16,
    head_dim: int = 8,
    dtype: torch.dtype = torch.bfloat16,
    names: Sequence[str] = ("q", "k", "v", "o", "do", "x"),
    incomplete: Iterable[int] = (),
    causal: bool = True,
    scale: float | None = None,
    seed: int = 0,
    run_attrs: dict | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> Path:
    """Write a small dump of random q, k, v, do, x (N(0, 1) in `dtype`) with o = the BF16 reference
    output (fp32 softmax attention for other dtypes). Steps in `incomplete` are written but never
    marked complete, as if the writer had been killed. `rank` > 0 adds that rank's tree to the store at `path`
    (which rank 0 made first)."""
    from fa_forensics.dump import DumpWriter
    from fa_forensics.planted import bf16_reference

    g = torch.Generator().manual_seed(seed)
    attrs = {"model": {"name": "test"}, "capture": {"source": "tests"}, "amp_dtype": str(dtype).removeprefix("torch.")}
    attrs.update(run_attrs or {})
    writer = DumpWriter(path, attrs, rank=rank, world_size=world_size)
    alpha = scale if scale is not None else 1.0 / math.sqrt(head_dim)
    incomplete = set(incomplete)
    for s in sorted(set(steps) | incomplete):
        for l in layers:
            # (B, H, T, D)
            q, k, v, do = (torch.randn(batch, heads, seq, head_dim, generator=g).to(dtype) for _ in range(4))
            x = torch.randn(batch, seq, heads * head_dim, generator=g).to(dtype)  # (B, T, C)
            if dtype == torch.bfloat16:
                o, _ = bf16_reference(q, k, v, causal=causal, scale=alpha)
            else:
                o = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=causal,
                                                                     scale=alpha).to(dtype)
            tensors = {"q": q, "k": k, "v": v, "o": o, "do": do, "x": x}
            for n in names:
                writer.write_array(s, l, n, tensors[n], layer_attrs={"module": f"blocks.{l}.attn", "causal": causal,
                                                                     "scale": alpha})
        if s not in incomplete:
            writer.complete_step(s, loss=1.0 + s)
    writer.close()
    return Path(path)


@pytest.fixture(scope="session", autouse=True)
def match_cache_of_the_session(tmp_path_factory):
    """Session and module fixtures' match results go to a directory of this session, never ~/.cache."""
    before = os.environ.get("FA_FORENSICS_CACHE_DIR")
    os.environ["FA_FORENSICS_CACHE_DIR"] = str(tmp_path_factory.mktemp("match-cache-session"))
    yield
    if before is None:
        os.environ.pop("FA_FORENSICS_CACHE_DIR", None)
    else:
        os.environ["FA_FORENSICS_CACHE_DIR"] = before


@pytest.fixture(autouse=True)
def match_cache_per_test(tmp_path_factory, monkeypatch):
    """Each test its own match cache: results are content-addressed, so tests with equal dumps would share one."""
    monkeypatch.setenv("FA_FORENSICS_CACHE_DIR", str(tmp_path_factory.mktemp("match-cache")))


@pytest.fixture(scope="session")
def planted_dump() -> Path:
    """Path of sample_dumps/planted.zarr (made by `fa-forensics synth`, see docs/dump.md)."""
    if not (PLANTED_DUMP / "zarr.json").is_file():
        pytest.fail(f"{PLANTED_DUMP} is missing; regenerate it with the synth command in docs/dump.md")
    return PLANTED_DUMP


@pytest.fixture(scope="session")
def dump_builder():
    """`build_dump` itself, for fixtures of a wider scope than make_dump's."""
    return build_dump


@pytest.fixture
def make_dump(tmp_path):
    """Factory: make_dump(name="d.zarr", **build_dump options) -> Path of a fresh small dump under tmp_path."""
    counter = iter(range(10_000))

    def _make(name: str | None = None, **kwargs) -> Path:
        return build_dump(tmp_path / (name or f"dump{next(counter)}.zarr"), **kwargs)

    return _make
