"""StepPlan: what a step does with its attention calls, decided from the selection, the monitor and the alarm."""
from __future__ import annotations

import pytest

from fa_forensics.capture.step_plan import StepPlan


@pytest.mark.parametrize("selected, asked, monitored, ring_kept, action, why, active", [
    (True, False, False, False, "record", "selected", True),
    (False, True, True, True, "record", "alarm", True),
    (True, True, True, True, "record", "selected", True),
    (False, False, True, True, "ring", "monitored", True),
    (False, False, True, False, "monitor", "monitored", True),
    (False, False, False, True, "nothing", "not selected", False),
])
def test_a_step_is_recorded_held_monitored_or_left_alone(selected, asked, monitored, ring_kept, action, why, active):
    plan = StepPlan.decide(7, selected=selected, asked=asked, monitored=monitored, ring_kept=ring_kept)
    assert (plan.action, plan.why, plan.active, plan.step) == (action, why, active, 7)
    assert plan.ring == (action == "ring") and plan.monitor == monitored


def test_the_plan_a_session_follows_changes_when_an_alarm_asks_for_the_step_in_progress(tmp_path):
    import fa_forensics

    session = fa_forensics.capture(None, out=tmp_path / "a.zarr", steps="2", monitor_every=1, alarm=True, ring=1)
    session._monitor.begin_step = lambda step: setattr(session._monitor, "hot", True)
    session._begin_step(0)
    assert session._plan.action == "ring" and session.busy
    session._monitor.extra_steps.add(0)
    session._plan_step(0)
    assert session._plan.action == "record" and session._plan.why == "alarm" and 0 in session._held_alarm
    session._begin_step(2)
    assert session._plan.action == "record" and session._plan.why == "selected" and 2 not in session._held_alarm
