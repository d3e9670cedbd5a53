"""`fa-forensics capture` (run an unmodified training script with capture) and `fa-forensics demo-train`."""
from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from fa_forensics.commands.common import console, err_console, run_cli, write_json
from fa_forensics.commands.info import do_missing_text
from fa_forensics.commands.options import DebugOpt, JsonOpt
from fa_forensics.commands.errors import option as option_name
from fa_forensics.errors import InvalidSetting, UserError

LAUNCHER = "fa_forensics.capture.launch"

StepsOpt = Annotated[Optional[str],
                     typer.Option("--steps",
                                  help="Steps to record: 100,200 or ranges 100:200:10 (stop exclusive). Step k "
                                       "precedes the (k+1)-th optimizer.step(). Optional with --monitor-every.")]
LayersOpt = Annotated[Optional[str],
                      typer.Option("--layers",
                                   help="Attention layers to record, e.g. 1 or 0,3 (default: every layer).")]
HeadsOpt = Annotated[Optional[str], typer.Option("--heads", help="Heads to record, e.g. 0,3 (default: every head).")]
MonitorEveryOpt = Annotated[Optional[int],
                            typer.Option("--monitor-every",
                                         help="Append a timeline row (loss, per-head max logit, repeated maxima, extra "
                                              "P̄=1, top-1 probability, W_Q spectral norm) every N steps.",
                                         metavar="N")]
AlarmOpt = Annotated[bool,
                     typer.Option("--alarm",
                                  help="Watch the timeline with the robust z-score rule; on an alarm print one line "
                                       "and record the next --alarm-steps steps in full.")]
AlarmStepsOpt = Annotated[int,
                          typer.Option("--alarm-steps", help="Steps recorded in full after an alarm.", metavar="K")]
AlarmWarmupOpt = Annotated[Optional[int], typer.Option(
    "--alarm-warmup", metavar="N",
    help="Monitored steps the alarm watches before it may fire (default 50): a run with no more monitored steps "
         "never alarms, so give short runs a short warm-up.")]
AlarmWindowOpt = Annotated[Optional[int], typer.Option(
    "--alarm-window", metavar="N",
    help="Trailing monitored values the alarm's robust z-score is taken over (default 20, at least 3).")]
AlarmZOpt = Annotated[Optional[float], typer.Option(
    "--alarm-z", metavar="Z",
    help="Robust z-score above the trailing median a value must exceed to be out (default 6).")]
RingOpt = Annotated[int, typer.Option("--ring",
                                      help="Keep the last K monitored steps' tensors (selected layers, batch slice) in "
                                           "host memory; an alarm writes them too.", metavar="K")]
AttentionOpt = Annotated[Optional[list[str]], typer.Option(
    "--attention", metavar="MODULE:QUALNAME[,OPTS]",
    help="Custom attention to watch (repeatable): MODULE:QUALNAME of a function or autograd Function, with options "
         "layout=BHTD|BTHD (default BHTD), o_layout=, q=/k=/v=/mask=/dropout= (a parameter name or position), "
         "out=N (O's index in a returned tuple), scale=NUMBER|NAME, causal=true|false|NAME; e.g. "
         "attention:FlashAttentionFunction or transformers.models.gpt2.modeling_gpt2:eager_attention_forward,"
         "o_layout=BTHD. SDPA, flash_attn, xformers, flex_attention, Hugging Face's attention functions and "
         "attention written as torch ops are found without it.")]
SoftmaxOpt = Annotated[Optional[str], typer.Option(
    "--softmax", metavar="RULE",
    help="Softmax of custom attention: standard, stabilized, or ENV=VALUE (stabilized when that environment "
         "variable has that value at the call, e.g. STABLE=1). Default: recorded as unknown.")]
BatchOpt = Annotated[Optional[str],
                     typer.Option("--batch",
                                  help="Slice of the batch dimension to record, e.g. 0:2 (default: the whole batch).")]


def rewrite_command(command: list[str], same_python: bool = True) -> list[str]:
    """Insert the capture launcher into a `python ...` / `torchrun ...` / `script.py ...` command line.

    same_python: a bare `python` / `python3` becomes the interpreter fa-forensics runs in
    (sys.executable), so the script sees this fa-forensics and its torch, not whatever a PATH
    shim (pyenv, conda) resolves `python` to.
    """
    if not command:
        raise UserError("no training command given; put it after --, e.g. fa-forensics capture --out run.zarr --steps "
                        "100 -- python train.py")
    exe = os.path.basename(command[0])
    if same_python and command[0] in ("python", "python3"):
        command = [sys.executable, *command[1:]]
    if exe.startswith("python"):
        i = 1
        while i < len(command) and command[i].startswith("-") and command[i] != "-m":
            i += 1  # interpreter options such as -u, -O
        if i >= len(command):
            raise UserError(f"no script in {' '.join(command)!r}; give python a script or -m module to run")
        if command[i] == "-m":
            if i + 1 >= len(command):
                raise UserError("python -m needs a module name")
            return [*command[:i], "-m", LAUNCHER, "--module", *command[i + 1:]]
        return [*command[:i], "-m", LAUNCHER, *command[i:]]
    if exe in ("torchrun",) or command[:3] == [command[0], "-m", "torch.distributed.run"]:
        for i, token in enumerate(command[1:], start=1):
            if token.endswith(".py"):
                return [*command[:i], "-m", LAUNCHER, *command[i:]]
        raise UserError("could not find the training script (a .py file) in the torchrun command")
    if command[0].endswith(".py"):
        return [sys.executable, "-m", LAUNCHER, *command]
    raise UserError(f"cannot start {command[0]!r} with capture; the command must be `python SCRIPT ...`, `python -m "
                    "MODULE ...`, `torchrun ... SCRIPT ...` or `SCRIPT.py ...`")


OPTION_OF = {"attention": "--attention", "softmax": "--softmax", "layout": "--attention ...,layout",
             "monitor_every": "--monitor-every", "alarm": "--alarm", "alarm_steps": "--alarm-steps", "ring": "--ring",
             "alarm_warmup": "--alarm-warmup", "alarm_window": "--alarm-window", "alarm_z": "--alarm-z",
             "attention_modules": "--attention-modules", "heads": "--heads", "batch": "--batch", "out": "--out"}
DEMO_OPTION_OF = {**OPTION_OF, "heads": "--capture-heads", "batch": "--capture-batch", "out": "--capture"}
NEEDED_AS = {"monitor_every": "--monitor-every N", "alarm": "--alarm"}


def alarm_rule(alarm: bool, warmup: Optional[int], window: Optional[int], z: Optional[float]):
    """The alarm rule the options ask for (None without --alarm); InvalidSetting for a bad value."""
    from fa_forensics.monitor.alarm import AlarmRule, check_settings

    check_settings(warmup, window, z)
    given = [o for o, v in (("--alarm-warmup", warmup), ("--alarm-window", window), ("--alarm-z", z)) if v is not None]
    if given and not alarm:
        raise UserError(f"{', '.join(given)} set the alarm's rule: add --alarm (and --monitor-every N)")
    return AlarmRule.with_settings(warmup, window, z) if alarm else None


def warn_if_warmup_covers_run(rule, monitored_steps: int) -> str | None:
    """Warn (and return the line, for --json) when the alarm was in its warm-up for every monitored step."""
    import warnings

    if rule is not None and 0 < monitored_steps <= rule.warmup:
        line = (f"the alarm's warm-up ({rule.warmup} monitored steps) covered all {monitored_steps} monitored "
                f"steps, so it could not fire; give a short run a short warm-up, e.g. --alarm-warmup "
                f"{max(monitored_steps // 4, 1)}")
        warnings.warn(line, stacklevel=1)
        return line
    return None


@contextmanager
def worded_settings(option_of: dict[str, str] = OPTION_OF):
    """Reword the library's InvalidSetting in this command's option names (and what to add)."""
    try:
        yield
    except InvalidSetting as exc:
        option = option_of.get(exc.setting, option_name(exc.setting))
        needs = getattr(exc, "needs", ())
        if needs:
            raise UserError(f"{option} needs {' and '.join(NEEDED_AS.get(n, n) for n in needs)}: {exc.why}") from None
        raise UserError(f"{option}: {exc.reason}") from None


NEVER_LISTED = 1000  # never_reached in --json lists at most this many steps (the warning gives them all as ranges)


def _span_text(steps: list[int], limit: int = 10) -> str:
    shown = ", ".join(map(str, steps[:limit]))
    return shown + (f", ... ({len(steps)} in all)" if len(steps) > limit else "")


CTRL_C_GRACE = 60.0  # seconds a training script that got Ctrl-C has to end (its capture writer finishes its queue)


def _wait_for(training: subprocess.Popen) -> int:
    """The training script's exit code. On Ctrl-C (which the script, in the same process group, gets too) it is
    given CTRL_C_GRACE seconds to end as it handles the interrupt, so its store is left whole and unlocked,
    then terminated; the interrupt then goes on."""
    try:
        return training.wait()
    except KeyboardInterrupt:
        try:
            training.wait(timeout=CTRL_C_GRACE)
        except subprocess.TimeoutExpired:
            training.terminate()
            try:
                training.wait(timeout=10)
            except subprocess.TimeoutExpired:
                training.kill()
                training.wait()
        raise


def _check_script(argv: list[str]) -> None:
    """The script the launcher will run must exist; a module too, when it runs in this interpreter
    (in another one the launcher checks it)."""
    import shutil

    script = argv[argv.index(LAUNCHER) + 1] if LAUNCHER in argv[:-1] else None
    if script is None:
        return
    if script != "--module":
        if not os.path.isfile(script):
            raise UserError(f"no training script at {script}; check the path in the training command")
        return
    module = argv[argv.index(LAUNCHER) + 2] if len(argv) > argv.index(LAUNCHER) + 2 else None
    exe = shutil.which(argv[0])
    if module is None or exe is None or os.path.realpath(exe) != os.path.realpath(sys.executable):
        return
    import importlib.util

    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise UserError(f"no module named {module!r} to run; check the training command (python -m MODULE)")


def _store_summary(out: Path) -> dict:
    from fa_forensics.commands.info import do_missing
    from fa_forensics.dump import open_dump

    try:
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dump = open_dump(out)
            timeline = dump.timeline or {}
            alarms = timeline.get("alarms")
            return {"steps": dump.steps, "incomplete_steps": dump.incomplete_steps,
                    "layers": dump.layers() if dump.steps else [],
                    "monitored_steps": int(len(timeline.get("step", []))),
                    "alarm_steps": [] if alarms is None
                    else [int(s) for s, n in zip(timeline["step"], alarms) if n > 0],
                    "do_missing": do_missing(dump)}
    except UserError:
        return {"steps": [], "incomplete_steps": [], "layers": [], "monitored_steps": 0, "alarm_steps": [],
                "do_missing": {}}


def _launcher_report(path: str) -> dict:
    """The launcher's report (steps run, warnings said); {} when the launcher did not get to write it."""
    try:
        with open(path) as fh:
            return json.load(fh)
    except (OSError, ValueError):
        return {}


def register(app: typer.Typer) -> None:
    @app.command(
        "capture",
        help="Run a training script with capture active and record chosen steps: "
        "fa-forensics capture --out run.zarr --steps 100,200 -- python train.py ARGS...",
        context_settings={"allow_interspersed_args": False},
    )
    def capture_cmd(
        command: Annotated[list[str], typer.Argument(help="The training command, after --.", show_default=False)],
        out: Annotated[Path, typer.Option("--out", help="Dump store to write (a .zarr directory).")],
        steps: StepsOpt = None,
        layers: LayersOpt = None,
        heads: HeadsOpt = None,
        batch: BatchOpt = None,
        micro_batch: Annotated[int,
                               typer.Option("--micro-batch",
                                            help="Forward pass of a step to record under gradient accumulation.")] = 0,
        attention_modules: Annotated[Optional[str],
                                     typer.Option("--attention-modules",
                                                  help="Regex over module names that marks attention modules (their "
                                                       "input is X).")] = None,
        overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing dump at --out.")] = False,
        same_python: Annotated[bool,
                               typer.Option("--same-python/--path-python",
                                            help="Run a bare `python`/`python3` command as the interpreter "
                                                 "fa-forensics runs in (default), or as PATH resolves it.")] = True,
        allow_other_model: Annotated[bool,
                                     typer.Option("--allow-other-model",
                                                  help="Add steps to a dump at --out that holds another "
                                                       "model's steps.")] = False,
        monitor_every: MonitorEveryOpt = None,
        alarm: AlarmOpt = False,
        alarm_steps: AlarmStepsOpt = 3,
        alarm_warmup: AlarmWarmupOpt = None,
        alarm_window: AlarmWindowOpt = None,
        alarm_z: AlarmZOpt = None,
        ring: RingOpt = 0,
        attention: AttentionOpt = None,
        softmax: SoftmaxOpt = None,
        json_out: JsonOpt = None,
        debug: DebugOpt = False,
    ) -> None:
        def body():
            import tempfile

            from fa_forensics.capture.targets import TargetSpec
            from fa_forensics.capture.launch import ENV_VAR
            from fa_forensics.capture.softmax_variant import SoftmaxVariant
            from fa_forensics.capture.selection import CaptureSelection

            from fa_forensics.capture.selection import check_attention_pattern, check_monitor_options

            if steps is None and monitor_every is None:
                raise UserError("nothing to capture: give --steps (e.g. 100,200) or --monitor-every N")
            with worded_settings():  # one-line errors before launching
                check_monitor_options(monitor_every, alarm, alarm_steps, ring)
                rule = alarm_rule(alarm, alarm_warmup, alarm_window, alarm_z)
                if attention_modules is not None:
                    check_attention_pattern(attention_modules)
                targets = [TargetSpec.parse(t).to_text() for t in attention or ()]
                softmax_rule = SoftmaxVariant.parse(softmax).to_text()
            selection = CaptureSelection.build(steps, layers, heads, batch, micro_batch,
                                               allow_no_steps=monitor_every is not None)
            argv = rewrite_command(list(command), same_python=same_python)
            _check_script(argv)
            from fa_forensics.dump.safe_files import refuse_link

            refuse_link(out, "out")  # resolving --out would follow a planted link; the writer refuses one too
            settings = {"out": str(Path(out).resolve()), **selection.to_text(), "overwrite": overwrite,
                        "allow_other_model": allow_other_model,
                        "attention_modules": attention_modules, "command": list(command),
                        "monitor_every": monitor_every, "alarm": rule.settings() if rule else False,
                        "alarm_steps": alarm_steps, "ring": ring, "attention": targets, "softmax": softmax_rule}
            with tempfile.TemporaryDirectory(prefix="fa-forensics-capture-") as tmp:
                settings["report"] = os.path.join(tmp, "report.json")
                env = {**os.environ, ENV_VAR: json.dumps(settings)}
                try:
                    training = subprocess.Popen(argv, env=env)
                except OSError as exc:
                    raise UserError(f"cannot start {argv[0]!r}: {exc.strerror or exc}; "
                                    "check the training command") from exc
                code = _wait_for(training)
                report = _launcher_report(settings["report"])
            summary = _store_summary(out)
            recorded = set(summary["steps"]) | set(summary["incomplete_steps"])
            ran = report.get("steps_run")
            # the selection is lazy (--steps 0:10**18 is never listed): only the steps the run reached are walked
            without_attention = [] if ran is None else [s for s in selection.steps.below(ran) if s not in recorded]
            unreached = selection.steps if ran is None else selection.steps.from_step(ran)
            never = list(itertools.islice((s for s in unreached if s not in recorded), NEVER_LISTED + 1))
            never_text = _span_text(never) if len(never) <= NEVER_LISTED else unreached.to_text()
            never = never[:NEVER_LISTED]
            warnings_said = list(report.get("warnings", []))
            if never:
                warnings_said.append(f"selected step(s) {never_text} were never reached (the run made "
                                     f"{'fewer' if ran is None else ran} optimizer.step() calls); nothing recorded "
                                     "for them. Check --steps against the run's length")
            warmup_line = warn_if_warmup_covers_run(rule, summary["monitored_steps"])
            if warmup_line:
                warnings_said.append(warmup_line)
            write_json(json_out, {"out": str(out), "returncode": code, "command": list(command), **summary,
                                  "never_reached": never, "steps_run": ran, "ran_without_attention": without_attention,
                                  "warnings": warnings_said})
            recorded = bool(summary["steps"] or summary["incomplete_steps"] or summary["monitored_steps"])
            if code == 2 and not recorded:  # the launcher or the script said why, in its own line
                raise typer.Exit(code=2)
            if recorded or Path(out).exists():
                console.print(f"capture: {out}: steps {summary['steps']}"
                              + (f", incomplete {summary['incomplete_steps']}" if summary["incomplete_steps"] else "")
                              + (f", {summary['monitored_steps']} monitored steps in the timeline"
                                 if summary["monitored_steps"] else "")
                              + (f", alarms at steps {summary['alarm_steps']}" if summary["alarm_steps"] else "")
                              + (f"; no dO for {do_missing_text(summary['do_missing'])}" if summary["do_missing"]
                                 else ""))
            if never:  # said on stderr as in --json, before any error line
                err_console.print(f"[bold yellow]warning:[/] {escape(warnings_said[len(report.get('warnings', []))])}",
                                  highlight=False, soft_wrap=True)
            if code != 0:
                kept = f"steps completed before it are kept in {out}" if summary["steps"] else "nothing was recorded"
                err_console.print(f"[bold red]error:[/] the training command exited with code {code}; {kept}",
                                  highlight=False, soft_wrap=True)
                raise typer.Exit(code=code if 0 < code < 256 else 1)
            if never or without_attention:  # a step that ran without attention was said by the launcher, in one line
                raise typer.Exit(code=1)

        run_cli(debug, body)

    @app.command("demo-train",
                 help="Train the project's small GPT (bf16 autocast, pure-PyTorch FlashAttention-2) on stdlib bytes; "
                      "optionally capture steps.")
    def demo_train_cmd(
        steps: Annotated[int, typer.Option("--steps", help="Number of optimizer steps.")] = 300,
        seed: Annotated[int, typer.Option("--seed", help="Seed of the weights and the batch order.")] = 0,
        device: Annotated[str, typer.Option("--device", help="cpu or cuda.")] = "cpu",
        batch_size: Annotated[int, typer.Option("--batch-size", help="Sequences per step (context 256 bytes).")] = 4,
        lr: Annotated[float, typer.Option("--lr",
                                          help="Peak AdamW learning rate (linear warmup over 20 steps).")] = 2e-3,
        capture_out: Annotated[Optional[Path],
                               typer.Option("--capture", help="Dump store to record the --capture-steps into.",
                                            metavar="DUMP")] = None,
        capture_steps: Annotated[Optional[str],
                                 typer.Option("--capture-steps",
                                              help="Steps to record, e.g. 5,6,7 or 250:254.")] = None,
        capture_layers: Annotated[Optional[str],
                                  typer.Option("--capture-layers", help="Layers to record (default: all).")] = None,
        capture_heads: Annotated[Optional[str],
                                 typer.Option("--capture-heads", help="Heads to record (default: all).")] = None,
        capture_batch: Annotated[str, typer.Option("--capture-batch", help="Batch slice to record.")] = "0:2",
        overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing dump at --capture.")] = False,
        monitor_every: MonitorEveryOpt = None,
        alarm: AlarmOpt = False,
        alarm_steps: AlarmStepsOpt = 3,
        alarm_warmup: AlarmWarmupOpt = None,
        alarm_window: AlarmWindowOpt = None,
        alarm_z: AlarmZOpt = None,
        ring: RingOpt = 0,
        log_every: Annotated[int, typer.Option("--log-every", help="Print the loss every N steps.")] = 1,
        threads: Annotated[int, typer.Option("--threads",
                                             help="CPU threads for torch (the model is tiny: 1 avoids oversubscription "
                                                  "on shared machines).")] = 1,
        json_out: JsonOpt = None,
        debug: DebugOpt = False,
    ) -> None:
        def body():
            import torch

            from fa_forensics.capture.events import show_capture_warnings_as_lines
            from fa_forensics.demo.train import DemoConfig, train

            show_capture_warnings_as_lines()

            if threads >= 1:
                torch.set_num_threads(threads)
            if steps < 1:
                raise UserError(f"--steps must be >= 1, got {steps}")
            if batch_size < 1:
                raise UserError(f"--batch-size must be >= 1 sequence per step, got {batch_size}")
            if not (lr > 0 and math.isfinite(lr)):
                raise UserError(f"--lr must be a positive number, got {lr}")
            if log_every < 1:
                raise UserError(f"--log-every must be >= 1, got {log_every}")
            if capture_out is None and (capture_steps is not None or monitor_every is not None):
                raise UserError("--capture-steps and --monitor-every write into a store; add --capture DUMP (e.g. "
                                "--capture run.zarr)")
            if capture_out is not None and capture_steps is None and monitor_every is None:
                raise UserError("--capture DUMP needs --capture-steps (e.g. 5,6,7) or --monitor-every N")
            with worded_settings(DEMO_OPTION_OF):
                rule = alarm_rule(alarm, alarm_warmup, alarm_window, alarm_z)
            config = DemoConfig(steps=steps, seed=seed, device=device, batch_size=batch_size, lr=lr,
                                capture_out=capture_out,
                                capture_steps=capture_steps or "", capture_layers=capture_layers,
                                capture_heads=capture_heads,
                                capture_batch=capture_batch, overwrite=overwrite, monitor_every=monitor_every,
                                alarm=rule or False, alarm_steps=alarm_steps, ring=ring)

            def log(info, model):
                if info.step % max(1, log_every) == 0 or info.step == steps - 1:
                    console.print(f"step {info.step:5d}  loss {info.loss:.4f}  lr {info.lr:.2e}  "
                                  f"{info.seconds * 1000:.0f} ms")

            with worded_settings(DEMO_OPTION_OF):
                result = train(config, on_step=log)
            warn_if_warmup_covers_run(rule, result.monitored_steps)
            write_json(json_out, {"losses": list(result.losses), "final_loss": result.losses[-1],
                                  "captured_steps": list(result.captured_steps),
                                  "capture": None if capture_out is None else str(capture_out),
                                  "seconds": result.seconds, "seed": seed, "steps": steps,
                                  "monitored_steps": result.monitored_steps, "alarm_steps": list(result.alarm_steps)})
            if capture_out is not None:
                console.print(f"captured steps {list(result.captured_steps)} into {capture_out}"
                              + (f"; {result.monitored_steps} monitored steps in its timeline"
                                 if result.monitored_steps else ""))

        run_cli(debug, body)
