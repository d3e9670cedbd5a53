"""GPU speed of stable_attention, the plain kernel and the monitor, side by side in one JSON.

    python benchmarks/gpu_speed.py [--json FILE] [--quick]      # one CUDA GPU (H100/H200), ≤ 5 minutes
    python benchmarks/gpu_speed.py --smoke [--json FILE]        # CPU, tiny sizes, Triton interpreter

Measures (bf16; B·T = 8192 tokens, model width 1024: H 16 at D 64, H 8 at D 128):
- attention: forward and backward time of SDPA (torch's flash kernel), `stable_attention` (the
  fix) and `plain_attention` (the same Triton kernels, standard softmax) at T 1024 and 4096,
  D 64 and 128, causal and not; ratios SDPA-time / kernel-time (≥ 0.9 forward, ≥ 0.8 backward is
  the target), the fix's own cost (stable / plain − 1, target ≤ 3 %), TFLOP/s, and the relative
  error of O, dQ, dK, dV against SDPA (a check that the kernels are right on this GPU).
- training step: the demo GPT at GPT-2 size (12 layers, 12 heads, C 768, T 1024, B 8, bf16
  autocast, AdamW): plain; monitored (the monitor's per-call statistics and W_Q norms on every
  step, via StepCollector on batch rows 0:2 as capture's default, the fused Triton statistics
  kernel); and, when zarr is installed,
  under `fa_forensics.capture` with the monitor on every step and on an unselected step, and
  torch.compile'd capture: recompilations at the first captured step and that step's time.
Timing: triton.testing.do_bench (median of repeated runs, L2 flushed) for kernels; the median of
timed steps (CUDA-synchronized) for training steps. Prints ONE JSON object (also to --json FILE).
Needs torch, triton, numpy; zarr only for the capture rows (skipped with the reason without it).
Without a GPU and without --smoke it exits with code 2 and one line saying so.
"""
from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, Triton interpreter (checks the code)")
    parser.add_argument("--quick", action="store_true", help="T 1024 only and fewer training steps")
    parser.add_argument("--json", default=None, help="also write the JSON here")
    return parser.parse_args(argv)


# -- timing --------------------------------------------------------------------------------------
def bench_ms(fn, smoke: bool) -> float:
    """Median milliseconds of fn(): do_bench on a GPU, a few perf_counter runs under --smoke."""
    if smoke:
        fn()
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            runs.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(runs)
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=100))


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


# -- attention kernels ---------------------------------------------------------------------------
def attention_rows(device, dtype, shapes, smoke: bool) -> list[dict]:
    from fa_forensics.replay.stable import plain_attention, stable_attention

    impls = {  # backend "triton": the Triton kernels also for the CPU tensors of --smoke (interpreted)
        "sdpa": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "stable": lambda q, k, v, causal: stable_attention(q, k, v, causal=causal, backend="triton"),
        "plain": lambda q, k, v, causal: plain_attention(q, k, v, causal=causal, backend="triton"),
    }
    rows = []
    for B, H, T, D, causal in shapes:
        g = torch.Generator(device=device).manual_seed(0)
        q, k, v, do = (torch.randn(B, H, T, D, device=device, dtype=dtype, generator=g) for _ in range(4))
        flops_fwd = 4 * B * H * T * T * D * (0.5 if causal else 1.0)  # two matmuls
        row = {"B": B, "H": H, "T": T, "D": D, "causal": causal, "ms": {}, "tflops": {}, "rel_err_vs_sdpa": {}}
        outputs = {}
        for name, fn in impls.items():
            qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
            fwd = bench_ms(functools.partial(fn, q, k, v, causal), smoke)
            o = fn(qg, kg, vg, causal)
            bwd = bench_ms(functools.partial(o.backward, do, retain_graph=True), smoke)
            qg.grad = kg.grad = vg.grad = None
            o.backward(do, retain_graph=True)
            outputs[name] = (o.detach(), qg.grad, kg.grad, vg.grad)
            row["ms"][name] = {"fwd": fwd, "bwd": bwd}
            row["tflops"][name] = {"fwd": flops_fwd / fwd * 1e-9, "bwd": 2.5 * flops_fwd / bwd * 1e-9}
        for name in ("stable", "plain"):
            row["rel_err_vs_sdpa"][name] = {
                field: float((a.float() - b.float()).norm() / b.float().norm())
                for field, a, b in zip(("o", "dq", "dk", "dv"), outputs[name], outputs["sdpa"])}
        ms = row["ms"]
        row["speed_vs_sdpa"] = {name: {p: ms["sdpa"][p] / ms[name][p] for p in ("fwd", "bwd")}
                                for name in ("stable", "plain")}
        row["fix_cost"] = {p: ms["stable"][p] / ms["plain"][p] - 1 for p in ("fwd", "bwd")}
        rows.append(row)
        del q, k, v, do, outputs
    return rows


# -- training steps ------------------------------------------------------------------------------
class MonitoredSDPA:
    """Feeds every SDPA call of the model to a StepCollector (what `capture(monitor_every=1)` does per
    call, on capture's default batch slice 0:2), then runs SDPA. Installed on the demo model's module
    only while a case runs."""

    def __init__(self, model, collector):
        self.model, self.collector, self.layer = model, collector, 0

    def __call__(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        attn = self.model.transformer.h[self.layer].attn
        self.collector.observe_call(self.layer, q[:2], k[:2], scale=scale, causal=is_causal, p_dtype=torch.bfloat16,
                                    module=attn, module_name=f"transformer.h.{self.layer}.attn")
        self.layer += 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, **kw)


def training_rows(device, smoke: bool, quick: bool) -> dict:
    from fa_forensics.demo import model as demo
    from fa_forensics.monitor.collector import StepCollector

    if smoke:
        config = demo.GPTConfig(vocab_size=256, block_size=64, n_layer=2, n_head=4, n_embd=64, attention="sdpa")
        batch, steps = 2, 3
    else:
        config = demo.GPTConfig(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, attention="sdpa")
        batch, steps = 8, (10 if quick else 20)
    torch.manual_seed(0)
    model = demo.GPT(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device=device).manual_seed(0)
    autocast_dtype = torch.bfloat16

    def step(net):
        idx = torch.randint(0, config.vocab_size, (batch, config.block_size), device=device, generator=gen)
        with torch.autocast(device.type, dtype=autocast_dtype):
            _, loss = net(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def timed(net, n, each=None) -> float:
        """Median ms of n steps; each() is called inside every step's timing (begin/finish of a monitor)."""
        times = []
        for i in range(n):
            _sync(device)
            t0 = time.perf_counter()
            if each:
                each[0](i)
            step(net)
            if each:
                each[1]()
            _sync(device)
            times.append(time.perf_counter() - t0)
        return 1e3 * statistics.median(times)

    out = {"config": {"n_layer": config.n_layer, "n_head": config.n_head, "n_embd": config.n_embd,
                      "T": config.block_size, "batch": batch, "autocast": "bf16", "steps_timed": steps}}
    for _ in range(2):
        step(model)  # warm-up (cuBLAS, allocator, autotuning of the statistics kernel)
    plain_ms = timed(model, steps)
    collector = StepCollector(eps=1e-3, background=True)
    hook = MonitoredSDPA(model, collector)
    monitored_f = types.ModuleType("F")  # the model module's F only: torch's own stays untouched
    monitored_f.__dict__.update(F.__dict__)
    monitored_f.scaled_dot_product_attention = hook
    demo.F = monitored_f
    try:
        def begin(i):
            hook.layer = 0
            collector.begin(i)
        timed(model, 2, (begin, collector.finish))  # warm-up: the statistics kernel compiles here
        monitored_ms = timed(model, steps, (begin, collector.finish))
    finally:
        demo.F = F
        collector.close()
    out["ms"] = {"plain": plain_ms, "monitored": monitored_ms}
    out["ratio"] = {"monitored": monitored_ms / plain_ms}
    out["capture"] = capture_rows(model, step, timed, steps, smoke)
    return out


def capture_rows(model, step, timed, steps, smoke: bool) -> dict:
    """Capture's own cost (needs zarr): monitor on every step, an unselected step, and compiled capture."""
    try:
        import zarr  # noqa: F401
    except ImportError:
        return {"skipped": "zarr is not installed here: pip install zarr (capture writes zarr stores)"}
    import fa_forensics
    from torch._dynamo.utils import counters

    scratch = tempfile.mkdtemp(prefix="fa-gpu-speed-")
    far = 10**9
    res = {}
    try:
        with fa_forensics.capture(model, out=f"{scratch}/unselected.zarr", steps=[far]):
            res["unselected_ms"] = timed(model, steps)
        with fa_forensics.capture(model, out=f"{scratch}/monitored.zarr", steps=[far], monitor_every=1):
            timed(model, 1)
            res["monitor_every_1_ms"] = timed(model, steps)
        with fa_forensics.capture(model, out=f"{scratch}/captured.zarr", steps=[1], batch=slice(0, 1)):
            res["session_steps_ms"] = [timed(model, 1) for _ in range(3)]  # step 1 is captured
        if smoke:
            res["compiled"] = {"skipped": "--smoke: torch.compile on the CPU takes minutes; measured on a GPU run"}
            return res
        compiled = torch.compile(model)
        for _ in range(3):
            step(compiled)
        compiled_ms = timed(compiled, max(3, steps // 2))
        before = dict(counters["stats"])
        with fa_forensics.capture(compiled, out=f"{scratch}/compiled.zarr", steps=[1], batch=slice(0, 1)):
            session = [timed(compiled, 1) for _ in range(3)]  # steps 0 (unselected), 1 (captured), 2
        after = dict(counters["stats"])
        res["compiled"] = {
            "step_ms": compiled_ms,
            "session_steps_ms": session,
            "recompiles_in_session": after.get("unique_graphs", 0) - before.get("unique_graphs", 0),
            "graph_breaks_total": sum(counters["graph_break"].values()),
        }
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return res


def environment(device) -> dict:
    import triton

    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
    else:
        env["note"] = "--smoke: CPU under the Triton interpreter, tiny sizes; times are meaningless"
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        print("gpu_speed: no CUDA GPU found; run this on a GPU machine, or with --smoke to check the code on the CPU",
              file=sys.stderr)
        return 2
    t_start = time.perf_counter()
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:  # fp32: the interpreter's own bf16 dots are wrong (tests/triton/interpreter_compat.py)
        dtype = torch.float32
        shapes = [(1, 2, 64, 16, True), (1, 2, 64, 32, False)]
    else:
        dtype = torch.bfloat16
        shapes = [(8192 // T, 1024 // D, T, D, causal) for T in ((1024,) if args.quick else (1024, 4096))
                  for D in (64, 128) for causal in (True, False)]
    result = {"environment": environment(device), "dtype": str(dtype).replace("torch.", ""), "attention": []}
    for shape in shapes:  # the JSON is rewritten after each part, so a run cut short keeps what it measured
        result["attention"] += attention_rows(device, dtype, [shape], args.smoke)
        _write_partial(result, args.json)
    result["training_step"] = training_rows(device, args.smoke, args.quick)
    result["summary"] = summary(result)
    result["wall_s"] = time.perf_counter() - t_start
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0


def _write_partial(result: dict, path) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(result | {"partial": True}, f, indent=1)


def summary(result) -> dict:
    """The ratios the targets are about, one line each: worst case over the attention shapes."""
    rows = result["attention"]
    worst = {}
    for name in ("stable", "plain"):
        for p in ("fwd", "bwd"):
            worst[f"{name}_{p}_vs_sdpa_min"] = min(r["speed_vs_sdpa"][name][p] for r in rows)
    for p in ("fwd", "bwd"):
        worst[f"fix_cost_{p}_max"] = max(r["fix_cost"][p] for r in rows)
    worst["max_rel_err_vs_sdpa"] = max(v for r in rows for impl in r["rel_err_vs_sdpa"].values() for v in impl.values())
    worst["monitored_step_ratio"] = result["training_step"]["ratio"]["monitored"]
    worst["targets"] = {"fwd_vs_sdpa": 0.9, "bwd_vs_sdpa": 0.8, "fix_cost": 0.03, "monitored_step_ratio": 1.03}
    return worst


if __name__ == "__main__":
    sys.exit(main())
