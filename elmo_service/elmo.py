"""A drop-in for ``allennlp.modules.elmo``: ``Elmo`` and ``batch_to_ids``.

    from elmo_service import Elmo, batch_to_ids      # was: from allennlp.modules.elmo import ...

    elmo = Elmo(options_file, weight_file, num_output_representations=1)
    out = elmo(batch_to_ids([["First", "sentence", "."], ["Another", "."]]))
    out["elmo_representations"][0]  # [2, 3, 2P]; out["mask"]: [2, 3] bool

AllenNLP 2.10's contract (``docs/library.md``, "Migrating from AllenNLP"): the same
signature, defaults, outputs, masks and gradients on the same weights (held to
AllenNLP itself by ``tests/elmo_service/test_elmo_module.py``), with these choices:

* **Frozen biLM** (``requires_grad=False``, the default): the biLM runs without
  autograd in the serving kernels (on the CPU in fp32: ``kernels/`` ``CpuBiLM``,
  each distinct token's character CNN once per batch); only the mixes learn.
* **Fine-tuning** (``requires_grad=True``): eager autograd through the model,
  whose LSTM layers run the fused training kernel (``lstm.py`` ``LstmpFunction``).
  The pretraining dropout inside the biLM is off (AllenNLP's biLM has none) unless
  ``bilm_dropout`` asks for it.
* **State**: ``stateful=False`` (the default) starts every sentence from a zero
  state, as the service does; ``stateful=True`` carries the LSTM state from one
  call to the next, row b continuing row b, as AllenNLP and bilm-tf do.
* ``do_layer_norm=True`` normalises each layer over the whole batch's unmasked
  positions, as AllenNLP does (the service's task mixes normalise per sentence).
* **Caches** (docs/library.md): the frozen path's packed weight copies follow any
  write to the biLM's weights (``bilm.layer_cache.WeightsWatch``, checked each forward);
  ``cache_bytes`` keeps a frozen biLM's layers per sentence; neither is pickled.
  Under ``torch.compile`` the biLM runs eager; ``.double()`` runs it in float64.
* **AllenNLP's checkpoints**: ``load_state_dict`` also takes AllenNLP's ``Elmo`` names
  (``elmo_service/allennlp_names.py``), alone or inside a whole model's checkpoint;
  :meth:`Elmo.allennlp_state_dict` writes them. ``_ElmoBiLm`` and ``_ElmoCharacterEncoder``
  (at the end of this file) are AllenNLP's inner modules under their names.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from elmo_service.allennlp_names import (
    BILM_LAYOUT,
    ELMO_LAYOUT,
    ENCODER_LAYOUT,
    MIXES_ONLY,
    ResetHandle,
    allennlp_keys,
)
from elmo_service.bilm.char_ids import bos_ids, eos_ids, token_ids
from elmo_service.bilm.layer_cache import LayerCache, WeightsWatch, sentence_key, weights_id
from elmo_service.bilm.model import N_CHAR_IDS, BiLM
from elmo_service.bilm.runner import CarriedState, Runner
from elmo_service.errors import ConfigError, InputError
from elmo_service.scalar_mix import MAX_MIX_WEIGHT, ScalarMix
from elmo_service.tokenizers import Tokenizer

MAX_CHARS = 50  # AllenNLP's ELMoCharacterMapper.max_word_length


def batch_to_ids(batch: Sequence[Sequence[str]], max_chars: int = MAX_CHARS) -> Tensor:
    """Token lists -> character ids ``LongTensor [B, max tokens, 50]``, AllenNLP's
    ``batch_to_ids``: each token's UTF-8 bytes cut to 48, in begin/end-of-word
    markers, +1; shorter sentences padded with all-zero tokens. (AllenNLP gives
    ``[B, 0]`` for a batch of empty sentences; this gives ``[B, 0, 50]``.)"""
    if isinstance(batch, (str, bytes)) or not isinstance(batch, Sequence):
        raise InputError(
            f"batch_to_ids takes a list of token lists, got {type(batch).__name__}", field="batch"
        )
    if not batch:
        raise InputError("batch_to_ids got no sentences", field="batch")
    for b, sentence in enumerate(batch):
        if isinstance(sentence, (str, bytes)) or not isinstance(sentence, Sequence):
            raise InputError(
                f"sentence {b} is a {type(sentence).__name__}, not a list of tokens "
                "(split it into tokens first)",
                field=f"batch[{b}]",
            )
        for i, token in enumerate(sentence):
            if not isinstance(token, str):
                raise InputError(
                    f"token {i} of sentence {b} is a {type(token).__name__}, not a str",
                    field=f"batch[{b}][{i}]",
                )
    out = np.zeros((len(batch), max(map(len, batch)), max_chars), dtype=np.int64)
    for b, sentence in enumerate(batch):
        for i, token in enumerate(sentence):
            out[b, i] = token_ids(token, max_chars)  # "<S>", "</S>": the markers, as there
    return torch.from_numpy(out)


def _check_char_ids(ids: Tensor, max_chars: int) -> Tensor:
    """``[B, T, W]`` integer ids in 0..261, padding tokens only at the end of a row."""
    if not isinstance(ids, Tensor):
        raise InputError(
            f"char_ids must be a LongTensor [batch, timesteps, {max_chars}] "
            f"(from batch_to_ids), got {type(ids).__name__}",
            field="char_ids",
        )
    if ids.dtype.is_floating_point or ids.dtype == torch.bool or ids.dim() < 3:
        raise InputError(
            f"char_ids must be an integer tensor [batch, timesteps, {max_chars}], "
            f"got {ids.dtype} {list(ids.shape)}",
            field="char_ids",
        )
    if ids.shape[-1] != max_chars:
        raise InputError(
            f"char_ids' last dimension is {ids.shape[-1]}, the model reads {max_chars} "
            "characters per token",
            field="char_ids",
        )
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= N_CHAR_IDS):
        raise InputError(f"char_ids must lie in 0..{N_CHAR_IDS - 1}", field="char_ids")
    return ids.long()


def _boundaries(inputs: Tensor, mask: Tensor, bos: Tensor, eos: Tensor) -> tuple[Tensor, Tensor]:
    """AllenNLP's ``add_sentence_boundary_token_ids``: ``[B, T, D]`` -> ``[B, T+2, D]``
    with ``bos`` at 0 and ``eos`` after each row's last token, and the new mask."""
    b, t = mask.shape
    lengths = mask.sum(1)
    out = inputs.new_zeros(b, t + 2, inputs.shape[-1])
    out[:, 1:-1] = inputs
    out[:, 0] = bos
    out[torch.arange(b, device=inputs.device), lengths + 1] = eos
    return out, lengths + 2


def _without_boundaries(x: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """AllenNLP's ``remove_sentence_boundaries``: ``[B, T+2, D]`` -> ``[B, T, D]`` (zero
    past each row's tokens) and the mask of its tokens."""
    t = x.shape[1] - 2
    mask = torch.arange(t, device=x.device).unsqueeze(0) < (lengths - 2).unsqueeze(1)
    return x[:, 1:-1] * mask.unsqueeze(-1).to(x.dtype), mask


def batch_layer_norm(h: Tensor, mask: Tensor) -> Tensor:
    """AllenNLP's ``ScalarMix`` layer norm: one mean and variance over every unmasked
    position of the whole batch (``mask [B, T]``), applied to every position."""
    m = mask.unsqueeze(-1).to(h.dtype)
    n = mask.sum() * h.shape[-1]
    hm = h * m
    mean = hm.sum() / n
    var = (((hm - mean) * m) ** 2).sum() / n
    tiny = 1e-4 if h.dtype == torch.float16 else 1e-13  # allennlp.nn.util.tiny_value_of_dtype
    return (h - mean) / torch.sqrt(var + tiny)


def _fixed_weights(weights: Sequence[float], n_layers: int) -> list[float]:
    """``scalar_mix_parameters`` as this project's mix takes them: softmax is
    shift-invariant, and a weight more than ``MAX_MIX_WEIGHT`` below the largest is
    exactly 0 after it in float32, so AllenNLP's ``[-9e10, 1, -9e10]`` works."""
    w = [float(x) for x in weights]
    if len(w) != n_layers or not all(np.isfinite(w)):
        raise ConfigError(
            f"scalar_mix_parameters needs {n_layers} finite weights (one per biLM layer), "
            f"got {list(weights)!r}",
            field="scalar_mix_parameters",
        )
    top = max(w)
    return [max(x - top, -MAX_MIX_WEIGHT) for x in w]


def _new_cache(
    cache_bytes: int,
    requires_grad: bool,
    stateful: bool,
    module: nn.Module | None,
    cache_dir: str | Path | None,
) -> LayerCache | None:
    """The layer cache ``cache_bytes`` asks for, or None; refused where a sentence's
    layers are not a function of the sentence alone."""
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
        raise ConfigError(
            f"cache_bytes is a byte budget (an int >= 0, e.g. 2**30), got {cache_bytes!r}",
            field="cache_bytes",
        )
    if not cache_bytes:
        if cache_dir is not None:
            raise ConfigError("cache_dir needs cache_bytes (the memory side)", field="cache_dir")
        return None
    why = (
        "requires_grad=True (a fine-tuned biLM changes every step)"
        if requires_grad
        else "stateful=True (a row's layers depend on the batches before)"
        if stateful
        else "a custom module (its layers are its own)"
        if module is not None
        else None
    )
    if why:
        raise ConfigError(f"cache_bytes needs a frozen biLM; not with {why}", field="cache_bytes")
    return LayerCache(cache_bytes, cache_dir)


class Elmo(nn.Module):
    """ELMo representations from a pretrained biLM: AllenNLP's ``Elmo``.

    # Parameters

    options_file, weight_file : `str`
        bilm-tf's ``options.json`` and ``weights.hdf5`` (the published ELMo files);
        ``None`` for both with ``module``. :meth:`from_pretrained` reads this
        project's artifacts.
    num_output_representations : `int`
        The number of independent trainable mixes of the one biLM run (e.g. 2: one
        at a task network's input, one at its output).
    requires_grad : `bool`, optional (default = `False`)
        Fine-tune every biLM weight. False: the biLM is frozen and runs without
        autograd in the serving kernels; only the mixes learn.
    do_layer_norm : `bool`, optional (default = `False`)
        Normalise each layer over the batch's unmasked positions (AllenNLP's).
    dropout : `float`, optional (default = `0.5`)
        On each output representation, in ``train()`` mode only.
    vocab_to_cache : `list[str]`, optional
        Words whose character CNN vectors are computed once; ``forward`` then
        also takes ``word_inputs`` (ids into this list).
    keep_sentence_boundaries : `bool`, optional (default = `False`)
        Keep the ``<S>``/``</S>`` positions in the outputs.
    scalar_mix_parameters : `list[float]`, optional
        Fixed (untrained) pre-softmax mix weights; gamma stays 1.
    module : `nn.Module`, optional
        Instead of a pretrained biLM: a module with ``num_layers`` whose forward
        returns ``{"activations": [...], "mask": ...}`` (AllenNLP's ``_ElmoBiLm`` contract).
    stateful : `bool`, optional (default = `False`)
        Carry the LSTM state from one call to the next, row by row (AllenNLP and
        bilm-tf); :meth:`reset_states` zeroes it. False: every sentence starts
        from a zero state, so its vectors do not depend on earlier batches.
    bilm_dropout : `float`, optional (default = `0.0`)
        The biLM's pretraining dropout when fine-tuning in ``train()`` mode.
    cache_bytes : `int`, optional (default = `0`: off)
        A frozen biLM runs once per sentence: its layers for each sentence seen
        (keyed by the sentence's character ids) are kept, up to this many bytes
        (least recently used first out), and a sentence seen again runs only the
        mixes. Needs ``requires_grad=False`` and ``stateful=False``; used while the
        biLM runs frozen (``bilm_dropout`` 0, or ``eval()`` mode). Cleared when a
        biLM weight changes. :attr:`cache_stats` says how it went.
    cache_dir : `str | Path`, optional
        Also keep the cached layers in this folder (a subfolder per weights, one
        safetensors shard per batch): another process on the same weights reads
        them back instead of running the biLM. Not bounded: delete it freely.
    """

    _allennlp_layout = ELMO_LAYOUT  # where AllenNLP's checkpoints keep the parts

    def __init__(
        self,
        options_file: str | Path | None,
        weight_file: str | Path | None,
        num_output_representations: int,
        requires_grad: bool = False,
        do_layer_norm: bool = False,
        dropout: float = 0.5,
        vocab_to_cache: list[str] | None = None,
        keep_sentence_boundaries: bool = False,
        scalar_mix_parameters: list[float] | None = None,
        module: nn.Module | None = None,
        *,
        stateful: bool = False,
        bilm_dropout: float = 0.0,
        bilm: BiLM | None = None,
        tokenizer: Tokenizer | None = None,
        cache_bytes: int = 0,
        cache_dir: str | Path | None = None,
    ) -> None:
        super().__init__()
        if module is not None or bilm is not None:
            if options_file is not None or weight_file is not None:
                raise ConfigError(
                    "give options_file and weight_file, or a module, not both", field="module"
                )
        elif options_file is None or weight_file is None:
            raise ConfigError("options_file and weight_file are both needed", field="options_file")
        if num_output_representations < 1:
            raise ConfigError(
                f"num_output_representations must be >= 1, got {num_output_representations}",
                field="num_output_representations",
            )
        if not 0 <= bilm_dropout < 1:
            raise ConfigError(
                f"bilm_dropout must be in [0, 1), got {bilm_dropout}", field="bilm_dropout"
            )
        self.tokenizer = tokenizer
        # not a second submodule: the module's weights are _elmo_lstm's, as in AllenNLP
        self.__dict__["_module"] = module
        if module is None:
            if bilm is None:
                from elmo_service.convert import load_bilm  # h5py: only for hdf5 files

                bilm, _ = load_bilm(options_file, weight_file)
            if bilm.token_encoder.lexicon:  # batch_to_ids gives bytes, not its lexicon's ids
                raise ConfigError(
                    "an ELMoForManyLangs model reads its own character lexicon, not "
                    "batch_to_ids' bytes: use elmo_service.manylangs.ManyLangsEmbedder "
                    "(stateful=True for its carried state) or Embedder",
                    field="bilm",
                )
            bilm.dropout.p = bilm_dropout
            if not requires_grad:
                bilm.requires_grad_(False)
        self._elmo_lstm = module if module is not None else bilm
        if module is None:
            # AllenNLP's path to the carried state: elmo._elmo_lstm._elmo_lstm.reset_states()
            bilm.__dict__["_elmo_lstm"] = ResetHandle(self)
        # a checkpoint written with AllenNLP's Elmo loads under its own names
        self.register_load_state_dict_pre_hook(self._allennlp_keys)
        self.stateful = stateful
        self._carried = CarriedState()  # stateful=True: each row's LSTM state
        self._keep_sentence_boundaries = keep_sentence_boundaries
        self._dropout = nn.Dropout(p=dropout)
        self._do_layer_norm = do_layer_norm
        n_layers = module.num_layers if module is not None else bilm.n_output_layers
        fixed = scalar_mix_parameters is not None
        weights = _fixed_weights(scalar_mix_parameters, n_layers) if fixed else None
        self._scalar_mixes: list[ScalarMix] = []
        for k in range(num_output_representations):
            mix = ScalarMix(n_layers, weights=weights, trainable=not fixed)
            self.add_module(f"scalar_mix_{k}", mix)
            self._scalar_mixes.append(mix)
        self._kernel = None  # the serving kernel, built on the first frozen forward
        # the kernel's packed copies and the cached layers follow the weights (see WeightsWatch)
        self._watch = WeightsWatch(() if module is not None else bilm.parameters())
        self._layer_cache = _new_cache(cache_bytes, requires_grad, stateful, module, cache_dir)
        self._word_embedding: nn.Embedding | None = None
        if vocab_to_cache:
            if module is not None:
                raise ConfigError(
                    "vocab_to_cache needs the pretrained biLM", field="vocab_to_cache"
                )
            self._cache_vocab(vocab_to_cache, requires_grad)

    @classmethod
    def from_pretrained(
        cls, artifact_dir: str | Path, num_output_representations: int = 1, **kwargs
    ) -> Elmo:
        """An ``Elmo`` over one of this project's artifact folders (``load_artifact``).

        The artifact's tokenizer is :attr:`tokenizer`: ``batch_to_ids`` must get the
        tokens it gives (``[t.piece for t in elmo.tokenizer(text)]``): words for a
        converted bilm-tf model, sentencepiece pieces for a model trained here.
        """
        from elmo_service.artifact import load_artifact

        art = load_artifact(artifact_dir)
        return cls(
            None,
            None,
            num_output_representations,
            bilm=art.model,
            tokenizer=art.tokenizer,
            **kwargs,
        )

    # ------------------------------------------------------------------ AllenNLP's API
    def get_output_dim(self) -> int:
        if self._module is not None:
            return self._module.get_output_dim()
        return self._elmo_lstm.cfg.output_dim

    def allennlp_state_dict(self) -> dict[str, Tensor]:
        """This module's weights under ``allennlp.modules.elmo.Elmo``'s names (its
        ``load_state_dict`` takes them, strict); for a model that holds this module, use
        ``elmo_service.allennlp_names.to_allennlp(model.state_dict())``."""
        from elmo_service.allennlp_names import to_allennlp

        return to_allennlp(self.state_dict())

    def _allennlp_keys(self, module, state_dict: dict, prefix: str, *args) -> None:
        """The pre-hook: AllenNLP's names read as ours (a module of the caller's: the mixes)."""
        layout = self._allennlp_layout if self._module is None else MIXES_ONLY
        allennlp_keys(state_dict, prefix, layout)

    def reset_states(self, mask: Tensor | None = None) -> None:
        """Zero the carried state (``stateful=True``): all rows, or those where ``mask [B]``."""
        self._carried.reset(mask)

    def forward(self, inputs: Tensor, word_inputs: Tensor | None = None) -> dict:
        """``inputs [B, T, 50]`` character ids (``batch_to_ids``; more leading dims are
        flattened and restored) -> ``{"elmo_representations": [k x [B, T, 2P]], "mask":
        [B, T] bool}``."""
        w = MAX_CHARS if self._module is not None else self._elmo_lstm.cfg.max_chars_per_token
        inputs = _check_char_ids(inputs, w)
        lead = inputs.shape[:-2]
        # explicit row count: a batch of empty sentences ([B, 0, W]) has no -1 to infer
        ids = inputs.reshape(int(np.prod(lead)), *inputs.shape[-2:])
        words = None
        if word_inputs is not None and self._word_embedding is not None:
            words = word_inputs.reshape(int(np.prod(word_inputs.shape[:-1])), word_inputs.shape[-1])
        if self._module is not None:
            out = self._module(ids, words)
            layers, mask = torch.stack(list(out["activations"])), out["mask"]
            lengths = mask.sum(1)
        else:
            layers, lengths = self._bilm_layers(ids, words)
            mask = torch.arange(layers.shape[2], device=ids.device) < lengths.unsqueeze(1)
        if self._do_layer_norm:
            layers = torch.stack([batch_layer_norm(h, mask) for h in layers])
        reps = []
        for mix in self._scalar_mixes:
            rep = mix(layers)
            if not self._keep_sentence_boundaries:
                rep, out_mask = _without_boundaries(rep, lengths)
            reps.append(self._dropout(rep))
        out_mask = mask if self._keep_sentence_boundaries else out_mask
        shape = lead if words is None else word_inputs.shape[:-1]
        return {
            "elmo_representations": [r.reshape(*shape, *r.shape[1:]) for r in reps],
            "mask": out_mask.reshape(*shape, out_mask.shape[-1]),
        }

    @property
    def cache_stats(self) -> dict | None:
        """The layer cache's entries, bytes, hits and misses (``cache_bytes``); None when off."""
        return None if self._layer_cache is None else self._layer_cache.stats()

    def __getstate__(self) -> dict:
        # the serving kernel (opaque oneDNN tensors: not picklable), the weights' fingerprints
        # and the cached layers are caches: dropped here, rebuilt on the next forward
        state = self.__dict__.copy()
        state["_kernel"] = None
        state["_watch"] = WeightsWatch()
        cache = state.get("_layer_cache")
        state["_layer_cache"] = (
            None if cache is None else LayerCache(cache.max_bytes, cache.directory)
        )
        return state

    # ------------------------------------------------------------------ the biLM
    # torch.compile traces the mixes and the caller's network; the biLM runs eager: its
    # kernels are numba and oneDNN calls on packed weights, with data-dependent shapes
    @torch.compiler.disable
    def _bilm_layers(self, ids: Tensor, words: Tensor | None) -> tuple[Tensor, Tensor]:
        """Char ids ``[B, T, W]`` -> layers ``[L+1, B, T+2, 2P]`` and lengths with markers."""
        bilm: BiLM = self._elmo_lstm
        grad = torch.is_grad_enabled() and any(p.requires_grad for p in bilm.parameters())
        fast = not grad and not (self.training and bilm.dropout.p > 0)
        if not grad:  # under autograd the torch code reads the weights themselves
            self._follow_weights()
        if (
            words is not None
            and words.numel()
            and int(words.max()) >= self._word_embedding.num_embeddings
        ):
            words = None  # a word outside the cached vocabulary: the CNN (AllenNLP backs off too)
        # AllenNLP: a token is real where any id is non-zero (with a cached vocabulary: id > 0)
        mask = (ids > 0).any(-1) if words is None else words > 0
        lengths = mask.sum(1)
        if bool((mask[:, 1:] & ~mask[:, :-1]).any()):
            row = int((mask[:, 1:] & ~mask[:, :-1]).any(1).nonzero()[0])
            raise InputError(
                f"char_ids row {row} has a padding token (all zeros) before a real token",
                field="char_ids",
            )
        if self._layer_cache is not None and fast and words is None and not self.stateful:
            return self._cached_layers(ids, mask, lengths), lengths + 2
        return self._run_bilm(ids, words, mask, lengths, fast), lengths + 2

    def _run_bilm(
        self, ids: Tensor, words: Tensor | None, mask: Tensor, lengths: Tensor, fast: bool
    ) -> Tensor:
        """The biLM itself on a checked batch: layers ``[L+1, B, T+2, 2P]``."""
        bilm: BiLM = self._elmo_lstm
        w = ids.shape[-1]
        distinct = None
        if words is not None:
            tokens, _ = _boundaries(
                self._word_embedding(words), mask, self._bos_embedding, self._eos_embedding
            )
        else:
            bos, eos = (torch.from_numpy(f(w)).to(ids.device) for f in (bos_ids, eos_ids))
            full, _ = _boundaries(ids, mask, bos, eos)
            tokens, distinct = self._encode(full, fast)
        with torch.set_grad_enabled(torch.is_grad_enabled() and not fast):
            if self.stateful:
                layers = self._runner().run_from(tokens, lengths + 2, self._carried)
            elif fast:
                layers = self._runner().contextualize(tokens, lengths + 2, distinct)
            else:
                layers = bilm.contextualize(tokens, lengths + 2)
        return layers

    def _cached_layers(self, ids: Tensor, mask: Tensor, lengths: Tensor) -> Tensor:
        """:meth:`_run_bilm` (frozen) through the layer cache: the biLM runs only on the
        sentences not in it (each once, however often the batch repeats it)."""
        cache = self._layer_cache
        n = lengths.tolist()
        rows = ids.cpu().numpy()
        keys = [sentence_key(rows[b, : n[b]]) for b in range(len(n))]
        got = [cache.get(k) for k in keys]
        got = [None if g is None else g.to(ids.device) for g in got]  # read from disk: CPU
        todo: dict[bytes, int] = {}
        for b, hit in enumerate(got):
            if hit is None:
                todo.setdefault(keys[b], b)
        if todo:
            run = list(todo.values())
            t = max(n[b] for b in run)
            pick = torch.tensor(run, device=ids.device)
            layers = self._run_bilm(ids[pick, :t], None, mask[pick, :t], lengths[pick], True)
            fresh = {}
            for j, b in enumerate(run):
                # a copy of its own: a view would keep the whole batch's tensor alive
                one = layers[:, j, : n[b] + 2].clone(memory_format=torch.contiguous_format)
                cache.put(keys[b], one)
                fresh[keys[b]] = one
            got = [fresh[k] if g is None else g for k, g in zip(keys, got, strict=True)]
            cache.flush()  # with cache_dir: this batch's new sentences, one shard
        first = got[0]
        out = first.new_zeros(first.shape[0], len(n), ids.shape[1] + 2, first.shape[-1])
        for b, layers in enumerate(got):  # zero past each sentence, as the biLM gives
            out[:, b, : n[b] + 2] = layers
        return out

    def _follow_weights(self) -> None:
        """After any change to a biLM weight (however written: see ``WeightsWatch``) the
        next forward rebuilds the kernel's packed copies and forgets cached layers."""
        bilm: BiLM = self._elmo_lstm
        if self._watch.changed(list(bilm.parameters())):
            self._kernel = None
            bilm.token_encoder.forget_tables()  # the torch path's lookup tables (model.py)
            cache = self._layer_cache
            if cache is not None and cache.directory is not None:
                cache.scope(weights_id(bilm.parameters()))  # on disk: a folder per weights
            elif cache is not None:
                cache.clear()

    def _encode(self, ids: Tensor, fast: bool) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Char ids ``[B, T, W]`` -> token vectors ``[B, T, P]`` and ``(table [U, P],
        index [B, T])``: each distinct token's CNN once (a batch repeats its words,
        markers and padding; under autograd the gradients of its copies add up in the
        index), and the serving kernel's first input matmul once per distinct token too."""
        b, t, w = ids.shape
        uniq, index = torch.unique(ids.reshape(b * t, w), dim=0, return_inverse=True)
        if not fast:
            table = self._elmo_lstm.token_encoder(uniq)
        else:
            with torch.no_grad():
                table = self._runner().encode(uniq)
        return table[index].reshape(b, t, -1), (table, index.reshape(b, t))

    def _runner(self) -> Runner:
        """The biLM's runner (``bilm/runner.py``: the native CPU kernels for an fp32 model on
        the CPU, else the model's own inference loop); rebuilt when the device or dtype
        changes, or a weight (``_follow_weights``)."""
        p = self._elmo_lstm.token_encoder.projection.weight
        key = (p.device, p.dtype)
        if self._kernel is None or self._kernel[0] != key:
            precision = "fp32" if p.dtype == torch.float32 else "auto"
            self._kernel = (key, Runner(self._elmo_lstm, device=p.device, precision=precision))
        return self._kernel[1]

    def _cache_vocab(self, vocab: list[str], requires_grad: bool) -> None:
        """AllenNLP's ``create_cached_cnn_embeddings``: each word's CNN vector once."""
        bilm: BiLM = self._elmo_lstm
        w = bilm.cfg.max_chars_per_token
        ids = torch.from_numpy(
            np.stack([bos_ids(w), eos_ids(w), *(token_ids(t, w) for t in vocab)])
        )
        with torch.no_grad():
            table = bilm.token_encoder(ids)
        # buffers, so that .to(device) moves them with the table
        self.register_buffer("_bos_embedding", table[0].clone(), persistent=False)
        self.register_buffer("_eos_embedding", table[1].clone(), persistent=False)
        self._word_embedding = nn.Embedding.from_pretrained(
            table[2:].clone(), freeze=not requires_grad, padding_idx=0
        )


# ---------------------------------------------------------------------- AllenNLP's inner modules
# ``_ElmoBiLm(options, weights)(char_ids) -> {"activations": [L+1 x [B, T+2, 2P]], "mask"}`` and
# ``_ElmoCharacterEncoder(options, weights)(char_ids) -> {"token_embedding", "mask"}``, as
# AllenNLP 2.10 names and calls them: the same biLM code as Elmo's (the bilm is Elmo without
# its mixes), frozen by default and stateless unless ``stateful=True`` (AllenNLP's carries).
class _ElmoBiLm(Elmo):
    """AllenNLP's ``_ElmoBiLm``: character ids -> every biLM layer, with the boundaries."""

    _allennlp_layout = BILM_LAYOUT

    def __init__(
        self,
        options_file: str | Path,
        weight_file: str | Path,
        requires_grad: bool = False,
        vocab_to_cache: list[str] | None = None,
        *,
        stateful: bool = False,
    ) -> None:
        super().__init__(
            options_file,
            weight_file,
            1,
            requires_grad=requires_grad,
            dropout=0.0,
            vocab_to_cache=vocab_to_cache,
            stateful=stateful,
        )
        del self.scalar_mix_0  # the layers themselves are the output
        self._scalar_mixes = []
        self.num_layers = self._elmo_lstm.n_output_layers

    def get_output_dim(self) -> int:
        return 2 * self._elmo_lstm.cfg.projection_dim

    def forward(self, inputs: Tensor, word_inputs: Tensor | None = None) -> dict:
        ids = _check_char_ids(inputs, self._elmo_lstm.cfg.max_chars_per_token)
        words = word_inputs if self._word_embedding is not None else None
        layers, lengths = self._bilm_layers(ids, words)
        mask = torch.arange(layers.shape[2], device=ids.device) < lengths.unsqueeze(1)
        return {"activations": list(layers.unbind(0)), "mask": mask}


class _ElmoCharacterEncoder(nn.Module):
    """AllenNLP's ``_ElmoCharacterEncoder``: character ids -> context-free token vectors
    (the biLM's character CNN alone; its weights under ``token_encoder.``)."""

    _allennlp_layout = ENCODER_LAYOUT
    _module = None  # for the checkpoint pre-hook, as on Elmo

    def __init__(
        self, options_file: str | Path, weight_file: str | Path, requires_grad: bool = False
    ) -> None:
        super().__init__()
        from elmo_service.convert import load_bilm  # h5py: only for hdf5 files

        bilm, _ = load_bilm(options_file, weight_file)
        if bilm.token_encoder.lexicon:
            raise ConfigError(
                "an ELMoForManyLangs model reads its own character lexicon, not "
                "batch_to_ids' bytes",
                field="weight_file",
            )
        self.token_encoder = bilm.token_encoder.requires_grad_(requires_grad)
        self.register_load_state_dict_pre_hook(
            lambda module, sd, prefix, *args: allennlp_keys(sd, prefix, ENCODER_LAYOUT)
        )

    def get_output_dim(self) -> int:
        return self.token_encoder.cfg.projection_dim

    def forward(self, inputs: Tensor) -> dict:
        w = self.token_encoder.cfg.max_chars_per_token
        ids = _check_char_ids(inputs, w)
        mask = (ids > 0).any(-1)
        bos, eos = (torch.from_numpy(f(w)).to(ids.device) for f in (bos_ids, eos_ids))
        full, lengths = _boundaries(ids, mask, bos, eos)
        b, t = full.shape[:2]
        vectors = self.token_encoder(full.reshape(b * t, w)).reshape(b, t, -1)
        mask = torch.arange(t, device=ids.device) < lengths.unsqueeze(1)
        return {"token_embedding": vectors, "mask": mask}
