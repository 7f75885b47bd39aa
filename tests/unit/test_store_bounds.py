"""The S3 retry bounds docs/s3.md states, derived from the constants of nanoflow/io/store.py: a change of a
constant that the page does not follow fails here, instead of leaving a wrong sum in prose."""

import re

from helpers import REPO

from nanoflow.io import store

# smart_open's own waits when a download breaks off (smart_open/s3.py, `retry_read`: not configurable).
SMART_OPEN_READ_WAITS = (1, 2, 4, 8, 16)


def most_waiting(policy: store.Retries) -> float:
    """The longest one request waits between its tries: a wait after every try but the last."""
    return sum(policy.wait(attempt) for attempt in range(policy.attempts - 1))


def most_waiting_for_a_read(policy: store.Retries) -> float:
    """One smart_open read: every try but the last ends after at most GETS_PER_READ - 1 of smart_open's waits
    (the budget ends it at its next GET), the last after at most GETS_PER_READ; plus the waits between tries."""
    per_try = sum(SMART_OPEN_READ_WAITS[:store.GETS_PER_READ - 1])
    last = sum(SMART_OPEN_READ_WAITS[:store.GETS_PER_READ])
    return (policy.attempts - 1) * per_try + last + most_waiting(policy)


def test_the_waits_double_from_the_first_up_to_the_cap():
    policy = store.Retries()
    waits = [policy.wait(a) for a in range(policy.attempts - 1)]
    assert waits[0] == policy.first_wait and max(waits) == policy.max_wait
    assert all(b == min(policy.max_wait, 2 * a) for a, b in zip(waits, waits[1:], strict=False))
    assert most_waiting(store.Retries(attempts=1)) == 0   # one try: nothing to wait for
    assert most_waiting(policy) == 23.75 and most_waiting_for_a_read(policy) == 159.75   # the defaults, by hand


def test_docs_s3_states_the_bounds_the_constants_give():
    policy = store.Retries()
    page = re.sub(r"\s+", " ", (REPO / "docs" / "s3.md").read_text())
    waits = ", ".join(f"{policy.wait(a):g} s" for a in range(policy.attempts - 1))
    assert f"at most {policy.attempts} tries, waiting {waits} between them" in page
    assert f"so at most {most_waiting(policy):g} s of waiting" in page
    assert f"nanoflow allows one read {store.GETS_PER_READ} GETs in all" in page
    gets = policy.attempts * store.GETS_PER_READ
    assert f"{policy.attempts} × {store.GETS_PER_READ} = {gets} GETs and" in page
    assert f"= {most_waiting_for_a_read(policy):g} s of waiting" in page
