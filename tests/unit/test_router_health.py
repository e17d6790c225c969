"""Backend health: ejection, half-open probing and recovery on a hand-driven clock (no I/O)."""

import pytest

from tandem.router.health import BackendHealth, HealthState
from tandem.router.policy import AllBackendsFullError, BackendState, make_policy


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _health(**kw):
    clock = Clock()
    ejected = []
    b = BackendState("b0")
    return b, BackendHealth(b, clock=clock, on_eject=ejected.append, **kw), clock, ejected


def test_connect_error_ejects_and_half_open_probe_then_trial_restores():
    b, h, clock, ejected = _health(eject_s=2.0)
    h.on_connect_error("ConnectError: refused")
    assert (h.state, b.healthy, h.ejections, ejected) == (HealthState.EJECTED, False, 1, ["ConnectError: refused"])
    assert not h.due_probe
    h.on_probe(True)  # too early: a passing probe does not cut the ejection short
    assert h.state is HealthState.EJECTED
    clock.t += 2.0
    assert h.due_probe
    h.on_probe(True)
    assert (h.state, b.healthy, b.probation) == (HealthState.HALF_OPEN, True, True)
    # on probation the backend takes one request at a time
    p = make_policy("round-robin")
    t = p.on_dispatch(p.choose([], [b]), [], 10)
    with pytest.raises(AllBackendsFullError):
        p.choose([], [b])
    p.on_complete(t)
    h.on_response(200)  # the trial succeeded
    assert (h.state, b.healthy, b.probation, h.backoff_s) == (HealthState.HEALTHY, True, False, 2.0)


def test_half_open_failure_doubles_the_ejection_up_to_the_cap():
    b, h, clock, _ = _health(eject_s=2.0, max_eject_s=5.0)
    for expected in (4.0, 5.0, 5.0):
        h.eject("down")
        clock.t = h.ejected_until
        h.on_probe(True)
        assert h.state is HealthState.HALF_OPEN
        h.on_response(503)  # any failure on probation ejects at once
        assert h.state is HealthState.EJECTED and h.backoff_s == expected
        assert h.ejected_until == clock.t + expected
    h.on_connect_error("again")  # already ejected: no second count
    assert h.ejections == 4


def test_a_backend_that_stays_down_is_ejected_for_longer_and_reports_the_time_left():
    b, h, clock, ejected = _health(eject_s=2.0, max_eject_s=5.0)
    h.on_connect_error("refused")
    assert h.describe()["ejected_for_s"] == 2.0
    for expected in (4.0, 5.0, 5.0):
        clock.t = h.ejected_until  # time up: the checker probes, and the probe fails
        assert h.due_probe
        h.on_probe(False, "ConnectError: refused")
        assert (h.state, h.backoff_s, h.ejected_until) == (HealthState.EJECTED, expected, clock.t + expected)
        assert not h.due_probe and h.describe()["ejected_for_s"] == expected
    assert h.ejections == 1 and ejected == ["refused"]  # one outage, one ejection
    clock.t = h.ejected_until
    h.on_probe(True)
    h.on_response(200)
    assert (h.state, h.backoff_s) == (HealthState.HEALTHY, 2.0)


def test_5xx_and_first_byte_timeouts_eject_after_the_threshold_in_a_row_only():
    b, h, _, _ = _health(failure_threshold=3)
    h.on_response(500)
    h.on_response(502)
    h.on_response(400)  # the client's error: the backend is alive, the count restarts
    h.on_response(429)
    h.on_response(500)
    h.on_failure("no response byte within 2 s")
    assert h.state is HealthState.HEALTHY and h.consecutive_failures == 2
    h.on_response(503)
    assert h.state is HealthState.EJECTED and not b.healthy and h.ejections == 1
    assert h.describe()["last_error"] == "3 consecutive failures, the last: answered 503"
    assert h.describe()["consecutive_failures"] == 0


def test_one_passive_failure_ejects_a_half_open_backend():
    b, h, clock, _ = _health(failure_threshold=3, eject_s=2.0)
    h.eject("down")
    clock.t = h.ejected_until
    h.on_probe(True)
    assert h.state is HealthState.HALF_OPEN
    h.on_failure("no response byte within 2 s")
    assert (h.state, h.ejections, h.backoff_s) == (HealthState.EJECTED, 2, 4.0)


def test_failed_active_check_ejects_a_healthy_backend():
    b, h, clock, _ = _health()
    h.on_probe(False, "health check answered 503")
    assert h.state is HealthState.EJECTED and h.describe()["ejected_for_s"] == 2.0
    clock.t += 2.0
    h.on_probe(False, "still down")  # due, still failing: stays out, for twice as long
    assert h.state is HealthState.EJECTED and h.last_error == "still down"
    clock.t += 4.0
    h.on_probe(True)
    h.on_probe(True)  # a second passing probe also ends probation
    assert h.state is HealthState.HEALTHY


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="failure_threshold"):
        BackendHealth(BackendState("x"), failure_threshold=0)
    with pytest.raises(ValueError, match="eject_s"):
        BackendHealth(BackendState("x"), eject_s=10.0, max_eject_s=1.0)


def test_a_passing_health_check_keeps_the_failures_of_real_requests():
    """A server whose /health answers while its requests hang: probes between the timeouts must not reset
    the count, or it is never ejected."""
    b, h, _, ejected = _health(failure_threshold=3)
    for n in (1, 2):
        h.on_failure("no response byte within 2 s")
        h.on_probe(True)
        assert (h.state, h.consecutive_failures) == (HealthState.HEALTHY, n)
    h.on_failure("no response byte within 2 s")
    assert h.state is HealthState.EJECTED and h.ejections == 1
    assert ejected == ["3 consecutive failures, the last: no response byte within 2 s"]
    h2 = _health(failure_threshold=3)[1]
    h2.on_failure("x")
    h2.on_response(200)  # a request that succeeded does reset it
    assert h2.consecutive_failures == 0


def test_a_passing_probe_does_not_end_probation_while_the_trial_is_in_flight():
    b, h, clock, _ = _health(failure_threshold=3, eject_s=2.0)
    h.eject("3 consecutive failures")
    clock.t = h.ejected_until
    h.on_probe(True)
    b.outstanding_requests = 1  # the half-open trial was dispatched and hangs
    h.on_probe(True)
    assert (h.state, b.probation) == (HealthState.HALF_OPEN, True)
    h.on_failure("no response byte within 2 s")  # the trial decides: ejected again, for longer
    assert (h.state, h.ejections, h.backoff_s) == (HealthState.EJECTED, 2, 4.0)
