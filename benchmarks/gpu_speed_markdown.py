"""The markdown summary of one benchmarks/gpu_speed.py result: the tables docs/gpu-speed.md records."""
from __future__ import annotations


def _x(v) -> str:
    return "–" if v is None else f"{v:.2f}×"


def _pct(v) -> str:
    return "–" if v is None else f"{100 * v:+.0f} %"


def _shape(r: dict) -> str:
    return f"{r['B']}×{r['H']}×{r['T']}×{r['D']} | {'yes' if r['causal'] else 'no'}"


def render_markdown(result: dict) -> str:
    env = result["environment"]
    lines = [f"# gpu_speed: {env.get('gpu', env['device'])}, {env['date_utc']}",
             "",
             f"torch {env['torch']}, Triton {env['triton']}, CUDA {env.get('cuda', '–')}, {result['dtype']}, "
             f"{result.get('wall_s', 0):.0f} s." + (f" {env['note']}." if "note" in env else ""),
             "",
             "## Attention (SDPA time / kernel time; fix cost = stable / plain − 1, the same tiles)",
             "",
             "| B×H×T×D | causal | SDPA TFLOP/s fwd / bwd | stable fwd / bwd | plain fwd / bwd | fix cost fwd / bwd "
             "| rel. err. |",
             "|---|---|---|---|---|---|---|"]
    for r in result["attention"]:
        s, p, t = r["speed_vs_sdpa"]["stable"], r["speed_vs_sdpa"]["plain"], r["tflops"]["sdpa"]
        err = max(v for impl in r["rel_err_vs_sdpa"].values() for v in impl.values())
        lines.append(f"| {_shape(r)} | {t['fwd']:.0f} / {t['bwd']:.0f} | {_x(s['fwd'])} / {_x(s['bwd'])} | "
                     f"{_x(p['fwd'])} / {_x(p['bwd'])} | {_pct(r['fix_cost']['fwd'])} / {_pct(r['fix_cost']['bwd'])} "
                     f"| {err:.1e} |")
    levers = result.get("levers")
    done = [r for r in levers if "levers" in r] if isinstance(levers, list) else []
    if done:
        names = list(done[0]["levers"])
        lines += ["", "## Levers of the stabilized forward (default time / lever time; = : same bits as the default)",
                  "", "| B×H×T×D | causal | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
        for r in done:
            cells = []
            for name in names:
                lv = r["levers"][name]
                if "error" in lv:
                    cells.append("failed")
                else:
                    same = {True: " =", False: " ≠", None: ""}[lv["same_bits_as_default"]]
                    cells.append(f"{_x(lv['speedup_vs_default'])}{same}")
            lines.append(f"| {_shape(r)} | " + " | ".join(cells) + " |")
        errors = {name: lv["error"] for r in done for name, lv in r["levers"].items() if "error" in lv}
        if len(done) < len(levers):
            lines.append(f"- {len(levers) - len(done)} shape(s) left out: time budget")
        lines += [f"- {name}: {err}" for name, err in errors.items()]
    elif isinstance(levers, dict):
        lines += ["", f"Levers: {levers.get('skipped', '')}"]
    auto = result.get("autotune", {})
    if "rows" in auto:
        skipped = [r for r in auto["rows"] if "skipped" in r]
        lines += ["", "## Autotune beside the table (stabilized kernel, ms)", "",
                  "| B×H×T×D | causal | table fwd / bwd | autotune fwd / bwd | same bits fwd / bwd |",
                  "|---|---|---|---|---|"]
        for r in (r for r in auto["rows"] if "skipped" not in r):
            lines.append(f"| {_shape(r)} | {r['table']['fwd_ms']:.3f} / {r['table']['bwd_ms']:.3f} | "
                         f"{r['autotune']['fwd_ms']:.3f} / {r['autotune']['bwd_ms']:.3f} | "
                         f"{r['same_bits_as_table']['fwd']} / {r['same_bits_as_table']['bwd']} |")
        if skipped:
            lines.append(f"- {len(skipped)} shape(s) left out: time budget")
        for kernel, picks in auto.get("picks", {}).items():
            for pick in picks:
                lines.append(f"- {kernel} key {', '.join(pick['key'])}: {pick['config']}")
    elif auto:
        lines += ["", f"Autotune: {auto.get('skipped', '')}"]
    step = result.get("training_step", {})
    if "ms" in step:
        c = step["config"]
        lines += ["", f"## Training step ({c['n_layer']} layers, C {c['n_embd']}, T {c['T']}, B {c['batch']}, "
                      f"medians of {c['steps_timed']} steps)", "",
                  "| case | ms | / plain |", "|---|---|---|",
                  f"| plain | {step['ms']['plain']:.1f} | 1 |",
                  f"| monitored every step (StepCollector) | {step['ms']['monitored']:.1f} | "
                  f"{_x(step['ratio']['monitored'])} |"]
        mon = step.get("monitor_statistics", {})
        for name, ms in mon.get("ms", {}).items():
            if isinstance(ms, dict):
                lines.append(f"| statistics only, {name} | failed: {ms['error']} | |")
            else:
                lines.append(f"| statistics only, {name} | {ms:.1f} | {_x(mon['ratio_to_plain'][name])} |")
        cap = step.get("capture", {})
        for key in ("unselected_ms", "monitor_every_1_ms"):
            if key in cap:
                lines.append(f"| capture, {key[:-3].replace('_', ' ')} | {cap[key]:.1f} | "
                             f"{_x(cap[key] / step['ms']['plain'])} |")
        compiled = cap.get("compiled", {})
        if "step_ms" in compiled:
            lines += ["", f"Compiled: {compiled['step_ms']:.1f} ms a step; a capture session's steps "
                          f"{', '.join(f'{t:.0f}' for t in compiled['session_steps_ms'])} ms (step "
                          f"{compiled['recorded_step']} recorded); compiled at the session's start "
                          f"{compiled['compiled_at_session_start']}, at the recorded step "
                          f"{compiled['compiled_at_recorded_step']}; graph breaks {compiled['graph_breaks_total']}."]
        elif compiled:
            lines += ["", f"Compiled capture: {compiled.get('skipped', '')}"]
    summ = result.get("summary", {})
    if summ:
        lines += ["", "## Against the targets", "",
                  f"- stable forward ≥ 0.9× SDPA: worst {_x(summ['stable_fwd_vs_sdpa_min'])}",
                  f"- stable backward ≥ 0.8× SDPA: worst {_x(summ['stable_bwd_vs_sdpa_min'])}",
                  f"- fix cost ≤ 3 %: worst forward {_pct(summ['fix_cost_fwd_max'])}, backward "
                  f"{_pct(summ['fix_cost_bwd_max'])}",
                  f"- monitored step ≤ 1.03×: {_x(summ['monitored_step_ratio'])}"]
        if "compiled_capture_graphs_at_recorded_step" in summ:
            lines.append(f"- compiled capture, nothing compiled at the recorded step or ≤ 1 s: "
                         f"{summ['compiled_capture_graphs_at_recorded_step']} graphs, "
                         f"{summ['compiled_capture_recorded_step_ms']:.0f} ms")
    return "\n".join(lines) + "\n"
