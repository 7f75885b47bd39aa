"""Moving mixtures (dataset_weights_end): the closed form against a brute-force simulation, its bounds, the static
blend it reduces to, config validation and continue_from across a moving stage (training on one with a resume:
tests/e2e/test_data_mixture_runs.py)."""

import math
from decimal import Decimal, localcontext
from fractions import Fraction

import numpy as np
import pytest
import torch
from data_helpers import BYTES, load, stage
from hypothesis import given, settings
from hypothesis import strategies as st
from support.data_mixture import moving_stages

from nanoflow.config import ConfigError
from nanoflow.data import open_stage
from nanoflow.data.blend import Blend, MovingBlend, integer_weights, make_blend
from nanoflow.schedule import Schedule

# ---------------------------------------------------------------------------------------------
# A brute-force reference, written from the definition with other arithmetic than blend.py's

class Reference:
    """The moving blend's tree walked one sample at a time. Each inner node that has received m samples sends
    the next one left when floor(D(m + 1) + h) > floor(D(m) + h), D(m) = C_left(u) at the u where C_node(u) = m,
    u found by the quadratic formula on Fractions (Decimals to 150 digits when the root is irrational, where
    D + h cannot be an integer)."""

    def __init__(self, weights, ends, n):
        start, end = integer_weights(weights), integer_weights(ends)
        self.s = [Fraction(w, sum(start)) for w in start]
        self.e = [Fraction(w, sum(end)) for w in end]
        self.n = n
        self.leaves = [i for i in range(len(start)) if start[i] or end[i]]
        self.start_ints, self.end_ints = start, end
        self.cache = {}

    def target(self, group, u):
        """C_group(u): the samples the sources in `group` are due after u samples (constant shares after n)."""
        s, e = sum(self.s[i] for i in group), sum(self.e[i] for i in group)
        u = Fraction(u)
        if u > self.n:
            return s * self.n + (e - s) * self.n / 2 + e * (u - self.n)
        return s * u + (e - s) * u * u / (2 * self.n)

    def lefts(self, group, m):
        key = (tuple(group), m)
        if key not in self.cache:
            self.cache[key] = self._lefts(group, m)
        return self.cache[key]

    def _lefts(self, group, m):
        left = group[:len(group) // 2]
        b = sum(self.start_ints[i] for i in group) or sum(self.end_ints[i] for i in group)
        h = Fraction(b // 2, b)
        sA, eA = sum(self.s[i] for i in group), sum(self.e[i] for i in group)
        s1, e1 = sum(self.s[i] for i in left), sum(self.e[i] for i in left)
        end_total = self.target(group, self.n)
        if m > end_total:
            ratio = e1 / eA if eA else s1 / sA
            return math.floor(self.target(left, self.n) + ratio * (m - end_total) + h)
        if s1 * eA == e1 * sA:                         # the ratio inside the node never changes
            ratio = s1 / sA if sA else e1 / eA
            return math.floor(ratio * m + h)
        a, b_ = (eA - sA) / (2 * self.n), sA            # a·u² + b·u = m
        if a == 0:
            return math.floor(self.target(left, m / b_) + h)
        disc = b_ * b_ + 4 * a * m
        p, q = disc.numerator, disc.denominator
        if math.isqrt(p) ** 2 == p and math.isqrt(q) ** 2 == q:
            u = (-b_ + Fraction(math.isqrt(p), math.isqrt(q))) / (2 * a)
            return math.floor(self.target(left, u) + h)
        with localcontext() as ctx:
            ctx.prec = 150
            dec = lambda f: Decimal(f.numerator) / Decimal(f.denominator)   # noqa: E731
            u = (-dec(b_) + dec(disc).sqrt()) / (2 * dec(a))
            d = dec(s1) * u + dec(e1 - s1) * u * u / (2 * self.n)
            return int((d + dec(h)).to_integral_value(rounding="ROUND_FLOOR"))

    def walk(self, samples):
        """(source, source-local index) of samples 0 .. samples - 1, one after the other."""
        out = []
        for g in range(samples):
            group, m = self.leaves, g
            while len(group) > 1:
                before, after = self.lefts(group, m), self.lefts(group, m + 1)
                group, m = (group[:len(group) // 2], before) if after > before else (group[len(group) // 2:], m - before)
            out.append((group[0], m))
        return out

    def counts(self, g):
        counts = [0] * len(self.s)
        stack = [(self.leaves, g)]
        while stack:
            group, m = stack.pop()
            if len(group) == 1:
                counts[group[0]] = m
                continue
            left = self.lefts(group, m)
            stack += [(group[:len(group) // 2], left), (group[len(group) // 2:], m - left)]
        return counts


def weight_pairs(max_size=6):
    """(start, end) weight lists of one length, zeros allowed, neither all zero, not rounding alike."""
    weight = st.one_of(st.just(0.0), st.floats(0.001, 100, allow_nan=False))
    return st.integers(2, max_size).flatmap(lambda k: st.tuples(st.lists(weight, min_size=k, max_size=k),
                                                                st.lists(weight, min_size=k, max_size=k))).filter(
        lambda p: any(p[0]) and any(p[1]) and integer_weights(p[0]) != integer_weights(p[1]))


# ---------------------------------------------------------------------------------------------
# The closed form against the simulation

@settings(max_examples=25, deadline=None)
@given(pair=weight_pairs(), n=st.integers(1, 700), data=st.data())
def test_source_and_read_position_of_every_sample_match_the_simulation(pair, n, data):
    blend, reference = MovingBlend(*pair, n), Reference(*pair, n)
    total = n + 40                                       # and on past the stage's end, at the end weights
    walked = reference.walk(total)
    sources, local = blend.assign(np.arange(total))
    assert list(zip(sources.tolist(), local.tolist(), strict=True)) == walked
    start = data.draw(st.integers(0, total - 1))         # a resume at any sample: the same sequence from there
    again = blend.assign(np.arange(start, total))
    assert torch.equal(torch.from_numpy(again[0]), torch.from_numpy(sources[start:]))
    assert torch.equal(torch.from_numpy(again[1]), torch.from_numpy(local[start:]))
    for g in {0, 1, n // 2, n - 1, n, total, data.draw(st.integers(0, total))}:
        counts = blend.counts(g)
        assert sum(counts) == g                          # exactly g, never one more or less
        assert counts == np.bincount(sources[:g], minlength=len(pair[0])).tolist()


@settings(max_examples=25, deadline=None)
@given(pair=weight_pairs(8), n=st.integers(10**9, 10**12), seed=st.integers(0, 2**32 - 1))
def test_read_positions_at_huge_sample_indices_are_exact(pair, n, seed):
    """At g ~ 10^9 .. 10^12 (products far beyond float64's 2^53) each count is the reference's, exactly."""
    blend, reference = MovingBlend(*pair, n), Reference(*pair, n)
    rng = np.random.default_rng(seed)
    for g in [n, n - 1, n + 1, *rng.integers(0, n, 4).tolist()]:
        assert blend.counts(g) == reference.counts(g), g
    g = int(rng.integers(0, n - 64))
    sources, local = blend.assign(np.arange(g, g + 64))
    before, after = blend.counts(g), blend.counts(g + 64)
    for k in range(len(pair[0])):                         # each source's samples continue, no gap
        assert local[sources == k].tolist() == list(range(before[k], after[k]))


# ---------------------------------------------------------------------------------------------
# The stated bounds

def exact_target(blend, g):
    """C_i(g) of each source, as Fractions."""
    s = [Fraction(w, sum(blend.integer_weights)) for w in blend.integer_weights]
    e = [Fraction(w, sum(blend.integer_weights_end)) for w in blend.integer_weights_end]
    n = blend.samples
    return [si * g + (ei - si) * Fraction(g * g, 2 * n) for si, ei in zip(s, e, strict=True)]


@settings(max_examples=40, deadline=None)
@given(pair=weight_pairs(9), n=st.integers(1000, 10**12), seed=st.integers(0, 2**32 - 1))
def test_every_window_is_within_twice_the_depth_of_its_target(pair, n, seed):
    blend = MovingBlend(*pair, n)
    rng = np.random.default_rng(seed)
    for _ in range(6):
        width = int(rng.integers(1, min(n, 5000)))
        g1 = int(rng.integers(0, n - width + 1))
        g2 = g1 + width
        sources, _ = blend.assign(np.arange(g1, g2))
        got = np.bincount(sources, minlength=len(pair[0]))
        low, high = exact_target(blend, g1), exact_target(blend, g2)
        for k in range(len(got)):
            assert abs(got[k] - (high[k] - low[k])) < 2 * blend.depth, (k, g1, g2)
        for g, target in ((g1, low), (g2, high)):          # and every prefix within the depth
            assert all(abs(c - t) < blend.depth for c, t in zip(blend.counts(g), target, strict=True))


def test_the_shares_start_at_the_start_weights_and_end_at_the_end_weights():
    n = 2_000_000
    blend = make_blend([0.9, 0.1, 0.0], [0.1, 0.3, 0.6], n)
    assert isinstance(blend, MovingBlend) and blend.depth == 2
    first, _ = blend.assign(np.arange(0, 1000))
    last, _ = blend.assign(np.arange(n - 1000, n))
    assert np.abs(np.bincount(first, minlength=3) - np.array([900, 100, 0])).max() <= 4
    assert np.abs(np.bincount(last, minlength=3) - np.array([100, 300, 600])).max() <= 4
    assert blend.counts(n) == [1_000_000, 400_000, 600_000]   # (start + end) / 2 of the stage, here exactly
    quarter, _ = blend.assign(np.arange(n // 4 - 500, n // 4 + 500))   # a quarter in: s + (e − s) / 4
    assert np.abs(np.bincount(quarter, minlength=3) - np.array([700, 150, 150])).max() <= 4
    static, _ = make_blend([1, 3], None, n).assign(np.arange(5, 1005))  # no end weights: the start weights
    assert np.abs(np.bincount(static, minlength=2) - np.array([250, 750])).max() <= 1
    after, _ = blend.assign(np.arange(n + 10**6, n + 10**6 + 1000))      # past the end: the end weights
    assert np.abs(np.bincount(after, minlength=3) - np.array([100, 300, 600])).max() <= 4


@settings(max_examples=40, deadline=None)
@given(weights=st.lists(st.floats(0.001, 1000, allow_nan=False), min_size=1, max_size=9),
       n=st.integers(1, 10**12), start=st.integers(0, 10**15))
def test_equal_start_and_end_weights_give_the_static_blend_exactly(weights, n, start):
    static = Blend(weights)
    assert type(make_blend(weights, weights, n)) is Blend
    assert type(make_blend(weights, [w * 3 for w in weights], n)) is Blend or \
        integer_weights([w * 3 for w in weights]) != integer_weights(weights)
    moving = MovingBlend(weights, weights, n)        # the general formula, not the dispatch
    gs = np.arange(start, start + 300)
    for a, b in zip(static.assign(gs), moving.assign(gs), strict=True):
        assert np.array_equal(a, b)
    assert static.counts(start) == moving.counts(start)


def test_bad_moving_blends_are_refused():
    with pytest.raises(ValueError, match="2 start weights but 3 end weights"):
        MovingBlend([1, 1], [1, 1, 1], 10)
    with pytest.raises(ValueError, match="not all zero"):
        MovingBlend([1, 1], [0, 0], 10)
    with pytest.raises(ValueError, match="stage of 1..2"):
        MovingBlend([1, 0], [0, 1], 0)
    assert type(make_blend([1, 0], [0, 1], 0)) is Blend      # a stage never reached is never read


# ---------------------------------------------------------------------------------------------
# Config


def folder_of(window: torch.Tensor) -> int:
    return int(next(t for t in window.tolist() if t != 256)) // 100


@pytest.mark.parametrize("dataset, message", [
    ({"dataset_weights_end": [1, 1]}, "dataset_weights_end: needs dataset_weights"),
    ({"dataset_weights": [1, 1], "dataset_weights_end": [1]}, "dataset_weights_end: 1 weights for 2 folders"),
    ({"dataset_weights": [1, 1], "dataset_weights_end": [1, -2]},
     r"dataset_weights_end: the weight of .*/b is -2.0; weights must be finite and >= 0"),
    ({"dataset_weights": [1, 1], "dataset_weights_end": [0, 0]}, "dataset_weights_end: every weight is zero"),
])
def test_bad_end_weights_of_folders_name_the_stage_and_key(tmp_path, folders, dataset, message):
    dataset = {"dataset_folder": [str(folders / "a"), str(folders / "b")], **dataset}
    with pytest.raises(ConfigError, match=r'data_stages\[1\] \(stage "anneal"\)\.data\.dataset: ' + message):
        load(tmp_path, [stage("pretrain", 1, {"dataset_folder": str(folders / "c")}), stage("anneal", 3, dataset)])


def test_bad_end_tables_of_hf_blends_name_the_stage_and_key(tmp_path):
    for name in ("a.txt", "b.txt"):
        (tmp_path / name).write_text("some text " * 50)
    where = r'data_stages\[0\] \(stage "pretrain"\)\.data\.dataset: dataset_weights_end: '
    cases = [
        ({"hf_dataset_or_datasets": {"a.txt": 1, "b.txt": 1}, "dataset_weights_end": {"a.txt": 1}},
         r"no end weight for '.*b\.txt'; name every source of hf_dataset_or_datasets"),
        ({"hf_dataset_or_datasets": {"a.txt": 1, "b.txt": 1}, "dataset_weights_end": {"a.txt": 1, "b.txt": 1,
                                                                                      "c.txt": 1}},
         r"'.*c\.txt' is not a source of hf_dataset_or_datasets"),
        ({"hf_dataset_or_datasets": {"a.txt": 1, "b.txt": 1}, "dataset_weights_end": {"a.txt": 0, "b.txt": 0}},
         "every weight is zero"),
        ({"hf_dataset_or_datasets": {"a.txt": 1, "b.txt": 1}, "dataset_weights_end": {"a.txt": -1, "b.txt": 1}},
         r"the weight of .*a\.txt is -1\.0"),
        ({"hf_dataset_or_datasets": "text", "hf_data_files": "a.txt", "dataset_weights_end": {"a.txt": 1}},
         r"needs a \{name = weight\} table in hf_dataset_or_datasets"),
    ]
    for dataset, message in cases:
        with pytest.raises(ConfigError, match=where + message):
            load(tmp_path, [stage("pretrain", 1, dataset)])


def test_an_hf_end_table_names_the_sources_as_the_start_table_does(tmp_path):
    (tmp_path / "docs").mkdir()
    for name, letter in (("docs/a.txt", "a"), ("b.txt", "b")):
        (tmp_path / name).write_text("\n".join(letter * 40 for _ in range(200)))
    dataset = {"hf_dataset_or_datasets": {"docs/*.txt": 0.9, "b.txt": 0.1},
               "dataset_weights_end": {"b.txt": 0.8, "docs/*.txt": 0.2}}     # relative names, another order
    config = load(tmp_path, [stage("pretrain", 1, dataset)], train_steps=40)   # global batch 4, 160 samples
    assert config.data_stages[0].data.dataset.weights_end() == (0.2, 0.8)
    with open_stage(config, 0, BYTES, Schedule.from_config(config), cache_dir=str(tmp_path / "cache")) as loader:
        assert isinstance(loader.blend, MovingBlend) and loader.blend.samples == 160
        rows = torch.cat([loader.batch_at(s)["input_ids"] for s in loader.steps])
    from_docs = [int(ord("a") in r.tolist()) for r in rows]        # source 0: docs/*.txt, all a's
    assert from_docs == (loader.blend.assign(np.arange(160))[0] == 0).astype(int).tolist()
    assert sum(from_docs[:16]) >= 13 and sum(from_docs[-16:]) <= 5   # 0.9 at the start, 0.2 at the end


# ---------------------------------------------------------------------------------------------
# Loaders, continue_from and training


def test_a_moving_stage_loader_follows_its_blend_and_continue_from_reads_on(tmp_path, folders):
    config = load(tmp_path, moving_stages(folders), train_steps=12, micro_batch_size=4, accumulation=2)   # batch 8
    schedule = Schedule.from_config(config)
    with open_stage(config, 0, BYTES, schedule) as pretrain, open_stage(config, 1, BYTES, schedule) as anneal:
        assert isinstance(pretrain.blend, MovingBlend) and pretrain.blend.samples == 8 * 8
        assert [len(p.source) > 0 for p in pretrain.parts] == [True] * 3        # c: weight 0 at the start, read
        rows = torch.cat([pretrain.batch_at(s)["input_ids"] for s in pretrain.steps])
        origin = [folder_of(r) for r in rows]
        sources, _ = pretrain.blend.assign(np.arange(64))
        assert origin == sources.tolist()
        assert origin[:8].count(2) == 0 and origin[-8:].count(2) >= 3            # c fades in
        ends = MovingBlend([0.8, 0.2, 0.0], [0.2, 0.3, 0.5], 64).counts(64)
        assert [p.offset for p in anneal.parts] == [ends[2], ends[1]]          # a pure function of the config
        read_c = [tuple(r.tolist()) for r in rows if folder_of(r) == 2]
        read_c += [tuple(r.tolist()) for s in anneal.steps for r in anneal.batch_at(s)["input_ids"] if folder_of(r) == 2]
        c_source, c_order = pretrain.parts[2].source, pretrain.parts[2].order
        assert read_c == [tuple(c_source.sample(int(i))[0].tolist()) for i in c_order.take(range(len(read_c)))]
    with open_stage(config, 0, BYTES, schedule) as fresh:                      # seek to any step
        assert torch.equal(fresh.batch_at(6)["input_ids"], rows[40:48])


def test_the_fingerprint_of_a_moving_stage_holds_its_end_weights_and_length(tmp_path, folders):
    from nanoflow.data.fingerprint import fingerprint_changes, stage_fingerprint

    def fingerprint(stages=None, **kwargs):
        config = load(tmp_path, stages or moving_stages(folders), **kwargs)
        return {"pretrain": stage_fingerprint(config, 0, BYTES, Schedule.from_config(config))}

    saved = fingerprint(train_steps=12)
    assert fingerprint_changes(saved, fingerprint(train_steps=12)) == []
    assert fingerprint_changes(saved, fingerprint(train_steps=30)) == []       # pretrain ends at step 8 either way
    ends = moving_stages(folders)
    ends[0]["data"]["dataset"]["dataset_weights_end"] = [0.2, 0.4, 0.4]
    changed = fingerprint_changes(saved, fingerprint(ends, train_steps=12))
    assert len(changed) == 2 and all("weight_end" in line for line in changed), changed
    alone = moving_stages(folders)[:1]                                         # the last stage: train_steps moves it
    changed = fingerprint_changes(fingerprint(alone, train_steps=12), fingerprint(alone, train_steps=20))
    assert changed and "mixture_samples" in changed[0], changed
    static = [stage("pretrain", 1, {"dataset_folder": [str(folders / "a")], "dataset_weights": [1.0]})]
    assert "mixture_samples" not in fingerprint(static)["pretrain"]            # static stages: as before
