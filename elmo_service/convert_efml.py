"""ELMoForManyLangs model folders -> our artifact.

    model_dir/ (config.json, <network>.json, char.dic, [word.dic],
                token_embedder.pkl, encoder.pkl)   --convert_efml-->   artifact (artifact.py)

What ELMoForManyLangs (HIT-SCIR, PyPI ``elmoformanylangs==0.0.4.post2``) computes, and how
each part maps onto :class:`elmo_service.bilm.model.BiLM` (facts in
``shared/reference/elmoformanylangs-format.md``; parity tested against the package itself
in ``tests/elmo_service/test_efml_parity.py``):

* characters and words come from its lexicons, not bytes: ``char.dic``/``word.dic``
  travel verbatim and ``elmo_service/bilm/lexicon.py`` builds its ids, quirks included;
  ``cfg.char_vocab_size`` rows of character embedding, ``cfg.word_dim`` wide word
  vectors (``word_vocab_size`` rows) put before the character features;
* ``cnn`` token embedder: Conv1d per width, max, activation, ``n_highway`` highway
  layers (relu), ``Linear([word ; features] -> projection_dim)`` with bias. Its highway
  gate multiplies the *carried* input (``g x + (1 - g) relu(t)``), ours the transform:
  the gate rows are negated (``sigmoid(-z) = 1 - sigmoid(z)``);
* ``elmo`` encoder: AllenNLP's ``LstmCellWithProjection`` (input matmul without bias,
  state matmul with it, gates ``i, f, g, o``; cell clip, then projection clip, a clip of
  0 meaning none), residual connections from the second layer: our ``LstmLayer``, gates
  reordered to ``i, f, o, g`` and the one bias moved to the input matmul.

Anything else it can describe (the ``lstm`` token embedder, the ``lstm`` encoder, a
model without characters) is refused in one line naming it. The pickles hold tensors
only and are read with ``torch.load(..., weights_only=True)``: never unpickled freely.
"""

from __future__ import annotations

import re
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elmo_service.artifact import atomic_dir, save_artifact, sha256_file
from elmo_service.bilm.config import BiLMConfig
from elmo_service.bilm.lexicon import Lexicon
from elmo_service.bilm.model import BiLM
from elmo_service.efml_folder import ENCODER_FILE, TOKEN_EMBEDDER_FILE, Shape, read_folder
from elmo_service.errors import ArtifactError, ConfigError
from elmo_service.tokenizers import LexiconTokenizer

SOURCE_FORMAT = "elmoformanylangs"
# its gates (i, f, g, o) -> ours (i, f, o, g)
_EFML_TO_OURS = (0, 1, 3, 2)


def is_efml_dir(path: str | Path) -> bool:
    """A folder holding an ELMoForManyLangs model (its two pickles and config.json)."""
    p = Path(path)
    return p.is_dir() and all((p / f).is_file() for f in ("config.json", ENCODER_FILE))


def config_from_network(
    net: dict[str, Any], shape: Shape, char_rows: int, word_rows: int
) -> BiLMConfig:
    """Its network config (kinds and sizes checked by ``efml_folder.shape_of``) ->
    :class:`BiLMConfig`."""
    te, enc = net["token_embedder"], net["encoder"]
    clip = {k: (enc.get(k) or None) for k in ("cell_clip", "proj_clip")}  # its `if clip:`
    dropout = net.get("dropout", 0.1)
    try:
        return BiLMConfig(
            char_dim=shape.char_dim,
            filters=shape.filters,
            n_highway=shape.n_highway,
            activation=te["activation"],
            max_chars_per_token=shape.max_chars,
            char_vocab_size=char_rows,
            word_dim=shape.word_dim,
            word_vocab_size=word_rows if shape.word_dim else 0,
            projection_dim=shape.projection_dim,
            lstm_dim=shape.dim,
            n_layers=shape.n_layers,
            cell_clip=clip["cell_clip"],
            proj_clip=clip["proj_clip"],
            residual=True,
            dropout=dropout if isinstance(dropout, int | float) and 0 <= dropout < 1 else 0.1,
        )
    except (TypeError, ValueError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(
            f"ELMoForManyLangs model: network config: {first}", field="config"
        ) from None


# torch's message for a refused pickle ends with advice to load it with weights_only=False:
# advice a user must never get from us. Keep what it names, drop the rest.
_UNSUPPORTED = re.compile(r"Unsupported (?:global|operand)[^.\n]*")


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    """The tensors, once ``efml_folder`` has checked every declared size against the
    file: no storage is larger than the file (zip archives are mapped, not read)."""
    try:  # tensors only: never unpickle arbitrary objects
        state = torch.load(
            path, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(path)
        )
    except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ...
        m = _UNSUPPORTED.search(str(e))
        why = m.group(0) if m else type(e).__name__
        raise ArtifactError(
            f"{path.name} is not a state dict of tensors ({why}); it is read as tensors only "
            "and never unpickled freely",
            field=path.name,
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ArtifactError(f"{path.name} is not a state dict of tensors", field=path.name)
    for k, v in state.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise ArtifactError(f"{path.name}: {k} holds NaN or infinite values", field=k)
    return state


def _gates(x: torch.Tensor) -> torch.Tensor:
    blocks = x.chunk(4, dim=0)
    return torch.cat([blocks[k] for k in _EFML_TO_OURS], dim=0)


def state_dict_from_efml(
    te: dict[str, torch.Tensor], enc: dict[str, torch.Tensor], cfg: BiLMConfig
) -> dict[str, torch.Tensor]:
    """Its two state dicts -> our ``BiLM`` state dict (shapes checked by the caller's load)."""

    def get(sd: dict[str, torch.Tensor], file: str, key: str) -> torch.Tensor:
        if key not in sd:
            raise ArtifactError(f"{file} lacks {key!r}", field=key)
        return sd[key].detach().to(torch.float32)

    def t(key: str) -> torch.Tensor:
        return get(te, TOKEN_EMBEDDER_FILE, key)

    def e(key: str) -> torch.Tensor:
        return get(enc, ENCODER_FILE, key)

    sd = {"token_encoder.char_embed.weight": t("char_emb_layer.embedding.weight")}
    if cfg.word_dim:
        sd["token_encoder.word_embed.weight"] = t("word_emb_layer.embedding.weight")
    for i in range(len(cfg.filters)):
        sd[f"token_encoder.convs.{i}.weight"] = t(f"convolutions.{i}.weight")
        sd[f"token_encoder.convs.{i}.bias"] = t(f"convolutions.{i}.bias")
    f = cfg.n_filters
    for k in range(cfg.n_highway):
        w, b = t(f"highways._layers.{k}.weight").clone(), t(f"highways._layers.{k}.bias").clone()
        w[f:], b[f:] = -w[f:], -b[f:]  # its gate carries the input; ours passes the transform
        sd[f"token_encoder.highways.{k}.weight"] = w
        sd[f"token_encoder.highways.{k}.bias"] = b
    sd["token_encoder.projection.weight"] = t("projection.weight")
    sd["token_encoder.projection.bias"] = t("projection.bias")
    for theirs, ours in (("forward", "forward_layers"), ("backward", "backward_layers")):
        for layer in range(cfg.n_layers):
            pre = f"{theirs}_layer_{layer}"
            sd[f"{ours}.{layer}.w_ih.weight"] = _gates(e(f"{pre}.input_linearity.weight"))
            sd[f"{ours}.{layer}.w_ih.bias"] = _gates(e(f"{pre}.state_linearity.bias"))
            sd[f"{ours}.{layer}.w_hh.weight"] = _gates(e(f"{pre}.state_linearity.weight"))
            sd[f"{ours}.{layer}.w_proj.weight"] = e(f"{pre}.state_projection.weight")
    return sd


def load_efml(
    model_dir: str | Path, network_config: str | Path | None = None
) -> tuple[BiLM, Lexicon, dict[str, Any]]:
    """An ELMoForManyLangs model folder as our ``BiLM`` (eval mode), its lexicon and facts
    for the provenance. Everything is checked before anything is built
    (``efml_folder.read_folder``); ``network_config``: a network config outside the
    folder, passed explicitly."""
    folder = read_folder(model_dir, network_config)
    cfg = config_from_network(folder.net, folder.shape, folder.char_rows, folder.word_rows)
    te = _load_tensors(folder.paths[TOKEN_EMBEDDER_FILE])
    enc = _load_tensors(folder.paths[ENCODER_FILE])
    model = BiLM(cfg)
    state = state_dict_from_efml(te, enc, cfg)
    own = model.state_dict()
    for k, v in state.items():  # checked from the headers already; a last look
        if tuple(v.shape) != tuple(own[k].shape):
            raise ArtifactError(
                f"{k}: shape {list(v.shape)} does not fit the network config", field=k
            )
    model.load_state_dict(state)
    model.eval()
    lexicon = folder.lexicon
    facts = {
        "source_files": {f: {"sha256": sha256_file(p)} for f, p in sorted(folder.paths.items())},
        "characters": len(lexicon.chars),
        "words": 0 if lexicon.words is None else len(lexicon.words),
    }
    return model, lexicon, facts


def _self_test(directory: Path) -> None:
    """The new artifact's own self-test, before it appears where asked: stored (each
    sentence alone), then the artifact loaded back from disk must give the stored vectors
    again (each alone, within the self-test's bound) and finite ones batched. A model
    that cannot embed (vectors overflow, ids past the tables) is refused here, not at
    first use."""
    from elmo_service.embedder import Embedder  # here: the embedder imports the artifact
    from elmo_service.selftest import compare, load_selftest, write_selftest

    def fail(why: str) -> ArtifactError:
        msg = f"ELMoForManyLangs model: selftest: the converted model fails its self-test: {why}"
        return ArtifactError(msg, field="selftest")

    try:
        write_selftest(directory)
        stored = load_selftest(directory)
        embedder = Embedder.load(directory, device="cpu", token_cache_size=0)
        alone = [embedder.run_batch([t])[0] for t in stored.tokens]  # type: ignore[union-attr]
        batched = embedder.run_batch(stored.tokens)  # type: ignore[union-attr]
    except Exception as e:  # noqa: BLE001 - any failure to embed: one line
        lines = str(e).strip().splitlines()
        raise fail(f"{type(e).__name__}: {lines[0] if lines else ''}") from None
    with np.errstate(invalid="ignore"):  # inf - inf: compare names it non-finite
        verdict = compare(stored.vectors, alone)  # type: ignore[union-attr]
    if not verdict["within_bound"]:
        raise fail(
            verdict.get("error") or f"read back, it differs by {verdict['max_rel_diff']:.2e}"
        )
    for i, v in enumerate(batched):
        if not np.isfinite(v).all():
            raise fail(f"sentence {i} has non-finite vectors")


def convert_efml(
    model_dir: str | Path,
    out_dir: str | Path,
    overwrite: bool = False,
    network_config: str | Path | None = None,
) -> str:
    """Convert an ELMoForManyLangs model folder to an artifact; returns its version.

    The artifact's tokenizer is :class:`LexiconTokenizer` (its ``char.dic``/``word.dic``
    inside), with a self-test it passed before ``out_dir`` appears. Raises
    :class:`ConfigError` for a network config we do not compute and :class:`ArtifactError`
    naming a missing or malformed file or tensor, each in one line.
    """
    model, lexicon, facts = load_efml(model_dir, network_config)
    provenance = {
        "source": f"converted from {SOURCE_FORMAT}",
        "source_format": SOURCE_FORMAT,
        **facts,
    }
    with atomic_dir(out_dir, overwrite) as tmp:  # out_dir appears only after the self-test
        version = save_artifact(
            model, LexiconTokenizer(lexicon), tmp, provenance=provenance, overwrite=True
        )
        _self_test(tmp)
    return version


__all__ = [
    "config_from_network",
    "convert_efml",
    "is_efml_dir",
    "load_efml",
    "state_dict_from_efml",
]
