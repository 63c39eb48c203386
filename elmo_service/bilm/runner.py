"""The one door to a biLM's inference: :class:`Runner` (the kernel chosen once, the
token-vector cache, one lock) and :class:`CarriedState` (a stateful caller's LSTM state).

Three ways to run, every caller through one of them:

* **a batch from a zero state** (:meth:`Runner.run_tokens`, :meth:`Runner.contextualize`):
  every sentence alone, whatever its batch (``Embedder``, ``Elmo`` frozen);
* **a batch from carried state** (:meth:`Runner.run_from`): rows continue where the same
  rows of the previous call ended, the new state kept in a :class:`CarriedState`
  (``Elmo(stateful=True)``, ``ManyLangsEmbedder``);
* **a long sequence streamed in chunks**, both directions (:meth:`Runner.stream`): each
  row's state carried from chunk to chunk, several rows (documents) in one batched step,
  one row in the native loop (``elmo_service/document.py``).

A model call holds :attr:`Runner.lock` (:meth:`Runner.session`); the kernel protocol
(``kernels/select.py`` ``BiLMKernel``) is what every kernel implements, so no caller asks
which kernel it has.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from cachetools import LRUCache
from torch import Tensor

from elmo_service.bilm.char_ids import bos_ids, eos_ids, token_ids
from elmo_service.bilm.config import DEFAULT_BATCH_TOKENS, DEFAULT_MAX_BATCH_SENTENCES
from elmo_service.bilm.kernels.packed import KernelCache
from elmo_service.bilm.kernels.select import choose_kernel
from elmo_service.bilm.lstm import ChunkLayers, Chunks, Meanwhile
from elmo_service.bilm.model import BiLM, BiLMState
from elmo_service.errors import ConfigError, InputError
from elmo_service.runtime import autocast

# ------------------------------------------------------------------ batches
# A batch costs its padded tokens, ``n_sentences * longest`` (the biLSTM runs every row to
# the longest row's length); sorting by length first keeps that padding small. The library
# (``Embedder.embed_tokens``) and the server's batcher both plan with :func:`plan_batches`,
# then hand each planned batch to :meth:`Runner.run_tokens` as one model call.


@dataclass(frozen=True)
class BatchBudget:
    """Upper bounds of one model batch: padded tokens (with the <S>/</S> markers) and rows."""

    tokens: int = DEFAULT_BATCH_TOKENS
    sentences: int = DEFAULT_MAX_BATCH_SENTENCES

    def __post_init__(self) -> None:
        if self.tokens < 1:
            raise ConfigError("batch_tokens must be >= 1", field="batch_tokens")
        if self.sentences < 1:
            raise ConfigError("max_batch_sentences must be >= 1", field="max_batch_sentences")


def plan_batches(costs: Sequence[int], budget: BatchBudget) -> list[list[int]]:
    """Indices of ``costs`` (padded length of each sentence, markers included), longest first,
    cut so that each batch has ``len(batch) * max cost <= budget.tokens`` and at most
    ``budget.sentences`` rows. Ties keep their input order (a stable sort), so the same
    input always gives the same batches. A sentence longer than the budget is a batch alone.
    """
    order = sorted(range(len(costs)), key=lambda i: -costs[i])
    batches: list[list[int]] = []
    batch: list[int] = []
    for i in order:
        width = costs[batch[0]] if batch else costs[i]
        if batch and ((len(batch) + 1) * width > budget.tokens or len(batch) >= budget.sentences):
            batches.append(batch)
            batch = []
        batch.append(i)
    if batch:
        batches.append(batch)
    return batches


# rows of a batch's token table: 0 the zero vector (padding), 1 and 2 the sentence markers,
# then the batch's distinct token texts. The markers are rows, never keys: no token text
# (not even "\x00<S>") can reach their vectors
_PAD, _BOS_ROW, _EOS_ROW, _FIRST_TOKEN_ROW = 0, 1, 2, 3


class CarriedState:
    """The LSTM state carried from one call to the next, row by row (AllenNLP's
    ``_EncoderBase``): row ``b`` of a call continues from row ``b`` of the store; rows
    never seen start from zero, and the store grows to the largest batch; a call's rows
    take their final state, rows past it keep theirs. Stored detached, as
    ``(h [2, L, rows, P], c [2, L, rows, C])``."""

    def __init__(self) -> None:
        self.stored: tuple[Tensor, Tensor] | None = None

    @property
    def rows(self) -> int:
        return 0 if self.stored is None else self.stored[0].shape[2]

    def initial(self, batch: int) -> BiLMState | None:
        """The state of a call's first ``batch`` rows (AllenNLP's ``_get_initial_states``)."""
        if self.stored is None:
            return None
        h, c = self.stored
        if batch > h.shape[2]:
            grow = batch - h.shape[2]
            h = torch.cat([h, h.new_zeros(*h.shape[:2], grow, h.shape[3])], 2)
            c = torch.cat([c, c.new_zeros(*c.shape[:2], grow, c.shape[3])], 2)
            self.stored = (h, c)
        layers = range(h.shape[1])
        return tuple([(h[d, k, :batch], c[d, k, :batch]) for k in layers] for d in (0, 1))  # type: ignore[return-value]

    def keep(self, final: BiLMState) -> None:
        """A call's rows take their final state (detached)."""
        h = torch.stack([torch.stack([s[0] for s in d]) for d in final]).detach()
        c = torch.stack([torch.stack([s[1] for s in d]) for d in final]).detach()
        if self.stored is not None and self.stored[0].shape[2] > h.shape[2]:
            b = h.shape[2]
            h = torch.cat([h, self.stored[0][:, :, b:]], 2)
            c = torch.cat([c, self.stored[1][:, :, b:]], 2)
        self.stored = (h, c)

    def reset(self, mask: Tensor | None = None) -> None:
        """Zero every row, or those where ``mask [rows]`` is set."""
        if mask is None or self.stored is None:
            self.stored = None
            return
        if mask.shape[0] != self.stored[0].shape[2]:
            raise InputError(
                f"reset_states: mask has {mask.shape[0]} rows, the state {self.stored[0].shape[2]}",
                field="mask",
            )
        keep = (~mask.bool()).to(self.stored[0].dtype).view(1, 1, -1, 1)
        self.stored = (self.stored[0] * keep, self.stored[1] * keep)


class Runner:
    """A :class:`BiLM`'s inference: the kernel chosen once (``kernels/select.py``
    ``choose_kernel``), the token-vector cache, the marker vectors, one lock.

    # Parameters

    model : `BiLM`
        The model, on ``device``; its weights are read, never changed.
    device, precision, weights, compile :
        As ``Embedder``'s (``choose_kernel``'s).
    token_cache_size : `int`, optional (default = `0`)
        Distinct token texts whose layer-0 vectors are kept (an LRU); 0: none.
    char_ids : optional
        ``(token, <S>, </S>)`` character-id functions (a model's own lexicon); default bytes.
    """

    def __init__(
        self,
        model: BiLM,
        *,
        device: torch.device,
        precision: str = "fp32",
        weights: str = "fp32",
        compile: bool = False,
        token_cache_size: int = 0,
        char_ids: tuple[Callable, Callable, Callable] | None = None,
    ) -> None:
        self.model, self.device, self.precision = model, device, precision
        self.kernel = choose_kernel(model, device, precision, weights, compile)
        # the one lock of every model call (batches, documents' rounds, carried state)
        self.lock = threading.Lock()
        self.compiled = compile  # padded lengths go in steps of 8 then (see run_tokens)
        self._ids = char_ids or (token_ids, bos_ids, eos_ids)
        self._cache: LRUCache | None = None
        self.resize_cache(token_cache_size)
        self.cache_hits = 0
        self.cache_misses = 0
        self._markers = KernelCache()  # the sentence markers' vectors, per weight version

    def resize_cache(self, size: int) -> None:
        """A new, empty token-vector cache of ``size`` entries (0: none)."""
        self._cache = LRUCache(size) if size > 0 else None

    @property
    def cache_size(self) -> int:
        return 0 if self._cache is None else int(self._cache.maxsize)

    def cache_items(self) -> list[tuple[str, Tensor]]:
        """The cache's entries, least recently used first (a benchmark restores them)."""
        return [] if self._cache is None else list(self._cache.items())

    def fill_cache(self, items: list[tuple[str, Tensor]]) -> None:
        if self._cache is not None:
            self._cache.update(items)

    @contextmanager
    def session(self) -> Iterator[None]:
        """A model call: the lock, inference mode, the precision's autocast."""
        with self.lock, torch.inference_mode(), autocast(self.device, self.precision):
            yield

    # -- layer 0 --------------------------------------------------------------------
    def token_vectors(self, keys: list[str]) -> Tensor:
        """``[U, P]`` layer-0 vectors for distinct token texts, cache first (in a session)."""
        if not keys:
            return torch.zeros(0, self.model.cfg.projection_dim, device=self.device)
        if self._cache is None:  # every key computed, in order: nothing to merge
            self.cache_misses += len(keys)
            return self._encode_keys(keys)
        vecs: list[Tensor | None] = [None] * len(keys)
        missing: list[int] = []
        for i, k in enumerate(keys):
            v = self._cache.get(k)
            if v is None:
                missing.append(i)
            else:
                vecs[i] = v
        self.cache_hits += len(keys) - len(missing)
        self.cache_misses += len(missing)
        if missing:
            computed = self._encode_keys([keys[i] for i in missing])
            for j, i in enumerate(missing):
                vecs[i] = computed[j]
                self._cache[keys[i]] = computed[j].clone()
        return torch.stack(vecs)  # type: ignore[arg-type]

    def marker_vectors(self) -> Tensor:
        """``[2, P]``: the vectors of ``<S>`` and ``</S>``, in every sentence and fixed by the
        weights, so computed once per weight version (not in every batch's CNN call)."""
        w = self.model.cfg.max_chars_per_token
        return self._markers.get_or_build(
            "markers",
            list(self.model.token_encoder.parameters()),
            lambda: self._encode_ids(np.stack([self._ids[1](w), self._ids[2](w)])),
        )

    def encode(self, char_ids: Tensor) -> Tensor:
        """Character ids ``[N, W]`` -> token vectors ``[N, P]`` (the kernel's CNN)."""
        with self.lock:
            return self.kernel.encode(char_ids)

    def _encode_keys(self, keys: list[str]) -> Tensor:
        w = self.model.cfg.max_chars_per_token
        return self._encode_ids(np.stack([self._ids[0](k, w) for k in keys]))

    def _encode_ids(self, ids: np.ndarray) -> Tensor:
        with autocast(self.device, self.precision):
            return self.kernel.encode(torch.from_numpy(ids).to(self.device)).float()

    # -- 1. a batch from a zero state -----------------------------------------------
    def contextualize(
        self, tokens: Tensor, lengths: Tensor, distinct: tuple[Tensor, Tensor] | None = None
    ) -> Tensor:
        """Token vectors ``[B, T, P]`` -> layers ``[L+1, B, T, 2P]`` (the kernel's)."""
        with self.lock:
            return self.kernel.contextualize(tokens, lengths, distinct)

    def run_tokens(self, sentences: Sequence[Sequence[str]]) -> list[np.ndarray]:
        """Token texts, one batch -> ``[L+1, T, D]`` float32 per sentence (markers removed)."""
        lengths = [len(s) + 2 for s in sentences]
        b, t = len(sentences), max(lengths)
        if self.compiled:  # the batch dim is dynamic, lengths go in steps of 8
            b_pad, t_pad = max(b, 2), -(-t // 8) * 8
        else:
            b_pad, t_pad = b, t
        keys: dict[str, int] = {}  # distinct token texts -> their row - _FIRST_TOKEN_ROW
        index = np.full((b_pad, t_pad), _PAD, dtype=np.int64)
        for r, sent in enumerate(sentences):
            index[r, 0], index[r, len(sent) + 1] = _BOS_ROW, _EOS_ROW
            for c, tok in enumerate(sent, start=1):
                index[r, c] = keys.setdefault(tok, len(keys)) + _FIRST_TOKEN_ROW
        with self.lock, torch.inference_mode():
            markers = self.marker_vectors()
            table = self.token_vectors(list(keys))
            table = torch.cat([markers.new_zeros(1, markers.shape[1]), markers, table])
            index_t = torch.from_numpy(index).to(self.device)
            tokens = table[index_t]
            lens = torch.tensor(lengths + [0] * (b_pad - b), device=self.device)
            if self.compiled:  # one graph per length bucket, whatever the batch size
                torch._dynamo.mark_dynamic(tokens, 0)
                torch._dynamo.mark_dynamic(lens, 0)
            with autocast(self.device, self.precision):
                # distinct: the CPU kernel runs the first layer's input matmul per distinct token
                layers = self.kernel.contextualize(tokens, lens, distinct=(table, index_t))
            layers = layers.float().cpu().numpy()
        return [np.ascontiguousarray(layers[:, r, 1 : lengths[r] - 1]) for r in range(b)]

    # -- 2. a batch from carried state ----------------------------------------------
    def run_from(self, tokens: Tensor, lengths: Tensor, carried: CarriedState) -> Tensor:
        """Token vectors ``[B, T, P]`` (markers included), per-row ``lengths`` -> layers
        ``[L+1, B, T, 2P]``, row b from ``carried``'s row b; ``carried`` then holds each
        row's state after its own last token (the backward direction's: its first). The
        model's own loop, under autograd when the caller has it on."""
        with self.lock:
            layers, final = self.model.contextualize_from(
                tokens, lengths, carried.initial(tokens.shape[0])
            )
            carried.keep(final)
        return layers

    # -- 3. a long sequence streamed in chunks --------------------------------------
    def stream_state(self) -> object:
        """A new stream row's zero state (opaque; :meth:`stream` updates it)."""
        return self.kernel.stream_state()

    def stream(self, inputs: Chunks, states: list, meanwhile: Meanwhile = None) -> ChunkLayers:
        """One chunk of each row, both directions (``BiLMKernel.stream``), in a
        :meth:`session`: ``inputs[r]`` = (forward chunk, backward chunk), each ``[n, P]``
        in its reading order, from ``states[r]`` -> per row and direction each layer's
        ``[n, P]``. One row runs in the native loop, several in one batched step."""
        return self.kernel.stream(inputs, states, meanwhile)


__all__ = [
    "DEFAULT_BATCH_TOKENS",
    "DEFAULT_MAX_BATCH_SENTENCES",
    "BatchBudget",
    "CarriedState",
    "Runner",
    "plan_batches",
]
