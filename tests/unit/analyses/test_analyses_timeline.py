"""analyses.timeline: the ties-vs-loss Spearman test uses only steps where both were measured; the verdict says
when the capture's alarm spent the whole run in its warm-up."""
import numpy as np
from scipy import stats as sps

from fa_forensics.analyses.timeline.compute import analyse_timeline


def test_steps_without_a_ties_measurement_are_left_out_not_counted_as_zero():
    ties = np.array([1.0, 2.0, 3.0, 4.0, np.nan, np.nan])[:, None, None]  # (S, L=1, H=1)
    loss = np.array([1.0, 2.0, 3.0, 4.0, 9.0, 8.0])
    r = analyse_timeline({"step": np.arange(6), "loss": loss, "near_max_ties": ties})
    assert r.ties_loss_spearman == 1.0  # the four measured steps rise together
    wrong = sps.spearmanr([1, 2, 3, 4, 0, 0], loss).statistic  # what counting NaN rows as 0 gave
    assert wrong < 0.5


def test_fewer_than_three_measured_steps_give_no_correlation():
    ties = np.array([1.0, 2.0, np.nan, np.nan])[:, None, None]
    r = analyse_timeline({"step": np.arange(4), "loss": np.array([1.0, 2.0, 3.0, 4.0]), "near_max_ties": ties})
    assert r.ties_loss_spearman is None and r.ties_loss_p_value is None


def _monitored_dump(path, n_steps, warmup):
    """A dump whose capture ran its alarm (with this warm-up) over n_steps monitored steps of a falling loss."""
    from fa_forensics.dump import DumpWriter, open_dump
    from fa_forensics.monitor.alarm import AlarmRule

    rule = AlarmRule.with_settings(warmup=warmup)
    writer = DumpWriter(path, {"capture": {"monitor": {"every": 1, "alarm": rule.settings()}}})
    writer.append_timeline_rows([(s, {"loss": 5.0 - 0.01 * s, "max_logit": np.full((1, 2), 1.0 + 0.001 * s)})
                                 for s in range(n_steps)])
    writer.close()
    return open_dump(path)


def test_a_capture_alarm_in_its_warmup_for_the_whole_run_is_said_so(tmp_path):
    from fa_forensics.analyses.timeline.compute import payload, run
    from fa_forensics.analyses.timeline.table import finding

    covered = run(_monitored_dump(tmp_path / "short.zarr", 12, warmup=50))
    assert covered.capture_rule["warmup"] == 50 and covered.alarms == ()
    assert covered.verdict.startswith("the capture's alarm raised no alarm, but its warm-up (50 monitored steps) "
                                      "covers all 12 monitored steps, so only a non-finite value could fire it; "
                                      "give --alarm-warmup below 12"), covered.verdict
    assert finding(payload(covered)).endswith("covers the whole run, so only a non-finite value could fire it.")
    replayed = run(_monitored_dump(tmp_path / "replayed.zarr", 12, warmup=50), alarm_warmup=4)
    assert "could fire it; replayed, " in replayed.verdict and "give --alarm-warmup" not in replayed.verdict
    watched = run(_monitored_dump(tmp_path / "watched.zarr", 12, warmup=4))
    assert watched.verdict.startswith("the capture's alarm raised no alarm in 12 monitored steps;"), watched.verdict
    assert finding(payload(watched)) == "timeline: 12 monitored steps; the capture's alarm raised no alarm."
