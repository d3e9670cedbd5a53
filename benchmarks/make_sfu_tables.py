"""Build the special-function-unit exp2 tables of fa_forensics/numerics/sfu.py from a GPU tabulation.

    python benchmarks/make_sfu_tables.py TABLES_DIR LAWS_DIR [fa_forensics/numerics/data [tests/data/sfu_h200]]

TABLES_DIR holds what `benchmarks/gpu_special_functions.py DIR tables` wrote on the GPU (sf_tables.npz,
sf_binades.npz), LAWS_DIR what its part `laws` wrote (sf_tables.npz with the exact lg2 table).
The tables are ex2.approx.ftz.f32 at x = -i·2⁻²³ (negative) and x = +i·2⁻²³ (positive), i in [0, 2²³), stored as
the int8 difference of their bits to the correctly rounded 2^x (lzma-compressed, about 130 KB each).
The negative table is read from the binade [-2, -1), where ex2(-(1 + i·2⁻²³)) = Tn[i] / 2 (the scaling law
the GPU run verified over every fp32 in [-128, 0]); it is checked here against the binades [-1, -0.5),
[-0.5, -0.25), [-8, -4) and [-32, -16) recorded in the same run: every bit must agree.
The lg2 table is lg2.approx.ftz at x = 1 + i·2⁻²³ as the int32 difference of its bits to the correctly rounded
log2 (the part `laws` verified lg2(2^e·m) = RZ(e + lg2(m)) for every e in [1, 126] and every m).
The test fixture (samples.npz) keeps 2048 recorded (x, ex2.approx(x)) pairs of each recorded binade and 4096
(x, lg2.approx(x)) pairs of [1024, 2048), chosen with a fixed seed.
"""
from __future__ import annotations

import lzma
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from fa_forensics.numerics import sfu  # noqa: E402

N = 1 << 23


def correctly_rounded_bits(x_bits: np.ndarray) -> np.ndarray:
    x = torch.from_numpy(x_bits.astype(np.uint32).view(np.float32).copy())
    return torch.exp2(x.double()).float().numpy().view(np.int32)


def recorded(binades: np.lib.npyio.NpzFile, E: int) -> tuple[np.ndarray, np.ndarray]:
    """(x bits, ex2.approx bits) of every fp32 in [-2^E, -2^(E-1)) recorded on the GPU."""
    x_bits = (np.uint32(0x80000000 | ((127 + E - 1) << 23)) + np.arange(N, dtype=np.uint32))
    return x_bits, correctly_rounded_bits(x_bits) + binades[f"ex2_neg{E}"].astype(np.int32)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    src, laws_dir = Path(argv[0]), Path(argv[1])
    dst = Path(argv[2]) if len(argv) > 2 else HERE.parent / "fa_forensics" / "numerics" / "data"
    fixture = Path(argv[3]) if len(argv) > 3 else HERE.parent / "tests" / "data" / "sfu_h200"
    tables, binades = np.load(src / "sf_tables.npz"), np.load(src / "sf_binades.npz")
    laws = np.load(laws_dir / "sf_tables.npz")
    assert "lg2 law RZ(e + lg2(m)) e=1..126 mismatches = 0 of" in str(laws["summary"])
    assert "ex2 positive law over [0,128) mismatches = 0 of" in str(laws["summary"])
    summary = str(tables["summary"])
    assert "scaling F=23 mode=3 mismatches = 0 of" in summary, "the GPU run did not confirm the scaling law"

    _, y1 = recorded(binades, 1)
    neg = (y1.view(np.float32).astype(np.float64) * 2).astype(np.float32)  # exact: a power-of-two scaling
    grid = np.arange(N, dtype=np.float64) * 2.0 ** -23
    neg_diff = neg.view(np.int32) - correctly_rounded_bits((-grid).astype(np.float32).view(np.uint32))
    pos_bits = correctly_rounded_bits(grid.astype(np.float32).view(np.uint32)) + tables["ex2_frac23"].astype(np.int32)
    pos_diff = pos_bits - correctly_rounded_bits(grid.astype(np.float32).view(np.uint32))
    dst.mkdir(parents=True, exist_ok=True)
    for name, diff in (("neg", neg_diff), ("pos", pos_diff)):
        assert np.abs(diff).max() < 128
        (dst / f"ex2_sm90_{name}.i8.xz").write_bytes(
            lzma.compress(diff.astype(np.int8).tobytes(), preset=9 | lzma.PRESET_EXTREME))
    (dst / "lg2_sm90.i32.xz").write_bytes(
        lzma.compress(laws["lg2_exact"].astype(np.int32).tobytes(), preset=9 | lzma.PRESET_EXTREME))
    sfu.load_tables.cache_clear()
    sfu.load_lg2_table.cache_clear()
    for E in (0, -1, 3, 5):
        x_bits, want = recorded(binades, E)
        got = sfu.ex2_approx(torch.from_numpy(x_bits.view(np.float32).copy())).numpy().view(np.int32)
        bad = int((got != want).sum())
        print(f"binade [-2^{E}, -2^{E - 1}): {bad} of {N} differ")
        assert bad == 0
    print("wrote", *sorted(p.name for p in dst.glob("*.xz")))
    rng = np.random.default_rng(0)
    pairs = {}
    for E in (-1, 0, 1, 3, 5):
        x_bits, y_bits = recorded(binades, E)
        pick = np.sort(rng.choice(N, 2048, replace=False))
        pairs[f"ex2_x_{E}"], pairs[f"ex2_y_{E}"] = x_bits[pick].astype(np.uint32), y_bits[pick].astype(np.uint32)
    x10 = np.uint32(0x44800000) + np.arange(N, dtype=np.uint32)
    y10 = torch.log2(torch.from_numpy(x10.view(np.float32).copy()).double()).float().numpy().view(np.int32)
    y10 = y10 + tables["lg2_e10"].astype(np.int32)
    pick = np.sort(rng.choice(N, 4096, replace=False))
    pairs["lg2_x"], pairs["lg2_y"] = x10[pick], y10[pick].astype(np.uint32)
    fixture.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(fixture / "samples.npz", **pairs)
    print("wrote", fixture / "samples.npz")
    return 0


if __name__ == "__main__":
    sys.exit(main())
