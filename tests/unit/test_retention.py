"""The retention policy (nanoflow.io.retention.plan_clean_up), property-tested on generated run folders: whatever
the listing, it never deletes the step just committed, anything nanoflow did not write, anything behind a symlink,
or a committed step that `keep` protects; and it does delete what a killed or replaced save left behind."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from nanoflow.io.marker import METADATA
from nanoflow.io.retention import LATEST, OURS, SAVE_MARKER, TEMPORARY, plan_clean_up

SHARDS = ["model/rank00000.safetensors", "model/rank00001.safetensors", "optimizer/rank00000.safetensors",
          "model/rank00000.0a1b2c3d.safetensors"]
USER_FILES = ["notes.txt", "model/mine.bin", "eval.jsonl", "model/rank00000.safetensors.bak", "rank00000.safetensors"]


@st.composite
def run_folders(draw):
    """(listing, newest, written, keep, linked, committed_at) of a run folder just after a commit of `newest`."""
    steps = draw(st.lists(st.integers(1, 60), min_size=1, max_size=8, unique=True))
    newest = draw(st.sampled_from(steps))
    listing = set()
    for step in steps:
        marked = step == newest or draw(st.booleans())
        committed = step != newest and marked and draw(st.booleans())
        names = set(draw(st.lists(st.sampled_from(SHARDS), max_size=3)))
        names |= {f"{n}.tmp-{draw(st.integers(1, 99))}" for n in draw(st.lists(st.sampled_from(SHARDS), max_size=1))}
        names |= set(draw(st.lists(st.sampled_from(USER_FILES), max_size=2)))
        names |= {SAVE_MARKER} if marked else set()
        names |= {METADATA} if committed else set()
        listing |= {f"{step}/{n}" for n in names}
    listing |= set(draw(st.lists(st.sampled_from([LATEST, f"{LATEST}.tmp-7", "metrics.jsonl", "keep/1/x"]),
                                 max_size=3)))
    mine = sorted(p.partition("/")[2] for p in listing if p.startswith(f"{newest}/"))
    written = set(draw(st.lists(st.sampled_from(mine), max_size=len(mine)))) | {METADATA, SAVE_MARKER}
    keep = draw(st.one_of(st.none(), st.integers(1, 5)))
    others = [s for s in steps if s != newest]
    linked = set(draw(st.lists(st.sampled_from(others), max_size=2))) if others else set()
    times = {s: draw(st.integers(0, 5)) for s in steps}   # ties on purpose: the step number breaks them
    return listing, newest, written, keep, linked, times


@settings(max_examples=300, deadline=None)
@given(run_folders())
def test_the_plan_deletes_only_what_nanoflow_wrote_and_no_longer_needs(folder):
    listing, newest, written, keep, linked, times = folder
    plan = plan_clean_up(listing, newest, written, keep, linked=linked, committed_at=times)
    deleted = plan.deleted()
    assert deleted <= listing                                           # nothing made up
    for path in deleted:
        head, _, name = path.partition("/")
        if head == LATEST or path.startswith(f"{LATEST}.tmp-"):
            assert TEMPORARY.fullmatch(path)                          # latest.txt itself stays
            continue
        step = int(head)
        assert OURS.fullmatch(name), path                             # only nanoflow's names
        assert f"{step}/{SAVE_MARKER}" in listing, path               # only in its own save folders
        assert step not in linked, path                               # never through a link
        if step == newest:
            assert name not in written, path                          # the new commit keeps what it lists
    assert newest not in plan.doomed and not set(plan.doomed) & linked
    committed = [s for s in {int(p.partition("/")[0]) for p in listing if p.endswith(f"/{METADATA}")} if s != newest]
    if keep is not None:   # the keep - 1 most recently committed besides the newest stay whole
        protected = sorted(committed, key=lambda s: (times[s], s), reverse=True)[:keep - 1]
        assert not set(protected) & set(plan.doomed)
        assert not {p for p in deleted if "/" in p and int(p.partition("/")[0]) in protected
                    and not TEMPORARY.fullmatch(p)}
    else:
        assert not set(committed) & set(plan.doomed)                 # no keep: every commit stays


@settings(max_examples=300, deadline=None)
@given(run_folders())
def test_the_plan_removes_every_leftover_and_deletes_markers_first(folder):
    listing, newest, written, keep, linked, times = folder
    plan = plan_clean_up(listing, newest, written, keep, linked=linked, committed_at=times)
    marked = {int(p.partition("/")[0]) for p in listing if p.endswith(f"/{SAVE_MARKER}")}
    never_committed = {s for s in marked if f"{s}/{METADATA}" not in listing and s != newest}
    assert never_committed - linked <= set(plan.doomed)                # a killed save goes whole
    assert never_committed & linked <= set(plan.left_linked) <= linked   # due but linked: left, and said
    for step in plan.doomed:                                          # everything of nanoflow's in a doomed folder
        ours = {p for p in listing if p.startswith(f"{step}/") and OURS.fullmatch(p.partition("/")[2])}
        assert ours <= plan.deleted()
    assert {f"{newest}/{p.partition('/')[2]}" for p in listing if p.startswith(f"{newest}/")
            and OURS.fullmatch(p.partition("/")[2]) and p.partition("/")[2] not in written} <= set(plan.stray)
    assert set(plan.markers) == {f"{s}/{METADATA}" for s in plan.doomed if f"{s}/{METADATA}" in listing}
    assert set(plan.save_markers) == {f"{s}/{SAVE_MARKER}" for s in plan.doomed}
    assert not set(plan.markers) & set(plan.files) and not set(plan.save_markers) & set(plan.files)


def test_without_commit_times_no_committed_step_is_deleted_on_a_guess():
    listing = {f"{s}/{n}" for s in (2, 4, 6) for n in (SAVE_MARKER, METADATA, SHARDS[0])} | {f"8/{SAVE_MARKER}"}
    plan = plan_clean_up(listing, 6, {METADATA, SAVE_MARKER, SHARDS[0]}, keep=1, committed_at=None)
    assert plan.doomed == (8,)   # the save that never committed goes all the same
    plan = plan_clean_up(listing, 6, {METADATA, SAVE_MARKER, SHARDS[0]}, keep=1, committed_at={2: 1, 4: 0})
    assert plan.doomed == (2, 4, 8)


def test_commit_order_not_step_order_decides_what_keep_keeps():
    listing = {f"{s}/{n}" for s in (3, 9, 12) for n in (SAVE_MARKER, METADATA)}
    # a --fresh start: steps 9 and 12 belong to the abandoned history, committed before the new run's 3
    plan = plan_clean_up(listing | {f"5/{SAVE_MARKER}"}, 5, {METADATA, SAVE_MARKER}, keep=2,
                         committed_at={3: 10, 9: 1, 12: 2})
    assert set(plan.doomed) == {9, 12}
