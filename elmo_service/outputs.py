"""A sentence's layers -> the answer asked for: written once for every surface.

The library (``Embedder.embed``), ``embed-file``, ``embed-bulk``, ``POST /v1/embed`` and
``POST /v1/embeddings`` resolve what they were asked once (:func:`plan_output`, then the
task lookup: :func:`resolve_output`, or :meth:`OutputSpec.with_mix` where the lookup is the
caller's own, e.g. async) and turn each sentence's ``[L+1, T, D]`` layers into the answer
with :func:`render`. Numpy only (the mix and the word averages are
``elmo_service.scalar_mix`` and ``elmo_service.values``' word grouping).

The one order: **select or mix the model's token layers, then average a word's pieces, then
pool.** The mix is defined on the biLM's token positions, and its layer norm normalises a
sentence's layer over those positions; averaging pieces first would change the statistics
the norm sees (a word of five pieces would weigh one position, not five), so a word's mixed
vector would depend on the granularity asked. Mixing first, a word's vector is exactly the
mean of its pieces' token-granularity vectors, on every surface. Without a layer norm the
two orders agree to float rounding (the mix is linear); with one they did not
(1.99 apart on a layer-normed task at word granularity).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np

from elmo_service.errors import ConfigError, InputError, UnknownTask
from elmo_service.scalar_mix import MixSpec, apply_mix
from elmo_service.values import Token, average_words, word_tokens  # also the client's

OUTPUTS = ("layers", "mix", "both")
GRANULARITIES = ("token", "word")
POOLINGS = ("none", "mean", "max")
DEFAULT_TASK = "default"  # the task that, when stored, is the model's default mix

# a task lookup: the stored mix of that name, or None
FindTask = Callable[[str], MixSpec | None]


def default_output(*, task: str | None = None, mix: MixSpec | None = None) -> str:
    """What is returned when ``output`` is not given: the mix when one was named, else layers."""
    return "mix" if (task is not None or mix is not None) else "layers"


def default_mix(found: MixSpec | None, n_layers: int) -> tuple[MixSpec, str | None]:
    """The model's default mix, given what the lookup of the task named ``default`` found:
    that task (checked against the model: stored before a bound existed, it is refused,
    never turned into NaN), else the plain average of all layers (equal weights, gamma 1).
    Returns (the mix, the task name or None)."""
    if found is None:
        return MixSpec.average(n_layers), None
    return usable_task(found, DEFAULT_TASK, n_layers), DEFAULT_TASK


def usable_task(spec: MixSpec, name: str, n_layers: int) -> MixSpec:
    """A stored task checked against this model; ConfigError naming ``task`` otherwise."""
    try:
        return spec.validate(n_layers, "task")
    except ConfigError as e:
        raise ConfigError(f"task {name!r} cannot be used: {e.message}", field="task") from e


@dataclass(frozen=True)
class OutputSpec:
    """What to answer per sentence, resolved once per request (or file, or run)."""

    output: str  # "layers" | "mix" | "both"
    layers: tuple[int, ...] | None  # the layer indices returned; None: no layers output
    mix: MixSpec | None  # None: no mix output (or one still to look up: ``pending``)
    task: str | None = None  # the stored task the mix came from (None: inline, or the average)
    granularity: str = "token"
    pooling: str = "none"
    pending: str | None = None  # a task name still to look up (DEFAULT_TASK: the default policy)
    n_layers: int = 0

    @cached_property
    def all_layers(self) -> bool:
        return self.layers is not None and self.layers == tuple(range(self.n_layers))

    def with_mix(self, found: MixSpec | None, known: Iterable[str] = ()) -> OutputSpec:
        """The spec once the caller looked ``pending`` up (``found``: what the store holds
        under that name, or None). An unknown named task raises :class:`UnknownTask`
        listing ``known`` (the names the caller could look up)."""
        if self.pending is None:
            return self
        if self.wants_default:
            return self.using(*default_mix(found, self.n_layers))
        if found is None:
            raise UnknownTask(self.pending, known)
        return self.using(usable_task(found, self.pending, self.n_layers), self.pending)

    @property
    def wants_default(self) -> bool:
        """The mix still to look up is the model's default (no task was named)."""
        return self.pending == DEFAULT_TASK and self.task is None

    def using(self, mix: MixSpec, task: str | None) -> OutputSpec:
        """The spec with its mix looked up (already checked against the model)."""
        return replace(self, mix=mix, task=task, pending=None)


def plan_output(
    n_layers: int,
    *,
    output: str | None = None,
    layers: Sequence[int] | None = None,
    mix: MixSpec | None = None,
    task: str | None = None,
    granularity: str = "token",
    pooling: str = "none",
) -> OutputSpec:
    """Check the options together (InputError naming the field) without looking a task up:
    ``pending`` names the task to look up, if any (:meth:`OutputSpec.with_mix`)."""
    if granularity not in GRANULARITIES:
        raise InputError(f"granularity must be one of {GRANULARITIES}", field="granularity")
    if pooling not in POOLINGS:
        raise InputError(f"pooling must be one of {POOLINGS}", field="pooling")
    if output is not None and output not in OUTPUTS:
        raise InputError(f"output must be one of {OUTPUTS}", field="output")
    if task is not None and mix is not None:
        raise InputError("give either task or mix, not both", field="mix")
    output = output or default_output(task=task, mix=mix)
    if output == "layers" and (task is not None or mix is not None):
        which = "task" if task is not None else "mix"
        raise InputError(f"{which} given but output is 'layers'; use 'mix' or 'both'", field=which)
    if output == "mix" and layers is not None:
        raise InputError("layers selects the 'layers' output; output is 'mix'", field="layers")
    idx = None if output == "mix" else _layer_indices(layers, n_layers)
    if mix is not None:
        mix.validate(n_layers, "mix", gamma_field="gamma")
    pending = None
    if output != "layers" and mix is None:
        pending = task if task is not None else DEFAULT_TASK
    return OutputSpec(output, idx, mix, task, granularity, pooling, pending, n_layers)


def resolve_output(
    n_layers: int, find_task: FindTask, known: Iterable[str] = (), **options
) -> OutputSpec:
    """:func:`plan_output` and the task lookup, for callers whose lookup is cheap and sync
    (``known``: the task names listed when the one asked is unknown)."""
    spec = plan_output(n_layers, **options)
    if spec.pending is None:
        return spec
    return spec.with_mix(find_task(spec.pending), known)


def _layer_indices(layers: Sequence[int] | None, n: int) -> tuple[int, ...]:
    if layers is None:
        return tuple(range(n))
    if not layers:
        raise InputError("layers must name at least one layer index", field="layers")
    seen: set[int] = set()
    for i, idx in enumerate(layers):
        if not 0 <= idx < n:
            raise InputError(
                f"layer index {idx} out of range: the model has {n} layers (0..{n - 1})",
                field=f"layers[{i}]",
            )
        if idx in seen:
            raise InputError(f"layer index {idx} given twice", field=f"layers[{i}]")
        seen.add(idx)
    return tuple(layers)


def render(
    layers: np.ndarray, tokens: Sequence[Token], spec: OutputSpec
) -> tuple[np.ndarray | None, np.ndarray | None]:
    """One sentence's ``[L+1, T, D]`` layers -> (layers output ``[K, P, D]``, mix output
    ``[P, D]``), P the tokens or the words; pooled: ``[K, D]`` and ``[D]``. None where the
    spec does not ask for it. Order: mix over token layers, then words, then pooling (see
    the module's docstring). Copies nothing it does not change (all layers, one piece per
    word and no pooling hand ``layers`` itself back)."""
    if spec.pending is not None:
        raise ValueError(f"output spec has task {spec.pending!r} still to look up")
    x = None
    if spec.layers is not None:
        x = layers if spec.all_layers else layers[list(spec.layers)]
    m = None if spec.mix is None else apply_mix(layers, spec.mix)
    if spec.granularity == "word":
        x = None if x is None else average_words(x, tokens, axis=1)
        m = None if m is None else average_words(m, tokens, axis=0)
    if spec.pooling != "none":
        x = None if x is None else pool(x, spec.pooling, axis=1)
        m = None if m is None else pool(m, spec.pooling, axis=0)
    return x, m


def positions(tokens: Sequence[Token], spec: OutputSpec, text: str | None = None) -> list[Token]:
    """The positions :func:`render` answers for: the tokens, or one token per word (its
    span in ``text`` when given)."""
    return word_tokens(tokens, text) if spec.granularity == "word" else list(tokens)


def pool(x: np.ndarray, how: str, axis: int) -> np.ndarray:
    """Mean (accumulated in float64) or max over the positions ``axis``; "none": ``x``.
    No positions (an empty sentence): the zero vector, finite on every surface (#51)."""
    if how != "none" and x.shape[axis] == 0:
        return np.zeros(x.shape[:axis] + x.shape[axis + 1 :], dtype=np.float32)
    if how == "mean":
        return x.mean(axis=axis, dtype=np.float64).astype(np.float32)
    if how == "max":
        return x.max(axis=axis)
    return x
