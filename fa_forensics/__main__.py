"""`python -m fa_forensics ...`: the fa-forensics CLI under the interpreter that runs it."""
from fa_forensics.cli import app

if __name__ == "__main__":
    app(prog_name="python -m fa_forensics")
