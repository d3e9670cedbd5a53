"""Every command that reads a dump takes --rank, says when the store holds several ranks (a warning line that
is in its JSON too) and names the rank in the lines that concern one; match and report take --rank all."""
from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fa_forensics.cli import app
from fa_forensics.dump import DumpWriter

runner = CliRunner()
SMALL = dict(steps=(0,), layers=(0,), heads=2, seq=16, head_dim=8)
HOLDS = "holds ranks 0, 1 of a 2-rank run: this reads rank 1 only"

# (command, its arguments after DUMP) for every command that reads a dump; JSON via --json (info, verify: the same)
READERS = {
    "info": [], "verify": [], "match": [], "isolate": ["--preset", "bf16"], "delta-bias": ["--preset", "bf16"],
    "rank1-sim": ["--preset", "bf16"], "pv-trace": ["--preset", "bf16"], "fix-check": ["--preset", "bf16"],
    "bitdiff": ["--a", "dump", "--b", "fp32"], "pcast": [], "export": ["--to", "{tmp}/x.safetensors"],
    "report": ["--out", "{tmp}/report", "--preset", "bf16"], "timeline": [],
}


@pytest.fixture(scope="module")
def stores(tmp_path_factory, dump_builder):
    """A 2-rank store whose rank 1 holds other data than rank 0, and a 1-rank store holding rank 1's data."""
    where = tmp_path_factory.mktemp("ranks")
    two, one = where / "two.zarr", where / "one.zarr"
    dump_builder(two, seed=0, world_size=2, **SMALL)
    dump_builder(two, seed=1, rank=1, world_size=2, **SMALL)
    dump_builder(one, seed=1, **SMALL)
    for rank in (0, 1):  # each rank's own timeline: its losses are 10·rank + step
        with DumpWriter(two, rank=rank, world_size=2) as writer:
            writer.append_timeline_rows([(s, {"loss": 10.0 * rank + s, "max_logit": np.full((1, 2), float(s))})
                                         for s in range(5)])
    return two, one


def _invoke(tmp_path, command: str, dump, *extra: str):
    js = tmp_path / f"{command}.json"
    args = [a.replace("{tmp}", str(tmp_path)) for a in READERS[command]]
    res = runner.invoke(app, [command, str(dump), *args, *extra, "--json", str(js)])
    return res, (json.loads(js.read_text()) if js.exists() else None)


@pytest.mark.parametrize("command", [pytest.param(c, marks=pytest.mark.slow) if c == "report" else c
                                     for c in READERS])  # report: about 3 s of CPU or more
def test_every_reader_takes_rank_and_says_the_store_holds_several(command, stores, tmp_path):
    two, _ = stores
    res, payload = _invoke(tmp_path, command, two, "--rank", "1")
    assert res.exit_code in (0, 1), res.output
    assert HOLDS in res.stderr and "Traceback" not in res.output
    assert any(HOLDS in w for w in payload["warnings"])  # every warning printed is in the JSON too
    res = runner.invoke(app, [command, str(two), *[a.replace("{tmp}", str(tmp_path)) for a in READERS[command]],
                              "--rank", "5"])
    assert res.exit_code == 2 and "rank 5 is not in" in res.stderr and "ranks: 0, 1" in res.stderr
    assert "--rank" in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_rank_1_of_a_store_reads_what_a_store_of_rank_1_alone_reads(stores, tmp_path):
    """The numbers of delta-bias --rank 1 are those of the same data in a store of its own; rank 0's differ."""
    two, one = stores
    _, of_rank_1 = _invoke(tmp_path, "delta-bias", two, "--rank", "1")
    _, alone = _invoke(tmp_path, "delta-bias", one)
    _, of_rank_0 = _invoke(tmp_path, "delta-bias", two)
    assert of_rank_1["per_step"] == alone["per_step"] and of_rank_1["total"] == alone["total"]
    assert of_rank_0["total"] != alone["total"]
    assert [w for w in of_rank_1["warnings"] if "rank" not in w] == alone["warnings"]
    assert any("this reads rank 0 only; --rank R reads another" in w for w in of_rank_0["warnings"])
    assert not any("rank" in w for w in alone["warnings"])  # a store of one rank says nothing about ranks


def test_timeline_of_a_rank_is_its_own(stores, tmp_path):
    two, _ = stores
    assert _invoke(tmp_path, "timeline", two, "--rank", "1")[1]["loss"] == [10.0, 11.0, 12.0, 13.0, 14.0]
    assert _invoke(tmp_path, "timeline", two)[1]["loss"] == [0.0, 1.0, 2.0, 3.0, 4.0]


def test_a_rank_folder_is_that_rank(stores, tmp_path):
    two, _ = stores
    _, by_option = _invoke(tmp_path, "match", two, "--rank", "1")
    _, by_folder = _invoke(tmp_path, "match", two / "rank_1")
    assert by_option["layers"] == by_folder["layers"] and by_folder["rank"] == 1 and by_folder["ranks"] == [0, 1]
    res = runner.invoke(app, ["match", str(two / "rank_1"), "--rank", "0"])
    assert res.exit_code == 2 and "is rank 1's tree of the dump" in res.stderr


def test_match_and_verify_every_rank_name_the_rank_in_each_line(stores, tmp_path):
    two, _ = stores
    res, payload = _invoke(tmp_path, "match", two, "--rank", "all")
    assert res.exit_code == 0, res.output
    assert payload["rank"] == "all" and [p["rank"] for p in payload["per_rank"]] == [0, 1]
    assert payload["per_rank"][1]["layers"] == _invoke(tmp_path, "match", two, "--rank", "1")[1]["layers"]
    assert "rank 0: step 0 layer 0: stored O reproduced" in res.stdout
    assert "rank 1: step 0 layer 0: stored O reproduced" in res.stdout
    res, payload = _invoke(tmp_path, "verify", two, "--rank", "all")
    assert res.exit_code == 0 and payload["ok"] and [p["rank"] for p in payload["per_rank"]] == [0, 1]
    assert f"{two} rank 0: 1 whole step(s)" in res.stdout and f"{two} rank 1: 1 whole step(s)" in res.stdout
    res = runner.invoke(app, ["match", str(two), "--rank", "one"])
    assert res.exit_code == 2 and "--rank 'one' is not a rank" in res.stderr


@pytest.mark.slow  # about 3 s of CPU or more
def test_report_every_rank_writes_one_report_per_rank(stores, tmp_path):
    two, _ = stores
    res, payload = _invoke(tmp_path, "report", two, "--rank", "all")
    assert res.exit_code == 0, res.output
    index = (tmp_path / "report" / "index.html").read_text()
    assert "rank_0/index.html" in index and "rank_1/index.html" in index
    for rank in (0, 1):
        page = (tmp_path / "report" / f"rank_{rank}" / "index.html").read_text()
        assert payload["per_rank"][rank]["rank"] == rank and payload["per_rank"][rank]["verdict"].startswith(
            f"rank {rank}: ")
        assert (f"fa-forensics isolate {two / 'rank_1'}" in page) == (rank == 1)  # its commands open that rank
    assert f"rank 1: {len(payload['per_rank'][1]['sections'])} of" in res.stdout
