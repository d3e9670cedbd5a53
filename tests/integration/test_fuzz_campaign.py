"""The fuzz campaign as a test: a corpus of damaged stores, bad safetensors files and bad arguments,
generated here, and every command run over it.

What must hold for every (command, case): no traceback; exactly one line on stderr; never exit 0 on a
damaged store (each damaged store has one step, so any exit-0 result would be built on damaged data;
`info` describes metadata and reads no values, so damage inside chunk bytes is for `verify` to find);
`verify` exits 1 on damage and 2 on what is not a dump. A store with a stray file is not damaged: every
command reads it without a warning line. The counts are printed (pytest -s) for the report.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import save_file
from typer.testing import CliRunner

from fa_forensics.cli import app

LAYER = Path("step_000000000") / "layer_000"
DUMP_COMMANDS = ["info", "verify", "export", "isolate", "delta-bias", "rank1-sim", "pv-trace", "bitdiff", "fix-check",
                 "pcast", "timeline", "report"]
EXTRA = {"export": ["--to", "{tmp}/out.safetensors"], "report": ["--out", "{tmp}/report"]}


def _edit(path: Path, fn: Callable[[dict], None]) -> None:
    meta = json.loads(path.read_text())
    fn(meta)
    path.write_text(json.dumps(meta))


def _chunk(p: Path, array: str = "q", key: str = "c.0.1.0.0") -> Path:
    return p / LAYER / array / key


def _truncate(p):
    c = _chunk(p)
    c.write_bytes(c.read_bytes()[: len(c.read_bytes()) // 2])


def _flip(p):
    c = _chunk(p, "v")
    b = bytearray(c.read_bytes())
    b[len(b) // 2] ^= 0x01
    c.write_bytes(bytes(b))


def _garbage(p):
    _chunk(p, "k").write_bytes(os.urandom(200))


def _empty_chunk(p):
    _chunk(p, "o").write_bytes(b"")


def _link_out(p):
    """A chunk replaced by a link to a valid copy of itself outside the store."""
    c = _chunk(p, "k")
    outside = p.parent / f"{p.name}.outside-chunk"
    outside.write_bytes(c.read_bytes())
    c.unlink()
    c.symlink_to(outside)


def _chunk_dir(p):
    c = _chunk(p, "do")
    c.unlink()
    c.mkdir()


def _special(kind: str):
    """A metadata file or chunk replaced by a FIFO (or a copy of /dev/zero where mknod is allowed)."""
    def plant(p: Path) -> None:
        from tests.helpers.hostile import char_device

        target = p / LAYER / "zarr.json" if kind == "layer-json" else _chunk(p, "q")
        target.unlink()
        if kind == "chunk-zero" and char_device(target, 1, 5):
            return
        os.mkfifo(target)
    return plant


def _bomb(p):
    from tests.helpers.hostile import rle_bomb

    _chunk(p, "q").write_bytes(rle_bomb(2**28))


def _claims(p):
    from tests.helpers.hostile import claiming_frame

    _chunk(p, "k").write_bytes(claiming_frame(10**12))


def _codec(name: str | None = None, **config):
    def edit(m):
        m["codecs"][1] = {"name": name, **({"configuration": config} if config else {})} if name else m["codecs"][1]
        if not name:
            m["codecs"][1]["configuration"].update(config)
    return lambda p: _edit(p / LAYER / "q" / "zarr.json", edit)


def _layer_attr(**attrs):
    return lambda p: _edit(p / LAYER / "zarr.json", lambda m: m["attributes"].update(attrs))


DAMAGE: dict[str, Callable[[Path], None]] = {
    "missing-chunk": lambda p: _chunk(p, "x", "c.0.0.0").unlink(),
    "chunk-is-a-folder": _chunk_dir,
    "truncated-chunk": _truncate,
    "flipped-bit": _flip,
    "garbage-chunk": _garbage,
    "empty-chunk-file": _empty_chunk,
    "bad-step-json": lambda p: (p / "step_000000000" / "zarr.json").write_text("{"),
    "bad-layer-json": lambda p: (p / LAYER / "zarr.json").write_text("[1, 2"),
    "bad-array-json": lambda p: (p / LAYER / "q" / "zarr.json").write_text("null"),
    "dtype-float32-on-bf16-bits": lambda p: _edit(p / LAYER / "q" / "zarr.json",
                                                  lambda m: m["attributes"].update(dtype="float32")),
    "dtype-unknown": lambda p: _edit(p / LAYER / "k" / "zarr.json", lambda m: m["attributes"].update(dtype="bf17")),
    "scale-is-a-string": lambda p: _edit(p / LAYER / "zarr.json", lambda m: m["attributes"].update(scale="abc")),
    "n-heads-is-a-string": lambda p: _edit(p / LAYER / "zarr.json", lambda m: m["attributes"].update(n_heads="2")),
    "heads-negative": lambda p: _edit(p / LAYER / "zarr.json", lambda m: m["attributes"].update(heads=[-1, -2])),
    "deleted-layer": lambda p: shutil.rmtree(p / LAYER),
    "deleted-array": lambda p: shutil.rmtree(p / LAYER / "v"),
    "array-shape-lies": lambda p: _edit(p / LAYER / "q" / "zarr.json", lambda m: m.update(shape=[1, 2, 32, 8])),
    "chunk-link-leaves-store": _link_out,
    "shape-claims-2e9-tokens": lambda p:
        _edit(p / LAYER / "v" / "zarr.json", lambda m: m["shape"].__setitem__(2, 2 * 10**9)),
    "shape-claims-1e12-tokens": lambda p:
        _edit(p / LAYER / "q" / "zarr.json", lambda m: m["shape"].__setitem__(2, 10**12)),
    "root-json-truncated": lambda p: (p / "zarr.json").write_text((p / "zarr.json").read_text()[:40]),
    "negative-shape": lambda p: _edit(p / LAYER / "k" / "zarr.json", lambda m: m["shape"].__setitem__(2, -16)),
    "zero-chunk-shape": lambda p: _edit(p / LAYER / "q" / "zarr.json",
                                        lambda m: m["chunk_grid"]["configuration"]["chunk_shape"].__setitem__(2, 0)),
    "shape-of-floats": lambda p: _edit(p / LAYER / "q" / "zarr.json", lambda m: m.update(shape=[1.0, 2, 16, 8])),
    "unknown-codec": _codec("no-such-codec"),
    "gzip-codec": _codec("gzip", level=1),
    "zstd-level-99": _codec(level=99),
    "v2-key-encoding": lambda p: _edit(p / LAYER / "q" / "zarr.json",
                                       lambda m: m.update(chunk_key_encoding={"name": "v2"})),
    "fill-value-text": lambda p: _edit(p / LAYER / "q" / "zarr.json", lambda m: m.update(fill_value="abc")),
    "nested-layer-json": lambda p: (p / LAYER / "zarr.json").write_text(
        '{"zarr_format": 3, "node_type": "group", "attributes": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}"),
    "layer-json-not-utf8": lambda p: (p / LAYER / "zarr.json").write_bytes(b"\xff\xfe{}"),
    "module-is-a-number": _layer_attr(module=7),
    "dropout-is-text": _layer_attr(dropout_p="lots"),
    "mask-unknown": _layer_attr(mask="sometimes"),
    "heads-longer-than-stored": _layer_attr(heads=list(range(50_000))),
    "loss-is-text": lambda p: _edit(p / "step_000000000" / "zarr.json", lambda m: m["attributes"].update(loss="x")),
    "model-is-a-list": lambda p: _edit(p / "zarr.json", lambda m: m["attributes"]["fa_forensics"].update(model=[1])),
    "layer-json-is-a-fifo": _special("layer-json"),
    "chunk-is-a-fifo": _special("chunk"),
    "chunk-is-dev-zero": _special("chunk-zero"),
    "zstd-bomb-chunk": _bomb,
    "frame-claims-1e12-bytes": _claims,
}

BAD_SAFETENSORS: dict[str, Callable[[Path], None]] = {
    "zero-bytes": lambda f: f.write_bytes(b""),
    "random-bytes": lambda f: f.write_bytes(os.urandom(300)),
    "huge-header-length": lambda f: f.write_bytes((10**12).to_bytes(8, "little") + b"{}"),
    "truncated": lambda f: (save_file({"step1.layer0.q": torch.ones(1, 2, 8, 4)}, f),
                            f.write_bytes(f.read_bytes()[:-20])),
    "bad-name": lambda f: save_file({"step1.layer0.w": torch.ones(1, 1, 2, 2)}, f),
    "duplicate-after-parse": lambda f: save_file({"step1.layer0.q": torch.ones(1, 1, 2, 2),
                                                  "step001.layer0.q": torch.ones(1, 1, 2, 2)}, f),
    "step-too-large": lambda f: save_file({"step1234567890.layer0.q": torch.ones(1, 1, 2, 2)}, f),
    "shape-mismatch": lambda f: save_file({"step1.layer0.q": torch.ones(1, 1, 16, 4),
                                           "step1.layer0.k": torch.ones(1, 1, 8, 4)}, f),
    "heads-repeated": lambda f: save_file({"step1.layer0.q": torch.ones(1, 2, 2, 2)}, f,
                                          metadata={"layer0.heads": "1,1"}),
    "int-tensor": lambda f: save_file({"step1.layer0.q": torch.ones(1, 1, 2, 2, dtype=torch.int32)}, f),
}

BAD_ARGS = {
    "step-not-a-number": ["--step", "abc"],
    "unknown-option": ["--no-such-option"],
    "step-absent": ["--step", "99"],
    "layer-absent": ["--layer", "7"],
}

COUNTS = {"cases": 0, "exit_2_one_liners": 0, "verify_exit_1": 0, "tracebacks": 0, "silent_wrong_answers": 0}


def _run(args: list[str], tmp: Path):
    result = CliRunner().invoke(app, [a.replace("{tmp}", str(tmp)) for a in args])
    out = result.stdout + result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    COUNTS["cases"] += 1
    if "Traceback" in out or (result.exception is not None and not isinstance(result.exception, SystemExit)):
        COUNTS["tracebacks"] += 1
    return result, lines, out


def _expect_refusal(args, tmp, verify_code=2):
    result, lines, out = _run(args, tmp)
    whole_store = any(f"/{name}.zarr" in args[1] for name in STORE_DAMAGE)
    want = verify_code if args[0] == "verify" and not whole_store else 2  # no readable root: not a dump (2)
    if result.exit_code == 0:
        COUNTS["silent_wrong_answers"] += 1
    assert result.exit_code == want, f"{args}: exit {result.exit_code}\n{out}"
    assert "Traceback" not in out and "unexpected" not in out, out
    assert len(lines) == 1, f"{args}: expected one stderr line, got:\n{result.stderr}"
    COUNTS["verify_exit_1" if want == 1 else "exit_2_one_liners"] += 1


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, dump_builder):
    """One small single-step dump per kind of damage, and one bad safetensors file per kind."""
    build_dump = dump_builder
    root = tmp_path_factory.mktemp("fuzz")
    dumps = {}
    for name, damage in DAMAGE.items():
        path = build_dump(root / f"{name}.zarr", steps=(0,), heads=2, seq=16, head_dim=8)
        damage(path)
        dumps[name] = path
    stray = build_dump(root / "stray-file.zarr", steps=(0,))
    (stray / "notes.txt").write_text("a file zarr does not know")
    (stray / "step_000000000" / ".DS_Store").write_bytes(b"\0")
    files = {}
    for name, make in BAD_SAFETENSORS.items():
        f = root / f"{name}.safetensors"
        make(f)
        files[name] = f
    yield {"dumps": dumps, "stray": stray, "files": files, "root": root}
    print(f"\nfuzz campaign: {COUNTS}")


# Damage inside chunk bytes: found when values are read (or by verify); `info` reads no values.
VALUE_DAMAGE = {"truncated-chunk", "flipped-bit", "garbage-chunk", "empty-chunk-file", "zstd-bomb-chunk",
                "frame-claims-1e12-bytes"}
# Damage of the whole store (no step of it can be read): every command refuses the dump itself.
STORE_DAMAGE = {"root-json-truncated", "model-is-a-list"}


@pytest.mark.parametrize("command", DUMP_COMMANDS)
def test_every_command_refuses_every_damaged_store_in_one_line(command, corpus, tmp_path):
    for name, path in corpus["dumps"].items():
        if command == "info" and name in VALUE_DAMAGE:
            continue
        _expect_refusal([command, str(path), *EXTRA.get(command, [])], tmp_path, verify_code=1)
        assert not (tmp_path / "out.safetensors").exists(), name


@pytest.fixture(scope="module")
def two_step_corpus(tmp_path_factory, dump_builder):
    """Each kind of metadata damage planted in step 0 of a two-step dump; step 1 is healthy."""
    root = tmp_path_factory.mktemp("fuzz-two-steps")
    dumps = {}
    for name, damage in DAMAGE.items():
        if name in STORE_DAMAGE or name in VALUE_DAMAGE:
            continue
        path = dump_builder(root / f"{name}.zarr", steps=(0, 1), heads=2, seq=16, head_dim=8)
        damage(path)
        dumps[name] = path
    return dumps


def test_damage_in_one_step_never_blocks_the_healthy_steps(two_step_corpus, tmp_path):
    """Every kind of metadata damage in step 0: an analysis runs on step 1 and says in one warning line which file
    of step 0 is damaged; info describes step 1 and lists step 0 as damaged; verify exits 1. (Damage inside chunk
    bytes is found when the values are read, or by verify.)"""
    for name, path in two_step_corpus.items():
        result, lines, out = _run(["isolate", str(path)], tmp_path)
        assert result.exit_code in (0, 1), f"{name}: exit {result.exit_code}\n{out}"
        assert "Traceback" not in out and "unexpected" not in out, out
        assert len(lines) == 1 and lines[0].startswith("warning: damaged: ") and "step_000000000" in lines[0] and \
            "step(s) 0 are damaged and are skipped" in lines[0], f"{name}: {result.stderr}"
        info, _, _ = _run(["info", str(path)], tmp_path)
        assert info.exit_code == 0 and "damaged steps" in info.stdout, f"{name}: {info.stdout}"
        verified, _, _ = _run(["verify", str(path)], tmp_path)
        assert verified.exit_code == 1, name


@pytest.mark.parametrize("command", ["info", "verify", "export", "isolate", "timeline"])
def test_a_stray_file_is_not_damage_and_gives_no_warning(command, corpus, tmp_path):
    args = [command, str(corpus["stray"]), *EXTRA.get(command, [])]
    result, lines, out = _run(args, tmp_path)
    if command == "timeline":  # the dump has no timeline: a one-line refusal, nothing about the stray files
        assert result.exit_code == 2 and len(lines) == 1 and "notes.txt" not in out
        return
    assert result.exit_code == 0, out
    assert lines == [], result.stderr


def test_import_refuses_every_bad_file_in_one_line(corpus, tmp_path):
    for name, f in corpus["files"].items():
        _expect_refusal(["import", str(f), "--to", str(tmp_path / f"{name}.zarr")], tmp_path)
        assert not (tmp_path / f"{name}.zarr").exists(), name
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no temporary store or lock file left behind


@pytest.mark.parametrize("case", list(BAD_ARGS))
def test_bad_arguments_are_one_line_for_every_command_that_takes_them(case, tmp_path, make_dump):
    dump = make_dump("ok.zarr", steps=(0,))
    for command in ["info", "export", "isolate", "delta-bias", "rank1-sim", "pv-trace", "bitdiff", "fix-check",
                    "pcast"]:
        _expect_refusal([command, str(dump), *BAD_ARGS[case], *EXTRA.get(command, [])], tmp_path)


WRITES = {  # every command that writes, with the path a planted link sits at
    "import-lock": (["import", "{src}", "--to", "{tmp}/d.zarr"], "d.zarr.lock"),
    "import-store": (["import", "{src}", "--to", "{tmp}/d.zarr"], "d.zarr"),
    "export": (["export", "{dump}", "--to", "{tmp}/e.safetensors", "--overwrite"], "e.safetensors"),
    "synth-lock": (["synth", "--out", "{tmp}/s.zarr", "--seq", "64", "--head-dim", "16", "--steps", "1"],
                   "s.zarr.lock"),
    "report": (["report", "{dump}", "--out", "{tmp}/r"], "r"),
    "json": (["info", "{dump}", "--json", "{tmp}/i.json"], "i.json"),
}


@pytest.mark.parametrize("case", list(WRITES))
def test_a_planted_link_is_never_written_through(case, tmp_path, make_dump):
    args, link = WRITES[case]
    src = tmp_path / "in.safetensors"
    save_file({"step1.layer0.q": torch.ones(1, 2, 8, 4)}, src)
    dump = make_dump("ok.zarr", steps=(0,))
    victim = tmp_path / "victim"
    victim.write_text("owned by someone else")
    (tmp_path / link).symlink_to(victim)
    _expect_refusal([a.replace("{src}", str(src)).replace("{dump}", str(dump)) for a in args], tmp_path)
    assert victim.read_text() == "owned by someone else"


def test_campaign_counts():
    """Runs last in this module (pytest keeps file order): the tally over every case above."""
    assert COUNTS["tracebacks"] == 0 and COUNTS["silent_wrong_answers"] == 0
    print(f"\nfuzz campaign: {COUNTS}")
