"""What a commit leaves to delete: a pure plan drawn from a listing of the run folder (the policy), which
nanoflow.io.checkpoint carries out against the store (the mechanism).

The rules, in one place: nanoflow deletes only files with its own names (`OURS`) inside step folders that
hold its save marker, and latest.txt's temporaries; never anything in the step just committed but what its
metadata no longer lists; never through a symlink; and of the other committed steps it keeps the `keep` - 1
most recently committed (commit order, not step order: the higher steps of an abandoned history go first).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

from attrs import frozen

from nanoflow.io.marker import METADATA, step_of

LATEST = "latest.txt"
SAVE_MARKER = ".nanoflow-save"
# The names nanoflow writes inside a step folder (and their temporaries): the only ones it ever deletes there.
OURS = re.compile(r"(?:[A-Za-z0-9_]+/rank[0-9]{5}(?:\.[0-9a-f]{8})?\.safetensors|" + re.escape(METADATA) + "|"
                  + re.escape(SAVE_MARKER) + r")(?:\.tmp-[0-9]+)?")
TEMPORARY = re.compile(r".*\.tmp-[0-9]+")
_LATEST_TEMPORARY = re.compile(re.escape(LATEST) + r"\.tmp-[0-9]+")


def step_folders(listing: Iterable[str]) -> set[int]:
    """The steps that have a folder in a listing of relative paths."""
    return {s for s in (step_of(p.partition("/")[0]) for p in listing if "/" in p) if s is not None}


def saves(listing: Iterable[str]) -> dict[int, tuple[str, ...]]:
    """{step: nanoflow's file names in its folder} for every step folder that holds the save marker."""
    listing = set(listing)
    return {step: tuple(sorted(name for p in listing if p.startswith(f"{step}/")
                               and OURS.fullmatch(name := p.partition("/")[2])))
            for step in step_folders(listing) if f"{step}/{SAVE_MARKER}" in listing}


@frozen
class CleanUpPlan:
    """The deletions after a commit. `stray` goes first (files of folders that stay); then the doomed folders,
    each batch whole before the next: their commit markers (so that a folder half-deleted by a crash reads as
    incomplete, never as damaged data), their other files, their save markers last (so that what is left is
    still known to be nanoflow's); then the emptied folders. `left_linked`: due, but a symlink: left as it is."""

    stray: tuple[str, ...]
    doomed: tuple[int, ...]
    markers: tuple[str, ...]
    files: tuple[str, ...]
    save_markers: tuple[str, ...]
    left_linked: tuple[int, ...]

    def deleted(self) -> set[str]:
        return {*self.stray, *self.markers, *self.files, *self.save_markers}


def plan_clean_up(listing: Iterable[str], newest: int, written: Iterable[str], keep: int | None, *,
                  linked: Iterable[int] = (), committed_at: Mapping[int, object] | None = None) -> CleanUpPlan:
    """The plan after step `newest` committed. `listing`: the run folder's relative paths from just before the
    commit; `written`: the names the new commit lists in its folder; `linked`: step folders that are symlinks;
    `committed_at`: when each other committed step was committed (comparable values; needed with `keep`, and
    None when it could not be read, so that no committed step is deleted on a guess)."""
    listing = set(listing)
    ours = saves(listing)
    linked = set(linked) & (set(ours) - {newest})
    doomed = [s for s, names in ours.items() if METADATA not in names and s != newest]   # saves that never committed
    if keep is not None and committed_at is not None:
        committed = [s for s, names in ours.items() if METADATA in names and s != newest]
        doomed += sorted(committed, key=lambda s: (committed_at[s], s), reverse=True)[max(keep - 1, 0):]
    left_linked = tuple(sorted(set(doomed) & linked))
    doomed = sorted(set(doomed) - linked)
    kept = {s: names for s, names in ours.items() if s not in linked and s not in doomed}
    written = set(written)
    stray = [f"{newest}/{name}" for name in kept.get(newest, ()) if name not in written]
    stray += [f"{s}/{name}" for s, names in kept.items() if s != newest for name in names if TEMPORARY.fullmatch(name)]
    stray += sorted(p for p in listing if _LATEST_TEMPORARY.fullmatch(p))
    return CleanUpPlan(
        stray=tuple(stray), doomed=tuple(doomed),
        markers=tuple(f"{s}/{METADATA}" for s in doomed if METADATA in ours[s]),
        files=tuple(f"{s}/{name}" for s in doomed for name in ours[s] if name not in (METADATA, SAVE_MARKER)),
        save_markers=tuple(f"{s}/{SAVE_MARKER}" for s in doomed), left_linked=left_linked)
