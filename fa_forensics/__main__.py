"""`python -m fa_forensics ...`: the fa-forensics CLI under the interpreter that runs it."""
from fa_forensics.cli import main

if __name__ == "__main__":
    main(prog_name="python -m fa_forensics")
