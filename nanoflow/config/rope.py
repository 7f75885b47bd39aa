"""RoPE: the [model.rope_scaling] table (also a stage's [data_stages.rope_scaling]), the keys each rope_type takes,
and `stage_ropes`, the RoPE each stage trains with.

A stage may set rope_theta and a rope_scaling table; each it leaves unset is the previous stage's (the first
stage's: [model]'s), so a model once extended stays extended into the stages after. `Rope` is what a stage trains
with, with the defaults transformers derives from max_position_embeddings filled in (YaRN's
original_max_position_embeddings and factor), so that nanoflow.model computes it from the record alone and
config.json can say it whole. Pure: no torch, no IO.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

import attrs
from attrs import frozen
from attrs.validators import ge, instance_of, optional

from nanoflow.config.keys import key, positive, positive_float

non_negative_float = [instance_of((int, float)), ge(0)]


@frozen
class RopeScalingArgs:
    """[model.rope_scaling]: HF's rope_scaling (rope_parameters), for the RoPE types nanoflow implements, computed as
    transformers 5 computes them (docs/hf.md); a stage's [data_stages.rope_scaling] takes the same keys.

    "linear" divides every frequency by `factor`; "llama3" (Llama 3.1+) divides the low frequencies by
    `factor`, keeps the high ones and blends in between; "yarn" (Qwen2.5, Qwen3, DeepSeek) blends the same way
    by the number of rotations each frequency makes over original_max_position_embeddings and scales cos and sin
    by an attention factor. The keys each type takes: nanoflow.config.rope.ROPE_KEYS.
    """

    rope_type: str = key('"default" (plain RoPE), "linear" (needs factor), "llama3" (needs its four numbers) or '
                         '"yarn"', "default")
    factor: float | None = key("how much longer the context is made: frequencies are divided by it (llama3, yarn: "
                               "the low ones; yarn: unset, max_position_embeddings / "
                               "original_max_position_embeddings)", None, validator=optional(positive_float))
    low_freq_factor: float | None = key("llama3: wavelengths beyond original_max_position_embeddings / this "
                                        "are divided by factor", None, validator=optional(positive_float))
    high_freq_factor: float | None = key("llama3: wavelengths below original_max_position_embeddings / this "
                                         "are kept; in between, blended", None, validator=optional(positive_float))
    original_max_position_embeddings: int | None = key(
        "llama3, yarn: the context length the model was trained at before the extension (yarn: unset, "
        "model.max_position_embeddings)", None, validator=optional(positive))
    beta_fast: float | None = key("yarn: frequencies making more rotations than this over "
                                  "original_max_position_embeddings are kept", None,
                                  validator=optional(positive_float), shown="`32`")
    beta_slow: float | None = key("yarn: frequencies making fewer rotations than this are divided by factor; in "
                                  "between, blended", None, validator=optional(positive_float), shown="`1`")
    attention_factor: float | None = key("yarn: what cos and sin are multiplied by", None,
                                         validator=optional(positive_float),
                                         shown="0.1 ln(factor) + 1, or from mscale and mscale_all_dim")
    mscale: float | None = key("yarn: with mscale_all_dim, the attention factor is (0.1 mscale ln(factor) + 1) / "
                               "(0.1 mscale_all_dim ln(factor) + 1)", None, validator=optional(non_negative_float))
    mscale_all_dim: float | None = key("yarn: see mscale", None, validator=optional(non_negative_float))
    truncate: bool | None = key("yarn: round the blended band's bounds to whole dimensions", None,
                                validator=optional(instance_of(bool)), shown="`true`")


# The keys each rope_type takes, and those of them it needs (yarn's two numbers have defaults, as in transformers).
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate"),
}
ROPE_REQUIRED = {**ROPE_KEYS, "yarn": ()}
SCALING_KEYS = tuple(name for name in attrs.fields_dict(RopeScalingArgs) if name != "rope_type")


def rope_scaling_problems(scaling: RopeScalingArgs | None, where: str = "model.rope_scaling") -> list[str]:
    """What is wrong with a rope_scaling table (at `where`): an unknown rope_type, a key its type needs or does not
    use."""
    if scaling is None:
        return []
    if scaling.rope_type not in ROPE_KEYS:
        near = difflib.get_close_matches(scaling.rope_type, list(ROPE_KEYS), n=1)
        return [f"{where}.rope_type = {scaling.rope_type!r}: nanoflow implements "
                + ", ".join(f'"{t}"' for t in ROPE_KEYS) + (f' (did you mean "{near[0]}"?)' if near else "")]
    takes, needs = ROPE_KEYS[scaling.rope_type], ROPE_REQUIRED[scaling.rope_type]
    problems = []
    for name in SCALING_KEYS:
        given = getattr(scaling, name) is not None
        if name in needs and not given:
            problems.append(f'{where}.{name}: required with rope_type = "{scaling.rope_type}"')
        elif name not in takes and given:
            problems.append(f'{where}.{name}: not used by rope_type = "{scaling.rope_type}"; remove it')
    if scaling.rope_type == "llama3" and not problems and scaling.low_freq_factor >= scaling.high_freq_factor:
        problems.append(f"{where}: low_freq_factor = {scaling.low_freq_factor} must be below "
                        f"high_freq_factor = {scaling.high_freq_factor}")
    return problems


@frozen
class Rope:
    """The RoPE a stage trains with: its base and its scaling (None: plain RoPE), YaRN's defaults filled in."""

    theta: float
    scaling: RopeScalingArgs | None = None

    @classmethod
    def of(cls, theta: float, scaling: RopeScalingArgs | None, max_position_embeddings: int) -> Rope:
        """rope_theta and a rope_scaling table under [model] max_position_embeddings, resolved as transformers
        resolves them: "default" is plain RoPE; yarn's original_max_position_embeddings defaults to
        max_position_embeddings, and its factor to max_position_embeddings / original_max_position_embeddings."""
        if scaling is not None and scaling.rope_type == "default":
            scaling = None
        if scaling is not None and scaling.rope_type == "yarn":
            original = scaling.original_max_position_embeddings or max_position_embeddings
            factor = scaling.factor if scaling.factor is not None else max_position_embeddings / original
            scaling = attrs.evolve(scaling, original_max_position_embeddings=original, factor=factor)
        return cls(theta, scaling)

    def scaling_table(self) -> dict | None:
        """The scaling as HF's rope_scaling dict (only the keys set), or None for plain RoPE."""
        if self.scaling is None:
            return None
        return {name: value for name, value in attrs.asdict(self.scaling).items() if value is not None}

    def describe(self) -> str:
        """In a few words, for the plan: "θ 10,000", "θ 500,000, yarn ×4 of 4,096"."""
        text = f"θ {self.theta:,.0f}" if float(self.theta).is_integer() else f"θ {self.theta:,}"
        scaling = self.scaling
        if scaling is None:
            return text
        text += f", {scaling.rope_type} ×{scaling.factor:g}"
        if scaling.original_max_position_embeddings is not None:
            text += f" of {scaling.original_max_position_embeddings:,}"
        return text


def stage_ropes(theta: float, scaling: RopeScalingArgs | None, max_position_embeddings: int,
                stages: Sequence[tuple[float | None, RopeScalingArgs | None]]) -> tuple[Rope, ...]:
    """The RoPE of each stage, in start order: [model]'s rope_theta and rope_scaling, then what each stage
    (`stages`: its rope_theta and rope_scaling, None where it sets none) sets; a key a stage leaves unset is the
    previous stage's (a table with rope_type = "default" turns the scaling off)."""
    ropes = []
    for stage_theta, stage_scaling in stages:
        theta = stage_theta if stage_theta is not None else theta
        scaling = stage_scaling if stage_scaling is not None else scaling
        ropes.append(Rope.of(theta, scaling, max_position_embeddings))
    return tuple(ropes)


def stage_rope(config, index: int) -> Rope:
    """The RoPE stage `index` of `config` (a Config whose [model] is complete) trains with."""
    model = config.model
    return stage_ropes(model.rope_theta, model.rope_scaling, model.max_position_embeddings,
                       [(stage.rope_theta, stage.rope_scaling) for stage in config.data_stages])[index]
