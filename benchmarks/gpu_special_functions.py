"""Tabulate the GPU's approximate exp2 / log2 / reciprocal (needs nvcc and a CUDA GPU): builds and runs
benchmarks/gpu_special_functions.cu, then packs its output into two compressed .npz files.

    python benchmarks/gpu_special_functions.py OUT_DIR [all|tables|laws|rcp]

OUT_DIR gets `sf_tables.npz` (summary text, ex2 fraction tables for 23 and 24 fraction bits, the lg2 tables, the
rcp.approx table on [1, 2), the SASS that exp2f, ex2.approx, __logf, logf, 1/x and __fdividef compile to) and
`sf_binades.npz` (ex2.approx.ftz on whole binades of negative inputs). Everything is a difference to the correctly
rounded value (see the .cu file).
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent

PROBE = r"""
__global__ void probe(const float* x, float* y) {
  int i = threadIdx.x;
  float a; asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(a) : "f"(x[i]));
  y[6 * i] = a;
  y[6 * i + 1] = exp2f(x[i] * 1.5f);
  y[6 * i + 2] = __logf(x[i] + 3.f);
  y[6 * i + 3] = logf(x[i] + 5.f);
  y[6 * i + 4] = 1.f / (x[i] + 7.f);
  y[6 * i + 5] = __fdividef(x[i], x[i] + 9.f);
}
"""


def sass_of_probe(work: Path) -> str:
    """The SASS lines of a probe kernel: which instructions exp2f, __logf and logf become."""
    src = work / "probe.cu"
    src.write_text(PROBE)
    cubin = work / "probe.cubin"
    subprocess.run(["nvcc", "-arch=sm_90", "-cubin", "-o", str(cubin), str(src)], check=True)
    tool = shutil.which("cuobjdump")
    if not tool:
        return "cuobjdump not found"
    out = subprocess.run([tool, "-sass", str(cubin)], capture_output=True, text=True).stdout
    return "\n".join(line.strip() for line in out.splitlines() if "/*" in line and any(
        op in line for op in ("MUFU", "FMUL", "FFMA", "FADD", "FSETP", "FSEL", "CALL", "BRA")))


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) not in (1, 2):
        print(__doc__)
        return 2
    out = Path(argv[0])
    part = argv[1] if len(argv) == 2 else "all"
    if part not in ("all", "tables", "laws", "rcp"):
        print(f"part {part!r} is not one of all, tables, laws, rcp", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        binary = work / "gpu_sf"
        subprocess.run(["nvcc", "-O2", "-arch=sm_90", "-o", str(binary), str(HERE / "gpu_special_functions.cu")],
                       check=True)
        raw = work / "raw"
        raw.mkdir()
        run = subprocess.run([str(binary), str(raw), part], capture_output=True, text=True)
        summary = (raw / "summary.txt").read_text() if (raw / "summary.txt").exists() else ""
        print(summary)
        print(run.stderr, file=sys.stderr)
        try:
            sass = sass_of_probe(work)
        except (subprocess.CalledProcessError, OSError) as exc:
            sass = f"probe failed: {exc}"
        print(sass)
        tables = {"summary": np.array(summary), "sass": np.array(sass), "returncode": np.array(run.returncode)}
        binades = {}
        for f in sorted(raw.iterdir()):
            dtype = {".i8": np.int8, ".i16": np.int16, ".i32": np.int32}.get(f.suffix)
            if dtype is None:
                continue
            target = binades if f.stem.startswith("ex2_neg") else tables
            target[f.stem] = np.fromfile(f, dtype=dtype)
        np.savez_compressed(out / "sf_tables.npz", **tables)
        np.savez_compressed(out / "sf_binades.npz", **binades)
    for f in ("sf_tables.npz", "sf_binades.npz"):
        print(f, (out / f).stat().st_size)
    return run.returncode


if __name__ == "__main__":
    sys.exit(main())
