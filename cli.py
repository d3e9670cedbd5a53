"""Run fa-forensics from a checkout without installing: `python cli.py --help`.

A shim only: the CLI lives in fa_forensics/cli.py. Not installed as a module.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from fa_forensics.cli import main  # noqa: E402

if __name__ == "__main__":
    main()
