"""An ELMoForManyLangs model folder, read and checked before anything is built from it.

``convert_efml`` builds a model only from what :func:`read_folder` hands it, and that holds
together first (#56: a folder must never crash, hang or exhaust the converter, nor be
accepted broken):

* every file is read from inside the folder (a symlink or a ``config_path`` pointing out
  of it is refused; a network config elsewhere is read only when the user passes it);
* JSON files are bounded in size (:data:`MAX_JSON_BYTES`) and nesting
  (:data:`MAX_JSON_DEPTH`) before they are parsed; the ``.dic`` files in size;
* every size and count of the network config is an integer within a sane maximum
  (:data:`MAXIMA`), then the whole set of tensors it implies (names, shapes) must be
  exactly what the two pickles declare (``tensor_header.read_header``: no tensor is
  built, no code runs), every one a floating-point tensor on a real device;
* the dictionaries' ids are unique and index rows the embeddings hold.

Every refusal is one line naming the file and the field (``ConfigError`` for the config,
``ArtifactError`` for files and tensors).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elmo_service.bilm.lexicon import CHAR_FILE, WORD_FILE, Lexicon
from elmo_service.errors import ArtifactError, ConfigError
from elmo_service.tensor_header import TensorInfo, read_header

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


def network_config(model_dir: Path, explicit: str | Path | None = None) -> tuple[Any, Path]:
    """The network config: ``explicit`` when the user passes one (read wherever it is),
    else what ``config.json``'s ``config_path`` names inside the folder (published models
    name a path on their authors' machine: then the file of that name in the folder)."""
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
    raise ConfigError(
        f"ELMoForManyLangs model: config.json: config_path {name!r} is not a file in "
        f"{model_dir} (a network config elsewhere is read only when passed explicitly: "
        "--network-config; the elmoformanylangs package's configs/ folder has them)",
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
    net, net_path = network_config(model_dir, network)
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


__all__ = ["MAXIMA", "Folder", "read_folder"]
