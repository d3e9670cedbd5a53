"""One module per CLI command (or small family of commands).

Each module exposes `register(app)`, which adds its command(s) to the typer app. A command
parses options, calls one library function, renders the result, and lets `common.run_cli`
turn a `UserError` into a one-line message with exit code 2.
"""
