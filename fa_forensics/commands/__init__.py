"""One module per CLI command (or small family of commands).

Each module exposes `register(app)`, which adds its command(s) to the typer app; `analysis.py` adds
every analysis registered in fa_forensics.analyses.registry, whose own bodies (bitdiff, pcast,
timeline) are the `run` of their modules here. A command parses options, calls one library function,
renders the result, and lets `common.run_cli` turn a `UserError` into a one-line message with exit code 2.
"""
