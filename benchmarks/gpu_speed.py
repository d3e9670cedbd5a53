"""GPU speed of stable_attention, the plain kernel, their levers, the monitor and compiled capture, side by side.

    python benchmarks/gpu_speed.py [--json FILE] [--markdown FILE] [--quick] [--budget-s 420]   # one CUDA GPU
    python benchmarks/gpu_speed.py --smoke [--json FILE] [--markdown FILE]   # CPU, tiny sizes, Triton interpreter

Measures, in this order (bf16; B·T = 8192 tokens, model width 1024: H 16 at D 64, H 8 at D 128):
1. attention (the issue's first three rows): forward and backward time of SDPA (torch's default
   choice), `stable_attention` (the fix) and `plain_attention` (the same Triton kernels, standard
   softmax, the same tiles) at T 1024 and 4096, D 64 and 128, causal and not; SDPA-time / kernel-time
   (targets: ≥ 0.9 forward, ≥ 0.8 backward), the fix's own cost (stable / plain − 1, target ≤ 3 %),
   TFLOP/s, and the relative error of O, dQ, dK, dV against SDPA.
2. training step (GPT-2 size: 12 layers, 12 heads, C 768, T 1024, B 8, bf16 autocast, AdamW): plain;
   monitored on every step (StepCollector on batch rows 0:2, capture's default; target ≤ 1.03×);
   under `fa_forensics.capture` (monitor on every step, an unselected step, a session recording its
   step 1); and torch.compile'd capture: what dynamo and inductor compile when the session starts and
   at the recorded step (target: nothing, or ≤ 1 s), and the steps' times.
3. levers of the stabilized forward (fast_tiles.KernelOptions), each timed beside the default on every
   shape, with a check that it computes the default's bits: the one-pass tie test (top2), TMA
   descriptors (tma), both, Triton's warp specialization; and the plain kernel with TMA.
4. the monitor's statistics alone, per attention call of the GPT-2 step: every row (the fused kernel),
   a sample of 1/16 of the rows (monitor/sampled.py), and the sample on a side stream
   (monitor/side_stream.py) that overlaps the backward, and every row's max logit and top-1 (the kernel's
   first pass alone) with the sample's counts, on the side stream. Among the forward's levers, `row_max`
   times the forward keeping each row's maximum (max logit and top-1 then come free: monitor/lse_stats.py).
5. Triton's autotuner beside the table (causal shapes, stabilized forward and backward): time, the
   configs it settles on, and whether it computes the table's bits.
Parts 3-5 run only while the time budget (--budget-s, counted from the start) has room for them; a part
left out is recorded as skipped. Timing: triton.testing.do_bench (median, L2 flushed) for kernels;
the median of timed steps (CUDA-synchronized) for training steps. Prints ONE JSON object (also to
--json FILE, rewritten after every part) and writes a markdown summary (--markdown FILE).
Needs torch, triton, numpy, scipy; zarr for the capture rows. Without a GPU and without --smoke it exits
with code 2 and one line saying so.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_speed_markdown import render_markdown  # noqa: E402

LEVERS = {"top2": dict(tie_test="top2"), "tma": dict(tma=True), "tma+top2": dict(tma=True, tie_test="top2"),
          "warp_specialize": dict(warp_specialize=True)}
FORWARD_EXTRAS = {"row_max": dict(row_max=True)}  # forward arguments timed as levers: each row's maximum kept
SAMPLE_FRACTION = 1 / 16  # of each batch row's query positions, for the sampled monitor


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, Triton interpreter (checks the code)")
    parser.add_argument("--quick", action="store_true", help="T 1024 only and fewer training steps")
    parser.add_argument("--json", default=None, help="also write the JSON here")
    parser.add_argument("--markdown", default=None, help="write the markdown summary here")
    parser.add_argument("--budget-s", type=float, default=420.0,
                        help="seconds from the start after which the optional parts (levers, monitor, autotune) "
                             "are skipped")
    return parser.parse_args(argv)


class Budget:
    """Seconds left of the run's budget; optional parts ask before they start."""

    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)

    def allows(self, needed_s: float) -> bool:
        return self.left() >= needed_s


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


def _error_text(exc: BaseException) -> str:
    first = next((line for line in str(exc).splitlines() if line.strip()), "")
    return f"{type(exc).__name__}: {first}"[:300]


def _inputs(shape, device, dtype):
    B, H, T, D, _ = shape
    g = torch.Generator(device=device).manual_seed(0)
    return tuple(torch.randn(B, H, T, D, device=device, dtype=dtype, generator=g) for _ in range(4))


# -- 1. attention kernels ------------------------------------------------------------------------
def attention_rows(device, dtype, shapes, smoke: bool) -> list[dict]:
    from fa_forensics.replay.stable import plain_attention, stable_attention

    impls = {  # backend "triton": the Triton kernels also for the CPU tensors of --smoke (interpreted)
        "sdpa": lambda q, k, v, causal: F.scaled_dot_product_attention(q, k, v, is_causal=causal),
        "stable": lambda q, k, v, causal: stable_attention(q, k, v, causal=causal, backend="triton"),
        "plain": lambda q, k, v, causal: plain_attention(q, k, v, causal=causal, backend="triton"),
    }
    rows = []
    for shape in shapes:
        B, H, T, D, causal = shape
        q, k, v, do = _inputs(shape, device, dtype)
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


# -- 3. levers of the forward --------------------------------------------------------------------
_PROBE = """
import torch
from fa_forensics.replay.triton import fast_attention as fast
from fa_forensics.replay.triton.fast_tiles import KernelOptions
for D, causal in ((64, True), (128, True), (64, False), (128, False)):
    q = torch.randn(1, 2, 256, D, device="cuda", dtype=torch.bfloat16)
    fast.forward(q, q, q, causal=causal, scale=D ** -0.5, stable=True, options=KernelOptions(**{kw}))
torch.cuda.synchronize()
"""


def _builds_in_a_child(kw: dict) -> str | None:
    """None when the forward with options `kw` compiles and runs in a child process, else why not. A lever a
    compiler cannot build may abort the process (an LLVM fatal error), so it is tried apart first."""
    import subprocess

    try:
        proc = subprocess.run([sys.executable, "-c", _PROBE.replace("{kw}", repr(kw))], capture_output=True,
                              text=True, timeout=240, env=os.environ | {"PYTHONPATH": os.pathsep.join(sys.path)})
    except subprocess.TimeoutExpired:
        return "compiling it took more than 240 s"
    if proc.returncode == 0:
        return None
    tail = [line for line in (proc.stderr or proc.stdout).splitlines() if line.strip()]
    return f"exit {proc.returncode}: {tail[-1][:240] if tail else 'no message'}"


def lever_rows(device, dtype, shapes, attention, smoke: bool, budget: Budget) -> list[dict]:
    """Per shape: the stabilized forward with each lever beside the default (same call, same tiles); shapes the
    budget has no room for are left out (a row says so)."""
    from fa_forensics.replay.triton import fast_attention as fast
    from fa_forensics.replay.triton.fast_tiles import KernelOptions

    sdpa_fwd = {(r["T"], r["D"], r["causal"]): r["ms"]["sdpa"]["fwd"] for r in attention}
    unbuilt = {} if smoke else {name: why for name, why in
                                (("warp_specialize", _builds_in_a_child(LEVERS["warp_specialize"])),) if why}
    rows = []
    for shape in shapes:
        B, H, T, D, causal = shape
        if not budget.allows(20):
            rows.append({"B": B, "H": H, "T": T, "D": D, "causal": causal, "skipped": "time budget"})
            continue
        q, k, v, _ = _inputs(shape, device, dtype)
        scale = D ** -0.5

        def run(options, stable=True, **extra):
            return fast.forward(q, k, v, causal=causal, scale=scale, stable=stable, options=options, **extra)

        default = run(KernelOptions())
        base_ms = bench_ms(functools.partial(run, KernelOptions()), smoke)
        plain_ms = bench_ms(functools.partial(run, KernelOptions(), False), smoke)
        row = {"B": B, "H": H, "T": T, "D": D, "causal": causal,
               "default_ms": base_ms, "plain_ms": plain_ms, "levers": {}}
        for name, kw in [*LEVERS.items(), *FORWARD_EXTRAS.items(), ("plain+tma", dict(tma=True))]:
            extra = FORWARD_EXTRAS.get(name, {})
            options, stable = KernelOptions(**({} if extra else kw)), not name.startswith("plain")
            if name in unbuilt:
                row["levers"][name] = {"error": f"not built in a child process: {unbuilt[name]}"}
                continue
            try:
                out = run(options, stable, **extra)
                ms = bench_ms(functools.partial(run, options, stable, **extra), smoke)
            except Exception as exc:  # a lever this device's Triton cannot build
                row["levers"][name] = {"error": _error_text(exc)}
                continue
            ref_ms = base_ms if stable else plain_ms
            same = (torch.equal(out[0], default[0]) and torch.equal(out[1], default[1])) if stable else None
            row["levers"][name] = {"ms": ms, "speedup_vs_default": ref_ms / ms, "same_bits_as_default": same}
            if stable:
                row["levers"][name]["fix_cost_with_plain"] = ms / plain_ms - 1
                sd = sdpa_fwd.get((T, D, causal))
                if sd:
                    row["levers"][name]["fwd_vs_sdpa"] = sd / ms
        rows.append(row)
    return rows


# -- 5. autotune beside the table ----------------------------------------------------------------
def autotune_rows(device, dtype, shapes, smoke: bool, budget: Budget) -> dict:
    from fa_forensics.replay.triton import fast_attention as fast
    from fa_forensics.replay.triton.fast_tiles import KernelOptions

    if smoke:
        return {"skipped": "--smoke: the interpreter runs one fixed config"}
    tuned = KernelOptions(tuning="autotune")
    rows = []
    for shape in shapes:
        B, H, T, D, causal = shape
        if not budget.allows(45):
            rows.append({"B": B, "H": H, "T": T, "D": D, "causal": causal, "skipped": "time budget"})
            continue
        q, k, v, do = _inputs(shape, device, dtype)
        scale = D ** -0.5
        row = {"B": B, "H": H, "T": T, "D": D, "causal": causal}
        o, lse2 = fast.forward(q, k, v, causal=causal, scale=scale, stable=True, options=KernelOptions())
        o_t, lse2_t = fast.forward(q, k, v, causal=causal, scale=scale, stable=True, options=tuned)
        g = fast.backward(q, k, v, o, lse2, do, causal=causal, scale=scale, options=KernelOptions())
        g_t = fast.backward(q, k, v, o, lse2, do, causal=causal, scale=scale, options=tuned)
        row["same_bits_as_table"] = {"fwd": bool(torch.equal(o, o_t) and torch.equal(lse2, lse2_t)),
                                     "bwd": all(bool(torch.equal(a, b)) for a, b in zip(g, g_t))}
        for name, options in (("table", KernelOptions()), ("autotune", tuned)):
            row[name] = {
                "fwd_ms": bench_ms(lambda: fast.forward(q, k, v, causal=causal, scale=scale, stable=True,
                                                        options=options), smoke),
                "bwd_ms": bench_ms(lambda: fast.backward(q, k, v, o, lse2, do, causal=causal, scale=scale,
                                                         options=options), smoke)}
        rows.append(row)
    return {"rows": rows, "picks": fast.autotuned_picks()}


# -- 2 and 4. training steps ---------------------------------------------------------------------
class AttentionHook:
    """Hands every SDPA call of the demo model to `observe(layer, q, k, scale, causal, module)` on batch rows 0:2
    (capture's default slice), then runs SDPA. Installed on the demo model's module only while a case runs."""

    def __init__(self, model, observe):
        self.model, self.observe, self.layer = model, observe, 0

    def __call__(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kw):
        self.observe(self.layer, q[:2], k[:2], scale, is_causal, self.model.transformer.h[self.layer].attn)
        self.layer += 1
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                                              scale=scale, **kw)


def _with_hook(demo, hook):
    """Swap the demo model module's F for one whose SDPA is `hook` (torch's own F stays untouched)."""
    patched = types.ModuleType("F")
    patched.__dict__.update(F.__dict__)
    patched.scaled_dot_product_attention = hook
    demo.F = patched


def training_rows(device, smoke: bool, quick: bool, budget: Budget, result: dict, json_path) -> dict:
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

    def step(net):
        idx = torch.randint(0, config.vocab_size, (batch, config.block_size), device=device, generator=gen)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            _, loss = net(idx, idx)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def timed(net, n, each=None) -> float:
        """Median ms of n steps; each = (begin(i), end()) is called inside every step's timing."""
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
    result["training_step"] = out
    for _ in range(2):
        step(model)  # warm-up (cuBLAS, allocator)
    plain_ms = timed(model, steps)
    collector = StepCollector(eps=1e-3, background=True)

    def observe(layer, q, k, scale, causal, module):
        collector.observe_call(layer, q, k, scale=scale, causal=causal, p_dtype=torch.bfloat16, module=module,
                               module_name=f"transformer.h.{layer}.attn")

    hook = AttentionHook(model, observe)
    _with_hook(demo, hook)
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
    _write_partial(result, json_path)
    out["capture"] = capture_rows(model, step, timed, steps, smoke, budget)
    _write_partial(result, json_path)
    out["monitor_statistics"] = (monitor_rows(model, demo, timed, steps, plain_ms, smoke)
                                 if budget.allows(45) else {"skipped": "time budget"})
    return out


def monitor_rows(model, demo, timed, steps, plain_ms, smoke: bool) -> dict:
    """The statistics alone (no W_Q norms, no timeline): every row, a 1/16 sample, the sample on a side stream, and
    every row's max logit and top-1 (the kernel's pass 1) with the counts of the sample, on a side stream."""
    from fa_forensics.monitor.sampled import rows_for_fraction, sample_rows, sampled_rows
    from fa_forensics.monitor.side_stream import SideStream
    from fa_forensics.monitor.stats import head_statistics

    device = next(model.parameters()).device
    side = SideStream(device)
    gen = torch.Generator().manual_seed(0)
    pending: list = []

    def every_row(layer, q, k, scale, causal, module):
        pending.append(head_statistics(q, k, scale=scale, causal=causal, p_dtype=torch.bfloat16,
                                       score_dtype=torch.bfloat16, to_cpu=False))

    def sampled(on_side):
        def observe(layer, q, k, scale, causal, module):
            rows = sample_rows(q.shape[0], q.shape[2], rows_for_fraction(q.shape[2], SAMPLE_FRACTION), gen)

            def work():
                return sampled_rows(q, k, rows, scale=scale, causal=causal, p_dtype=torch.bfloat16,
                                    score_dtype=torch.bfloat16)
            pending.append(side.run(work, q, k) if on_side else work())
        return observe

    def max_top1_every_row_and_sampled(layer, q, k, scale, causal, module):
        """Max logit and top-1 of every row from the kernel's pass 1 alone, the counts from the sample: what a
        monitor of an attention that exposes no row maxima (SDPA) can do."""
        from fa_forensics.replay.triton.monitor_kernel import row_statistics

        rows = sample_rows(q.shape[0], q.shape[2], rows_for_fraction(q.shape[2], SAMPLE_FRACTION), gen)
        alpha = scale if scale is not None else q.shape[-1] ** -0.5

        def work():
            rowmax, _, _, rowsum = row_statistics(q, k, scale=alpha, causal=causal, eps=1e-3, p_dtype=torch.bfloat16,
                                                  score_dtype=torch.bfloat16, counts=False)
            counts = sampled_rows(q, k, rows, scale=scale, causal=causal, p_dtype=torch.bfloat16,
                                  score_dtype=torch.bfloat16)
            return counts, rowmax.amax(dim=(0, 2)), (1.0 / rowsum).nanmean(dim=(0, 2))
        pending.append(side.run(work, q, k))

    def end_max_top1_and_sampled():
        side.join()
        for counts, _, _ in pending:
            counts.estimate()
        torch.stack([torch.stack([m, t]) for _, m, t in pending]).cpu()
        pending.clear()

    def end_every_row():
        torch.stack([s.near_max_ties for s in pending]).cpu()  # the step's one synchronization
        pending.clear()

    def end_sampled():
        side.join()
        for rows in pending:
            rows.estimate()
        pending.clear()

    out = {"sample_fraction": SAMPLE_FRACTION, "ms": {}, "ratio_to_plain": {}}
    for name, observe, end in (("every_row", every_row, end_every_row), ("sampled", sampled(False), end_sampled),
                               ("sampled_side_stream", sampled(True), end_sampled),
                               ("max_top1_every_row+sampled_side_stream", max_top1_every_row_and_sampled,
                                end_max_top1_and_sampled)):
        hook = AttentionHook(model, observe)
        _with_hook(demo, hook)
        try:
            def begin(i, hook=hook):
                hook.layer = 0
            timed(model, 1, (begin, end))  # warm-up: the kernels compile
            ms = timed(model, steps, (begin, end))
        except Exception as exc:
            out["ms"][name] = {"error": _error_text(exc)}
            continue
        finally:
            demo.F = F
        out["ms"][name] = ms
        out["ratio_to_plain"][name] = ms / plain_ms
    return out


def _compile_work() -> dict:
    """Frames dynamo traced, graphs, inductor graphs compiled (cache hits included), from torch's counters."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return {"frames": counters["frames"]["total"], "graphs": counters["stats"]["unique_graphs"],
            "inductor_graphs": sum(inductor[k] for k in ("fxgraph_cache_hit", "fxgraph_cache_miss",
                                                         "fxgraph_cache_bypass"))}


def capture_rows(model, step, timed, steps, smoke: bool, budget: Budget) -> dict:
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
            res["compiled"] = {"skipped": "--smoke: torch.compile on the CPU takes minutes "
                                          "(benchmarks/capture_compile_overhead.py measures it there)"}
            return res
        if not budget.allows(150):
            res["compiled"] = {"skipped": "time budget"}
            return res
        compiled = torch.compile(model)
        for _ in range(3):
            step(compiled)
        compiled_ms = timed(compiled, max(3, steps // 2))
        work = [_compile_work()]
        session = []
        with fa_forensics.capture(compiled, out=f"{scratch}/compiled.zarr", steps=[2], batch=slice(0, 1)):
            for _ in range(4):  # steps 0, 1 (unselected), 2 (recorded), 3
                session.append(timed(compiled, 1))
                work.append(_compile_work())
        res["compiled"] = {
            "step_ms": compiled_ms,
            "session_steps_ms": session,
            "recorded_step": 2,
            "compiled_at_session_start": {k: work[1][k] - work[0][k] for k in work[0]},
            "compiled_at_recorded_step": {k: work[3][k] - work[2][k] for k in work[0]},
            "compiled_after_first_session_step": {k: work[4][k] - work[1][k] for k in work[0]},
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
    budget = Budget(args.budget_s)
    device = torch.device("cpu" if args.smoke else "cuda")
    if args.smoke:  # fp32: the interpreter's own bf16 dots are wrong (tests/triton/interpreter_compat.py)
        dtype = torch.float32
        shapes = [(1, 2, 64, 16, True), (1, 2, 64, 32, False)]
    else:
        dtype = torch.bfloat16
        shapes = [(8192 // T, 1024 // D, T, D, causal) for T in ((1024,) if args.quick else (1024, 4096))
                  for D in (64, 128) for causal in (True, False)]
    result = {"environment": environment(device), "dtype": str(dtype).replace("torch.", ""),
              "budget_s": args.budget_s, "attention": []}
    for shape in shapes:  # the JSON is rewritten after each part, so a run cut short keeps what it measured
        result["attention"] += attention_rows(device, dtype, [shape], args.smoke)
        _write_partial(result, args.json)
    training_rows(device, args.smoke, args.quick, budget, result, args.json)
    _write_partial(result, args.json)
    result["levers"] = (lever_rows(device, dtype, shapes, result["attention"], args.smoke, budget)
                        if budget.allows(60) else {"skipped": "time budget"})
    _write_partial(result, args.json)
    causal_shapes = [s for s in shapes if s[4] and s[2] == shapes[0][2]]
    result["autotune"] = (autotune_rows(device, dtype, causal_shapes, args.smoke, budget) if budget.allows(90)
                          else {"skipped": "time budget"})
    result["summary"] = summary(result)
    result["wall_s"] = time.perf_counter() - budget.t0
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(render_markdown(result))
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
    step = result["training_step"]
    worst["monitored_step_ratio"] = step["ratio"]["monitored"]
    monitor = step.get("monitor_statistics", {}).get("ratio_to_plain", {})
    for name, ratio in monitor.items():
        worst[f"monitor_{name}_step_ratio"] = ratio
    compiled = step.get("capture", {}).get("compiled", {})
    if "compiled_at_recorded_step" in compiled:
        worst["compiled_capture_graphs_at_recorded_step"] = compiled["compiled_at_recorded_step"]["graphs"]
        worst["compiled_capture_recorded_step_ms"] = compiled["session_steps_ms"][compiled["recorded_step"]]
    if isinstance(result.get("levers"), list):
        for name in (*LEVERS, *FORWARD_EXTRAS, "plain+tma"):
            ok = [r["levers"][name] for r in result["levers"] if "ms" in r.get("levers", {}).get(name, {})]
            if ok:
                worst[f"lever_{name}_speedup_min"] = min(x["speedup_vs_default"] for x in ok)
                worst[f"lever_{name}_speedup_max"] = max(x["speedup_vs_default"] for x in ok)
                if name in LEVERS or name in FORWARD_EXTRAS:
                    worst[f"lever_{name}_same_bits"] = all(x["same_bits_as_default"] for x in ok)
    worst["targets"] = {"fwd_vs_sdpa": 0.9, "bwd_vs_sdpa": 0.8, "fix_cost": 0.03, "monitored_step_ratio": 1.03,
                        "compiled_capture_recorded_step_s": 1.0}
    return worst


if __name__ == "__main__":
    sys.exit(main())
