"""`fa-forensics capture` (run an unmodified training script with capture) and `fa-forensics demo-train`."""
from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from fa_forensics.capture.settings import default_of
from fa_forensics.commands.common import console, err_console, run_cli, write_json
from fa_forensics.commands.info import do_missing_text
from fa_forensics.commands.options import DebugOpt, JsonOpt
from fa_forensics.commands.errors import option as option_name
from fa_forensics.errors import InvalidSetting, UserError
from fa_forensics.monitor.alarm_settings import DEFAULTS as ALARM_DEFAULTS, WATCHED

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
                                  help="Watch the timeline (loss, max logit, top-1 probability, repeated maxima, W_Q "
                                       "norm) for non-finite values, jumps and trends; on an alarm print one line and "
                                       "record the next --alarm-steps steps in full.")]
AlarmStepsOpt = Annotated[int,
                          typer.Option("--alarm-steps", help="Steps recorded in full after an alarm.", metavar="K")]
AlarmWarmupOpt = Annotated[Optional[int], typer.Option(
    "--alarm-warmup", metavar="N",
    help=f"Monitored steps the alarm watches before a jump or trend may fire (default {ALARM_DEFAULTS.warmup}; "
         "non-finite values alarm at once): give short runs a short warm-up.")]
AlarmWindowOpt = Annotated[Optional[int], typer.Option(
    "--alarm-window", metavar="N",
    help=f"Trailing monitored values the jump test's robust z-score is taken over (default {ALARM_DEFAULTS.window}, "
         "at least 3).")]
AlarmZOpt = Annotated[Optional[float], typer.Option(
    "--alarm-z", metavar="Z",
    help=f"Robust z-score above the trailing median a jump must exceed (default {ALARM_DEFAULTS.z_threshold:g}).")]
AlarmSetOpt = Annotated[Optional[list[str]], typer.Option(
    "--alarm-set", metavar="KEY=VALUE",
    help="Any setting of the alarm rule, repeatable, e.g. --alarm-set min_rise.max_logit=2 --alarm-set trend_z=4. "
         "Keys: warmup, window, min_history, z_threshold, trend_window, trend_z, trend_persist, and min_rise.M, "
         f"persist.M, min_slope.M for M in {', '.join(WATCHED)} (defaults: docs/monitor.md).")]
MonitorTensorBoardOpt = Annotated[Optional[Path], typer.Option(
    "--monitor-tensorboard", metavar="DIR",
    help="Also write the timeline (loss, per-layer and per-head statistics, alarms) as TensorBoard event files "
         "into DIR (needs the tensorboard extra).")]
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


OPTION_OF = {"attention": "--attention", "softmax": "--softmax", "layout": "--attention ...,layout",
             "monitor_every": "--monitor-every", "alarm": "--alarm", "alarm_steps": "--alarm-steps", "ring": "--ring",
             "alarm_warmup": "--alarm-warmup", "alarm_window": "--alarm-window", "alarm_z": "--alarm-z",
             "alarm_set": "--alarm-set", "monitor_tensorboard": "--monitor-tensorboard",
             "attention_modules": "--attention-modules", "heads": "--heads", "batch": "--batch", "out": "--out"}
DEMO_OPTION_OF = {**OPTION_OF, "heads": "--capture-heads", "batch": "--capture-batch", "out": "--capture"}
NEEDED_AS = {"monitor_every": "--monitor-every N", "alarm": "--alarm"}


def alarm_rule(alarm: bool, warmup: Optional[int], window: Optional[int], z: Optional[float],
               assignments: Optional[list[str]] = None):
    """The alarm rule the options ask for (None without --alarm); InvalidSetting for a bad value."""
    from fa_forensics.monitor.alarm import AlarmRule
    from fa_forensics.monitor.alarm_settings import check_settings, parse_assignments

    check_settings(warmup, window, z, assignments)
    given = [o for o, v in (("--alarm-warmup", warmup), ("--alarm-window", window), ("--alarm-z", z),
                            ("--alarm-set", assignments)) if v]
    if given and not alarm:
        raise UserError(f"{', '.join(given)} set the alarm's rule: add --alarm (and --monitor-every N)")
    return AlarmRule.with_settings(warmup, window, z, **parse_assignments(assignments)) if alarm else None


def warn_if_warmup_covers_run(rule, monitored_steps: int) -> str | None:
    """Warn (and return the line, for --json) when the alarm was in its warm-up for every monitored step."""
    import warnings

    from fa_forensics.capture.run_script import warmup_covered_line

    line = warmup_covered_line(rule, monitored_steps)
    if line:
        warnings.warn(line, stacklevel=1)
    return line


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


def _summary_line(out: Path, outcome, several: bool) -> str:
    """One rank's line of what the store holds."""
    return (f"capture: {out}: " + (f"rank {outcome.rank}: " if several else "") + f"steps {outcome.steps}"
            + (f", incomplete {outcome.incomplete_steps}" if outcome.incomplete_steps else "")
            + (f", {outcome.monitored_steps} monitored steps in the timeline" if outcome.monitored_steps else "")
            + (f", alarms at steps {outcome.alarm_steps}" if outcome.alarm_steps else "")
            + (f"; no dO for {do_missing_text(outcome.do_missing)}" if outcome.do_missing else ""))


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
        micro_batch: Annotated[int, typer.Option(
            "--micro-batch", help="Forward pass of a step to record under gradient accumulation.")
        ] = default_of("micro_batch"),
        attention_modules: Annotated[Optional[str],
                                     typer.Option("--attention-modules",
                                                  help="Regex over module names that marks attention modules (their "
                                                       "input is X).")] = None,
        overwrite: Annotated[bool, typer.Option("--overwrite",
                                                help="Replace an existing dump at --out.")] = default_of("overwrite"),
        same_python: Annotated[bool,
                               typer.Option("--same-python/--path-python",
                                            help="Run a bare `python`/`python3` command as the interpreter "
                                                 "fa-forensics runs in (default), or as PATH resolves it.")] = True,
        allow_other_model: Annotated[bool,
                                     typer.Option("--allow-other-model",
                                                  help="Add steps to a dump at --out that holds another "
                                                       "model's steps.")] = default_of("allow_other_model"),
        monitor_every: MonitorEveryOpt = None,
        alarm: AlarmOpt = False,
        alarm_steps: AlarmStepsOpt = default_of("alarm_steps"),
        alarm_warmup: AlarmWarmupOpt = None,
        alarm_window: AlarmWindowOpt = None,
        alarm_z: AlarmZOpt = None,
        alarm_set: AlarmSetOpt = None,
        ring: RingOpt = default_of("ring"),
        monitor_tensorboard: MonitorTensorBoardOpt = None,
        attention: AttentionOpt = None,
        softmax: SoftmaxOpt = None,
        json_out: JsonOpt = None,
        debug: DebugOpt = False,
    ) -> None:
        def body():
            from fa_forensics.capture.run_script import run_script
            from fa_forensics.capture.settings import CaptureSettings

            if steps is None and monitor_every is None:
                raise UserError("nothing to capture: give --steps (e.g. 100,200) or --monitor-every N")
            with worded_settings():  # one-line errors before launching
                rule = alarm_rule(alarm, alarm_warmup, alarm_window, alarm_z, alarm_set)
                settings = CaptureSettings(
                    out=out, steps=steps, layers=layers, heads=heads, batch=batch, micro_batch=micro_batch,
                    overwrite=overwrite, allow_other_model=allow_other_model, monitor_every=monitor_every,
                    alarm=rule or False, alarm_steps=alarm_steps, ring=ring, monitor_tensorboard=monitor_tensorboard,
                    attention=tuple(attention or ()), softmax=softmax,
                    **({} if attention_modules is None else {"attention_modules": attention_modules}))
            if monitor_tensorboard is not None:  # before the run: a missing extra is one line, not a failed run
                from fa_forensics.optional import require

                require("tensorboard", "--monitor-tensorboard (TensorBoard event files of the monitor's timeline)")
            run = run_script(settings, list(command), same_python=same_python, alarm_rule=rule)
            if run.warmup_line:
                warn_if_warmup_covers_run(rule, run.outcomes[0].monitored_steps)
            write_json(json_out, run.to_json())
            if run.silent:  # the launcher or the script said why, in its own line
                raise typer.Exit(code=2)
            if run.shows_summary:
                for o in run.outcomes:
                    console.print(escape(_summary_line(out, o, run.several)), highlight=False, soft_wrap=True)
            for line in run.never_reached_lines:
                err_console.print(f"[bold yellow]warning:[/] {escape(line)}", highlight=False, soft_wrap=True)
            failure = run.failure_line()
            if failure:
                err_console.print(f"[bold red]error:[/] {escape(failure)}", highlight=False, soft_wrap=True)
            if run.exit_code:
                raise typer.Exit(code=run.exit_code)

        run_cli(debug, body)

    @app.command("demo-train",
                 help="Train the project's small GPT (bf16 autocast, pure-PyTorch FlashAttention-2) on its own corpus; "
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
        capture_batch: Annotated[str, typer.Option("--capture-batch",
                                                   help="Batch slice to record.")] = default_of("batch"),
        overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace an existing dump at --capture.")
                             ] = default_of("overwrite"),
        monitor_every: MonitorEveryOpt = None,
        alarm: AlarmOpt = False,
        alarm_steps: AlarmStepsOpt = default_of("alarm_steps"),
        alarm_warmup: AlarmWarmupOpt = None,
        alarm_window: AlarmWindowOpt = None,
        alarm_z: AlarmZOpt = None,
        alarm_set: AlarmSetOpt = None,
        ring: RingOpt = default_of("ring"),
        monitor_tensorboard: MonitorTensorBoardOpt = None,
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
            from fa_forensics.capture.settings import CaptureSettings
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
                rule = alarm_rule(alarm, alarm_warmup, alarm_window, alarm_z, alarm_set)
                capture = None if capture_out is None else CaptureSettings(
                    out=capture_out, steps=capture_steps, layers=capture_layers, heads=capture_heads,
                    batch=capture_batch, overwrite=overwrite, monitor_every=monitor_every, alarm=rule or False,
                    alarm_steps=alarm_steps, ring=ring, monitor_tensorboard=monitor_tensorboard)
            config = DemoConfig(steps=steps, seed=seed, device=device, batch_size=batch_size, lr=lr, capture=capture)

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
