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

import json
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elmo_service.artifact import atomic_dir, save_artifact, sha256_file
from elmo_service.bilm.config import BiLMConfig
from elmo_service.bilm.lexicon import CHAR_FILE, WORD_FILE, Lexicon
from elmo_service.bilm.model import BiLM
from elmo_service.bilm.tensor_header import TensorInfo, read_header
from elmo_service.errors import ArtifactError, ConfigError
from elmo_service.tokenizers import LexiconTokenizer

SOURCE_FORMAT = "elmoformanylangs"

# ------------------------------------------------------------------ the folder, checked
# A model is built only from what read_folder hands over, and that holds together first
# (#56: a folder must never crash, hang or exhaust the converter, nor be accepted broken):
# * every file is read from inside the folder (a symlink or a ``config_path`` pointing out
#   of it is refused; a network config elsewhere is read only when the user passes it);
# * JSON files are bounded in size (:data:`MAX_JSON_BYTES`) and nesting
#   (:data:`MAX_JSON_DEPTH`) before they are parsed; the ``.dic`` files in size;
# * every size and count of the network config is an integer within a sane maximum
#   (:data:`MAXIMA`), then the whole set of tensors it implies (names, shapes) must be
#   exactly what the two pickles declare (``tensor_header.read_header``: no tensor is
#   built, no code runs), every one a floating-point tensor on a real device;
# * the dictionaries' ids are unique and index rows the embeddings hold.
#
# Every refusal is one line naming the file and the field (``ConfigError`` for the config,
# ``ArtifactError`` for files and tensors).

TOKEN_EMBEDDER_FILE, ENCODER_FILE = "token_embedder.pkl", "encoder.pkl"
MAX_JSON_BYTES = 1 << 20
MAX_JSON_DEPTH = 32
MAX_DIC_BYTES = {CHAR_FILE: 16 << 20, WORD_FILE: 256 << 20}
# sane maxima: published models use 2 layers, 1-2 highway layers, 7 widths up to 7 wide,
# 50 characters per token, widths of 4096 at most; these leave room and refuse nonsense
MAXIMA = {
    "encoder.n_layers": 16,
    "token_embedder.n_highway": 16,
    "token_embedder.filters": 64,
    "token_embedder.max_characters_per_token": 1000,
    "dim": 1 << 16,
}
FLOAT_DTYPES = ("float32", "float64", "float16", "bfloat16")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"', re.DOTALL)
_BRACKET = re.compile(r"[\[\]{}]")


def _need(cond: bool, file: str, field: str, msg: str, kind: type = ConfigError) -> None:
    if not cond:
        raise kind(f"ELMoForManyLangs model: {file}: {field} {msg}", field=field)


def inside(model_dir: Path, name: str | Path, field: str) -> Path:
    """``model_dir / name``, refused when it (or a symlink on the way) leads out of it."""
    path = model_dir / name
    if not path.resolve().is_relative_to(model_dir.resolve()):
        raise ArtifactError(
            f"ELMoForManyLangs model: {field} {str(name)!r} leads outside {model_dir}",
            field=field,
        )
    return path


def read_bytes(path: Path, limit: int, field: str) -> bytes:
    """A file's bytes, refused unread past ``limit``."""
    if not path.is_file():
        raise ArtifactError(
            f"ELMoForManyLangs model: missing {path.name} in {path.parent}", field=field
        )
    size = path.stat().st_size
    if size > limit:
        raise ArtifactError(
            f"ELMoForManyLangs model: {path.name} holds {size:,} bytes; the limit is {limit:,}",
            field=field,
        )
    return path.read_bytes()


def read_json(path: Path, field: str) -> Any:
    """A JSON file, bounded in size and nesting before it is parsed."""
    raw = read_bytes(path, MAX_JSON_BYTES, field)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(
            f"ELMoForManyLangs model: {path.name} is not UTF-8: {e}", field=field
        ) from None
    depth = deepest = 0
    for m in _BRACKET.finditer(_STRING.sub("", text)):
        depth += 1 if m.group() in "[{" else -1
        deepest = max(deepest, depth)
        if deepest > MAX_JSON_DEPTH:
            raise ConfigError(
                f"ELMoForManyLangs model: {path.name} nests deeper than {MAX_JSON_DEPTH} levels",
                field=field,
            )
    try:
        return json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(
            f"ELMoForManyLangs model: {path.name} is not valid JSON: {e}", field=field
        ) from None


def _package_config(name: str) -> Path | None:
    """The sample network config of that name in an installed ``elmoformanylangs`` (its
    ``configs/``: published folders name those files by their authors' absolute paths and do
    not ship them). Found, never imported."""
    import importlib.util

    spec = importlib.util.find_spec("elmoformanylangs")
    for root in (spec.submodule_search_locations or []) if spec is not None else []:
        if (p := Path(root) / "configs" / name).is_file():
            return p
    return None


def read_network_config(model_dir: Path, explicit: str | Path | None = None) -> tuple[Any, Path]:
    """The network config: ``explicit`` when the user passes one (read wherever it is),
    else what ``config.json``'s ``config_path`` names inside the folder (published models
    name a path on their authors' machine: then the file of that name in the folder, else
    in an installed ``elmoformanylangs``' sample configs)."""
    if explicit is not None:
        path = Path(explicit)
        return read_json(path, "network_config"), path
    outer = read_json(inside(model_dir, "config.json", "config.json"), "config.json")
    name = outer.get("config_path") if isinstance(outer, dict) else None
    _need(
        isinstance(name, str) and bool(name),
        "config.json",
        "config_path",
        "must name the network config",
    )
    for candidate in (name, Path(name).name):
        path = model_dir / candidate
        if path.resolve().is_relative_to(model_dir.resolve()) and path.is_file():
            return read_json(path, "config_path"), path
    if (path := _package_config(Path(name).name)) is not None:
        return read_json(path, "config_path"), path
    raise ConfigError(
        f"ELMoForManyLangs model: config.json: config_path {name!r} is not a file in "
        f"{model_dir} nor in an installed elmoformanylangs' configs/ (a network config "
        "elsewhere is read only when passed explicitly: --network-config)",
        field="config_path",
    )


def _int(
    section: dict, part: str, key: str, file: str, lo: int, hi: int, default: Any = None
) -> int:
    v = section.get(key, default)
    field = f"{part}.{key}"
    _need(
        isinstance(v, int) and not isinstance(v, bool),
        file,
        field,
        f"must be an integer, not {v!r}",
    )
    _need(lo <= v <= hi, file, field, f"is {v:,}; it must be in [{lo}, {hi:,}]")
    return v


@dataclass(frozen=True)
class Shape:
    """The network config's sizes, each checked against its maximum."""

    char_dim: int
    word_dim: int
    filters: tuple[tuple[int, int], ...]
    n_highway: int
    max_chars: int
    projection_dim: int
    dim: int
    n_layers: int

    @property
    def n_filters(self) -> int:
        return sum(n for _, n in self.filters)


def shape_of(net: Any, file: str) -> Shape:
    """The sizes and counts of a network config, after the kinds of layer we compute."""
    _need(isinstance(net, dict), file, "network config", "must be a JSON object")
    te, enc = net.get("token_embedder"), net.get("encoder")
    _need(isinstance(te, dict), file, "token_embedder", "is missing or not an object")
    _need(isinstance(enc, dict), file, "encoder", "is missing or not an object")
    te_name, enc_name = str(te.get("name", "")).lower(), str(enc.get("name", "")).lower()
    _need(
        te_name == "cnn", file, "token_embedder.name", f"{te_name!r} is not supported (only 'cnn')"
    )
    _need(enc_name == "elmo", file, "encoder.name", f"{enc_name!r} is not supported (only 'elmo')")
    _need(
        isinstance(te.get("char_dim"), int) and te["char_dim"] > 0,
        file,
        "token_embedder.char_dim",
        "must be > 0 (a model without characters is not supported)",
    )
    _need(
        te.get("activation") in ("relu", "tanh"),
        file,
        "token_embedder.activation",
        f"{te.get('activation')!r} is not supported (relu or tanh)",
    )
    big = MAXIMA["dim"]
    max_chars = _int(
        te,
        "token_embedder",
        "max_characters_per_token",
        file,
        3,
        MAXIMA["token_embedder.max_characters_per_token"],
    )
    filters = te.get("filters")
    _need(
        isinstance(filters, list) and 0 < len(filters) <= MAXIMA["token_embedder.filters"],
        file,
        "token_embedder.filters",
        f"must be a list of 1 to {MAXIMA['token_embedder.filters']} [width, count] pairs",
    )
    pairs = []
    for i, f in enumerate(filters):
        ok = (
            isinstance(f, list)
            and len(f) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in f)
        )
        _need(
            ok and 0 < f[0] <= max_chars and 0 < f[1] <= big,
            file,
            f"token_embedder.filters[{i}]",
            f"{f!r} must be [width, count], 0 < width <= max_characters_per_token ({max_chars}), "
            f"0 < count <= {big:,}",
        )
        pairs.append((f[0], f[1]))
    return Shape(
        char_dim=_int(te, "token_embedder", "char_dim", file, 1, big),
        word_dim=_int(te, "token_embedder", "word_dim", file, 0, big, default=0)
        if te.get("word_dim")
        else 0,
        filters=tuple(pairs),
        n_highway=_int(
            te,
            "token_embedder",
            "n_highway",
            file,
            0,
            MAXIMA["token_embedder.n_highway"],
            default=0,
        ),
        max_chars=max_chars,
        projection_dim=_int(enc, "encoder", "projection_dim", file, 1, big),
        dim=_int(enc, "encoder", "dim", file, 1, big),
        n_layers=_int(enc, "encoder", "n_layers", file, 1, MAXIMA["encoder.n_layers"]),
    )


def expected_tensors(s: Shape, char_rows: int, word_rows: int) -> dict[str, dict[str, tuple]]:
    """Every tensor the config implies, in its own names and layout, per file."""
    te: dict[str, tuple] = {"char_emb_layer.embedding.weight": (char_rows, s.char_dim)}
    if s.word_dim:
        te["word_emb_layer.embedding.weight"] = (word_rows, s.word_dim)
    for i, (w, n) in enumerate(s.filters):
        te[f"convolutions.{i}.weight"], te[f"convolutions.{i}.bias"] = (n, s.char_dim, w), (n,)
    f = s.n_filters
    for k in range(s.n_highway):
        te[f"highways._layers.{k}.weight"], te[f"highways._layers.{k}.bias"] = (2 * f, f), (2 * f,)
    te["projection.weight"], te["projection.bias"] = (
        (s.projection_dim, f + s.word_dim),
        (s.projection_dim,),
    )
    enc: dict[str, tuple] = {}
    p, d = s.projection_dim, s.dim
    for side in ("forward", "backward"):
        for layer in range(s.n_layers):
            pre = f"{side}_layer_{layer}"
            enc[f"{pre}.input_linearity.weight"] = (4 * d, p)
            enc[f"{pre}.state_linearity.weight"] = (4 * d, p)
            enc[f"{pre}.state_linearity.bias"] = (4 * d,)
            enc[f"{pre}.state_projection.weight"] = (p, d)
    return {TOKEN_EMBEDDER_FILE: te, ENCODER_FILE: enc}


def _rows(header: dict[str, TensorInfo], key: str) -> int:
    t = header.get(key)
    return t.shape[0] if t is not None and len(t.shape) == 2 else 0


def check_tensors(
    headers: dict[str, dict[str, TensorInfo]], want: dict[str, dict[str, tuple]], net_file: str
) -> None:
    """The declared tensors are exactly the implied ones: names, shapes, floating dtypes."""
    for file, expected in want.items():
        got = headers[file]
        missing = [k for k in expected if k not in got]
        extra = [k for k in got if k not in expected]
        if missing or extra:
            k = (missing or extra)[0]
            why = (
                f"lacks {k!r} (the network config {net_file} implies {len(expected)} "
                f"tensors; {len(missing)} missing)"
                if missing
                else f"holds {k!r}, which the network config {net_file} does not describe "
                f"({len(extra)} such tensors)"
            )
            raise ArtifactError(f"ELMoForManyLangs model: {file} {why}", field=k)
        for k, shape in expected.items():
            t = got[k]
            if t.shape != shape:
                raise ArtifactError(
                    f"ELMoForManyLangs model: {file}: {k} has shape {list(t.shape)}; the "
                    f"network config {net_file} needs {list(shape)}",
                    field=k,
                )
            if t.dtype not in FLOAT_DTYPES:
                raise ArtifactError(
                    f"ELMoForManyLangs model: {file}: {k} is {t.dtype}, not floating point", field=k
                )


def check_ids(ids: dict[str, int], file: str, rows: int) -> None:
    """A dictionary's ids: unique, and each a row of its embedding."""
    seen: dict[int, str] = {}
    for key, i in ids.items():
        if not 0 <= i < rows:
            raise ArtifactError(
                f"ELMoForManyLangs model: {file}: {key!r} has id {i}; the embedding has "
                f"{rows} rows (ids 0 to {rows - 1})",
                field=file,
            )
        if i in seen:
            raise ArtifactError(
                f"ELMoForManyLangs model: {file}: id {i} is given to both {seen[i]!r} and {key!r}",
                field=file,
            )
        seen[i] = key


@dataclass
class Folder:
    """What :func:`read_folder` checked: the network config, its file, the tensors'
    headers, the rows of the embeddings, the lexicon and the files read."""

    net: dict[str, Any]
    net_path: Path
    shape: Shape
    headers: dict[str, dict[str, TensorInfo]]
    char_rows: int
    word_rows: int
    lexicon: Lexicon
    paths: dict[str, Path]


def read_folder(model_dir: str | Path, network: str | Path | None = None) -> Folder:
    """Everything of the folder but the tensors' values, checked (see the module)."""
    model_dir = Path(model_dir)
    net, net_path = read_network_config(model_dir, network)
    shape = shape_of(net, net_path.name)
    paths = {f: inside(model_dir, f, f) for f in (TOKEN_EMBEDDER_FILE, ENCODER_FILE)}
    for f, p in paths.items():
        if not p.is_file():
            raise ArtifactError(f"ELMoForManyLangs model: missing {f} in {model_dir}", field=f)
    headers = {f: read_header(p) for f, p in paths.items()}
    te = headers[TOKEN_EMBEDDER_FILE]
    char_rows = _rows(te, "char_emb_layer.embedding.weight")
    word_rows = _rows(te, "word_emb_layer.embedding.weight") if shape.word_dim else 0
    check_tensors(headers, expected_tensors(shape, char_rows, word_rows), net_path.name)
    dics = {CHAR_FILE: inside(model_dir, CHAR_FILE, CHAR_FILE)}
    if shape.word_dim:
        dics[WORD_FILE] = inside(model_dir, WORD_FILE, WORD_FILE)
    raw = {f: read_bytes(p, MAX_DIC_BYTES[f], f) for f, p in dics.items()}
    for f, data in raw.items():
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ArtifactError(f"ELMoForManyLangs model: {f} is not UTF-8: {e}", field=f) from None
    lexicon = Lexicon(raw[CHAR_FILE], raw.get(WORD_FILE))
    check_ids(lexicon.chars, CHAR_FILE, char_rows)
    if lexicon.words is not None:
        check_ids(lexicon.words, WORD_FILE, word_rows)
    paths |= dics
    paths[net_path.name] = net_path
    if (model_dir / "config.json").is_file():
        paths["config.json"] = inside(model_dir, "config.json", "config.json")
    return Folder(net, net_path, shape, headers, char_rows, word_rows, lexicon, paths)


# ------------------------------------------------------------------ the conversion
# its gates (i, f, g, o) -> ours (i, f, o, g)
_EFML_TO_OURS = (0, 1, 3, 2)


def is_efml_dir(path: str | Path) -> bool:
    """A folder holding an ELMoForManyLangs model (its two pickles and config.json)."""
    p = Path(path)
    return p.is_dir() and all((p / f).is_file() for f in ("config.json", ENCODER_FILE))


def config_from_network(
    net: dict[str, Any], shape: Shape, char_rows: int, word_rows: int
) -> BiLMConfig:
    """Its network config (kinds and sizes checked by ``shape_of``) ->
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
    """The tensors, once :func:`read_folder` has checked every declared size against the
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
    (:func:`read_folder`); ``network_config``: a network config outside the
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
