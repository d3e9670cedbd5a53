"""`fa-forensics bitdiff --add`: the worked example through the CLI, its JSON, and its errors."""
import json

from typer.testing import CliRunner

from fa_forensics.cli import app

runner = CliRunner()


def test_bitdiff_add_worked_example_json(tmp_path):
    out = tmp_path / "add.json"
    r = runner.invoke(app, ["bitdiff", "--add", "-2.4071154594421387", "11000000000100110000000000000000", "--into",
                            "bf16", "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "-4.71875" in r.output and "round 1, sticky 1" in r.output
    d = json.loads(out.read_text())
    assert d["exact"] == -4.703990459442139
    assert d["exact_bits"] == "11000000100101101000011100010111"
    assert d["rounded"] == -4.71875 and d["rounded_bits"] == "1100000010010111"
    assert d["error"] == -0.014759540557861328
    assert (d["guard"], d["round"], d["sticky"], d["direction"], d["into"]) == (0, 1, 1, "up", "bf16")
    assert d["a"] == -2.4071154594421387 and d["b"] == -2.296875


def test_bitdiff_add_hex_operands_and_fp8(tmp_path):
    out = tmp_path / "h.json"
    r = runner.invoke(app, ["bitdiff", "--add", "0xc01a0e2e", "0xc0130000", "--into", "fp8_e4m3", "--json", str(out)])
    assert r.exit_code == 0, r.output
    d = json.loads(out.read_text())
    # e4m3 spacing 0.5 at 4
    assert d["exact"] == -4.703990459442139 and d["rounded"] == -4.5 and d["direction"] == "down"


def test_bitdiff_bad_input_is_one_line_exit_2():
    for args in (["bitdiff", "--add", "abc", "1"], ["bitdiff", "--add", "1", "2", "--into", "fp7"],
                 ["bitdiff", "--add", "nan", "1"], ["bitdiff"]):
        r = runner.invoke(app, args)
        assert r.exit_code == 2, args
        assert "Traceback" not in r.output
        assert "error:" in r.output


def test_bitdiff_refuses_a_dump_with_add_and_bad_sides_before_any_work(planted_dump):
    """DUMP and --add together: a one-line error, never --add run with the dump silently ignored."""
    r = runner.invoke(app, ["bitdiff", str(planted_dump), "--add", "1", "2"])
    assert r.exit_code == 2 and "not both" in r.output and "Traceback" not in r.output
    for extra, needle in ((["--a", "nope"], "'nope' is not 'dump' or a preset"),
                          (["--accumulation", "foo"],
                           "'--accumulation': 'foo' is not one of 'ieee', 'tensor-core', 'auto'"),
                          (["--backend", "foo"], "'--backend': 'foo' is not one of 'emulate', 'triton'")):
        r = runner.invoke(app, ["bitdiff", str(planted_dump), *extra])
        assert r.exit_code == 2 and needle in r.output, (extra, r.output)
        assert r.output.strip().count("\n") == 0, r.output  # one line, no progress bar residue before it
