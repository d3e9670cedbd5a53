"""Fan-out on dask.distributed: a 2-worker LocalCluster gives exactly the in-process numbers."""
import json
import time

import pytest
from typer.testing import CliRunner

from fa_forensics.layers import fanout
from fa_forensics.analyses.delta_bias import compute as delta_bias
from fa_forensics.layers.fanout import Workers, map_in_order, work_items
from fa_forensics.layers.selection import select
from fa_forensics.cli import app
from fa_forensics.dump import open_dump
from fa_forensics.errors import InvalidSetting

pytestmark = pytest.mark.slow  # starts Dask worker processes

runner = CliRunner()


def _finish_in_reverse(i: int) -> int:
    time.sleep(0.3 * (3 - i))  # the first item finishes last
    return i * i


def test_delta_bias_on_two_workers_equals_in_process_bit_for_bit(planted_dump, monkeypatch):
    """Head groups of 2 (two work items per layer-step, joined again in order): every per-cell
    delta_err_sum, the totals and the features are identical in-process and on a LocalCluster of 2."""
    dump = open_dump(planted_dump)
    sels = select(dump, step=0)
    whole = delta_bias.payload(delta_bias.run(dump, sels))  # default head groups (4: one item per layer-step)
    monkeypatch.setattr(fanout, "HEADS_PER_ITEM", 2)
    assert len(work_items(sels)) == 2 * len(sels)
    seen = []
    serial = delta_bias.payload(delta_bias.run(dump, sels, progress=seen.append))
    assert len(seen) == len(work_items(sels))
    parallel = delta_bias.payload(delta_bias.run(dump, sels, workers=Workers(n=2)))
    cells = [(p.step, p.layer, p.head, p.delta_err_sum) for p in serial["per_step"]]
    assert cells == [(p.step, p.layer, p.head, p.delta_err_sum) for p in parallel["per_step"]]
    assert cells == [(p.step, p.layer, p.head, p.delta_err_sum) for p in whole["per_step"]]
    for key in ("total", "top_features", "top_token", "cumulative", "cumulative_tokens", "focus"):
        assert serial[key] == parallel[key] == whole[key], key
    assert serial["total"]["delta_err_sum"] > 0  # the planted positive bias, not an empty result


def test_map_in_order_returns_results_in_item_order_on_a_running_scheduler():
    from dask.distributed import LocalCluster

    with LocalCluster(n_workers=1, threads_per_worker=3, processes=False, dashboard_address=None) as cluster:
        assert map_in_order(_finish_in_reverse, [0, 1, 2], Workers(scheduler=cluster.scheduler_address)) == [0, 1, 4]
    assert map_in_order(_finish_in_reverse, [2], Workers()) == [4]


def test_work_items_cut_heads_into_fixed_groups(planted_dump):
    dump = open_dump(planted_dump)
    items = work_items(select(dump, step=0), heads_per_item=3)
    assert [(s.step, s.layer, s.heads) for s in items] == [(0, 0, [0, 1, 2]), (0, 0, [3])]


def test_bad_worker_options_are_one_line_errors(planted_dump):
    with pytest.raises(InvalidSetting, match="workers: 0 must be a positive integer") as bad:
        Workers(n=0)
    assert bad.value.setting == "workers"  # the library names its setting; the CLI words the option
    res = runner.invoke(app, ["delta-bias", str(planted_dump), "--workers", "0"])
    assert res.exit_code == 2 and "--workers" in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1
    res = runner.invoke(app, ["delta-bias", str(planted_dump), "--scheduler", "tcp://127.0.0.1:9"])
    assert res.exit_code == 2 and "--scheduler" in res.output and "Traceback" not in res.output


def _payloads(dump, sels, workers):
    """The JSON payload of every analysis that fans out, in-process or on `workers`."""

    from fa_forensics.fidelity import match
    from fa_forensics.analyses.bitdiff import compute as bitdiff
    from fa_forensics.analyses.fix_check import compute as fix_check
    from fa_forensics.analyses.isolate import compute as isolate
    from fa_forensics.analyses.pv_trace import compute as pv_trace
    from fa_forensics.analyses.rank1_sim import compute as rank1_sim
    from fa_forensics.analyses.jsonable import to_jsonable
    from fa_forensics.fidelity.recipe import Recipe

    runs = {
        "isolate": lambda: isolate.payload(isolate.run(dump, sels, workers=workers)),
        "rank1-sim": lambda: rank1_sim.payload(rank1_sim.run(dump, sels, workers=workers)),
        "pv-trace": lambda: pv_trace.payload(pv_trace.run(dump, sels, workers=workers)),
        "fix-check": lambda: fix_check.payload(fix_check.run(dump, sels, workers=workers)),
        "bitdiff": lambda: bitdiff.payload(bitdiff.run(dump, sels, Recipe(), Recipe("fp32"), workers=workers)),
        "match": lambda: match.match(dump, sels, workers=workers),
    }
    return {name: json.dumps(to_jsonable(run()), sort_keys=True) for name, run in runs.items()}


def test_every_analysis_on_two_workers_equals_in_process(planted_dump, monkeypatch):
    """Head groups of 2 (two work items per layer-step; pv-trace and match take whole layer-steps):
    each analysis's JSON is identical in-process and on one LocalCluster of 2 workers."""
    dump = open_dump(planted_dump)
    sels = select(dump, step=1)
    monkeypatch.setattr(fanout, "HEADS_PER_ITEM", 2)
    serial = _payloads(dump, sels, Workers())
    with fanout.connected(Workers(n=2)):  # one cluster for all six, as the report starts it
        parallel = _payloads(dump, sels, Workers(n=2))
    for name in serial:
        assert serial[name] == parallel[name], name
    # real findings, not empty ones: every claim names a measured place with a sign (one step's units are too few
    # to make the claims significant; the equality above is over the whole payloads, numbers included)
    for name in ("isolate", "fix-check", "bitdiff", "pv-trace"):
        claim = json.loads(serial[name])["bias"]
        assert claim["layer"] == 0 and claim["sign"] != 0 and 0 < claim["n_units"] <= claim["n_rows"], (name, claim)


def _same_up_to_rounding(a, b, path=""):
    """a == b, floats to 1e-9 relative (sums over a layer-step's heads in another grouping differ in the
    last bits); stochastic rounding and what names it are left out (its random bits are drawn per work item)."""
    if isinstance(a, dict):
        keep = [k for k in a if k not in ("verdict", "culprits")]
        assert sorted(keep) == sorted(k for k in b if k not in ("verdict", "culprits")), path
        for k in keep:
            _same_up_to_rounding(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, list):
        a = [x for x in a if not (isinstance(x, dict) and x.get("name") == "stochastic")]
        b = [x for x in b if not (isinstance(x, dict) and x.get("name") == "stochastic")]
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _same_up_to_rounding(x, y, f"{path}[{i}]")
    elif isinstance(a, float) and isinstance(b, float):
        assert a == pytest.approx(b, rel=1e-9, abs=1e-15), path
    else:
        assert a == b, path


def test_head_groups_change_no_finding(planted_dump, monkeypatch):
    """One head per work item or all four in one: the same findings (numbers exact per head, sums over
    heads to the last bits)."""

    dump = open_dump(planted_dump)
    sels = select(dump, step=1)
    whole = _payloads(dump, sels, Workers())
    monkeypatch.setattr(fanout, "HEADS_PER_ITEM", 1)
    for name, text in _payloads(dump, sels, Workers()).items():
        _same_up_to_rounding(json.loads(text), json.loads(whole[name]), name)


@pytest.mark.parametrize("command", [["isolate"], ["match"], ["report", "--out", "REPORT"]])
def test_every_fanning_command_takes_workers_and_refuses_bad_ones_in_one_line(planted_dump, tmp_path, command):
    args = [a.replace("REPORT", str(tmp_path / "r")) for a in command]
    res = runner.invoke(app, [args[0], str(planted_dump), *args[1:], "--workers", "0"])
    assert res.exit_code == 2 and "--workers" in res.output and "Traceback" not in res.output
    res = runner.invoke(app, [args[0], str(planted_dump), *args[1:], "--scheduler", "tcp://127.0.0.1:9", "--step", "0"])
    assert res.exit_code == 2 and "cannot start or reach tcp://127.0.0.1:9" in res.output
    assert "Traceback" not in res.output
    res = runner.invoke(app, [args[0], str(planted_dump), *args[1:], "--scheduler", "not an address", "--step", "0"])
    assert res.exit_code == 2 and "cannot start or reach not an address" in res.output
    assert "unexpected" not in res.output
