"""Fan-out on dask.distributed: a 2-worker LocalCluster gives exactly the in-process numbers."""
import time

import pytest
from typer.testing import CliRunner

from fa_forensics.analyses import delta_bias, fanout
from fa_forensics.analyses.fanout import Workers, map_in_order, work_items
from fa_forensics.analyses.selection import select
from fa_forensics.cli import app
from fa_forensics.dump import open_dump
from fa_forensics.errors import UserError

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
    with pytest.raises(UserError, match="--workers"):
        Workers(n=0)
    res = runner.invoke(app, ["delta-bias", str(planted_dump), "--workers", "0"])
    assert res.exit_code == 2 and "--workers" in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1
    res = runner.invoke(app, ["delta-bias", str(planted_dump), "--scheduler", "tcp://127.0.0.1:9"])
    assert res.exit_code == 2 and "--scheduler" in res.output and "Traceback" not in res.output
