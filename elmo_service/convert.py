"""Published ELMo weights (bilm-tf / AllenNLP) <-> our artifact.

    options.json + weights.hdf5  --convert_bilm-->  model_dir/ (see artifact.py)
    model_dir/                   --export_bilm--->  options.json + weights.hdf5

The published layout (bilm-tf's ``dump_weights``, read by AllenNLP's
``modules/elmo.py`` and ``elmo_lstm.py``): TensorFlow stores ``x @ W`` matrices, so every matrix is transposed; the
character CNN kernels are conv2d ``[1, width, char_dim, n]``; each highway
layer is ``W_transform``/``W_carry``; each LSTM cell packs ``[x ; h]`` rows
into one ``W_0`` with gate columns in TF's order ``(i, j, f, o)`` and without
the forget bias of +1.0 that TF adds at run time.

What AllenNLP 2.10 (the loader everybody uses) does, and we therefore do too:

* ``char_embed`` gets one zero row prepended whatever its row count, so id
  ``k`` reads file row ``k - 1``. With 261 rows (as trained) that is our
  262-row table exactly; with 262 rows the last file row is never read by any
  id (ids stop at 261) and is dropped. Taking a 262-row file "as is" would
  shift every character by one row.
* the highway's activation is relu whatever ``char_cnn.activation`` says (that
  one applies to the convolutions only).

bilm-tf semantics are kept where AllenNLP refuses: ``use_skip_connections``
false (or absent, as bilm-tf reads it) converts to a model without residual
connections; AllenNLP cannot load such a model at all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from elmo_service.artifact import load_artifact, save_artifact, sha256_file
from elmo_service.atomic import atomic_path, write_json
from elmo_service.bilm.config import BiLMConfig
from elmo_service.bilm.model import N_CHAR_IDS, BiLM
from elmo_service.errors import ArtifactError, ConfigError
from elmo_service.selftest import write_selftest
from elmo_service.tokenizers import WordTokenizer

SOURCE_FORMAT = "bilm-tf"
# rows of the published char_embed: 261 as trained, 262 in some re-exports
CHAR_EMBED_ROWS = (N_CHAR_IDS - 1, N_CHAR_IDS)


# --------------------------------------------------------------------------- options
def _need(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"options.json: {field} {msg}", field=field)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool)


def config_from_options(options: Any) -> BiLMConfig:
    """Validate a bilm-tf ``options.json`` dict and map it to a :class:`BiLMConfig`.

    Raises :class:`ConfigError` naming the offending field. Missing
    ``use_skip_connections`` means False (bilm-tf's ``.get``), missing
    ``n_highway`` means 0, missing clips mean no clipping.
    """
    _need(isinstance(options, dict), "options", "must be a JSON object")
    cnn, lstm = options.get("char_cnn"), options.get("lstm")
    _need(isinstance(cnn, dict), "char_cnn", "is missing or not an object")
    _need(isinstance(lstm, dict), "lstm", "is missing or not an object")
    emb = cnn.get("embedding")
    _need(
        isinstance(emb, dict) and _is_int(emb.get("dim")),
        "char_cnn.embedding.dim",
        "must be an integer",
    )
    filters = cnn.get("filters")
    _need(
        isinstance(filters, list)
        and len(filters) > 0
        and all(
            isinstance(f, list | tuple) and len(f) == 2 and all(_is_int(v) for v in f)
            for f in filters
        ),
        "char_cnn.filters",
        "must be a non-empty list of [width, count] integer pairs",
    )
    for key in ("n_highway", "max_characters_per_token", "n_characters"):
        if cnn.get(key) is not None:
            _need(_is_int(cnn[key]), f"char_cnn.{key}", "must be an integer")
    if cnn.get("n_characters") is not None:
        _need(cnn["n_characters"] in CHAR_EMBED_ROWS, "char_cnn.n_characters", "must be 261 or 262")
    _need(
        cnn.get("activation", "relu") in ("relu", "tanh"),
        "char_cnn.activation",
        f"must be 'relu' or 'tanh', got {cnn.get('activation')!r}",
    )
    for key in ("dim", "projection_dim", "n_layers"):
        _need(_is_int(lstm.get(key)), f"lstm.{key}", "must be an integer")
    for key in ("cell_clip", "proj_clip"):
        v = lstm.get(key)
        _need(
            v is None or (_is_number(v) and v > 0),
            f"lstm.{key}",
            "must be a positive number or null",
        )
    skip = lstm.get("use_skip_connections")
    _need(
        skip is None or isinstance(skip, bool), "lstm.use_skip_connections", "must be true or false"
    )
    _need(
        options.get("bidirectional", True) is not False,
        "bidirectional",
        "must be true: the converter reads both directions",
    )
    dropout = options.get("dropout")
    _need(
        dropout is None or (_is_number(dropout) and 0 <= dropout < 1),
        "dropout",
        "must be in [0, 1)",
    )
    # the mapping itself is BiLMConfig's; it validates ranges and names the field
    mapped = {
        "char_cnn": {k: v for k, v in cnn.items() if v is not None},
        "lstm": lstm,
        "dropout": 0.1 if dropout is None else dropout,
    }
    return BiLMConfig.from_bilm_options(mapped)


def options_from_config(cfg: BiLMConfig) -> dict[str, Any]:
    """The prediction-time ``options.json`` for ``cfg`` (AllenNLP/bilm-tf keys)."""
    return {
        "bidirectional": True,
        "dropout": cfg.dropout,
        "char_cnn": {
            "activation": cfg.activation,
            "embedding": {"dim": cfg.char_dim},
            "filters": [list(f) for f in cfg.filters],
            "n_highway": cfg.n_highway,
            "max_characters_per_token": cfg.max_chars_per_token,
            "n_characters": N_CHAR_IDS,
        },
        "lstm": {
            "dim": cfg.lstm_dim,
            "projection_dim": cfg.projection_dim,
            "n_layers": cfg.n_layers,
            "cell_clip": cfg.cell_clip,
            "proj_clip": cfg.proj_clip,
            "use_skip_connections": cfg.residual,
        },
    }


# --------------------------------------------------------------------------- layout
def lstm_prefix(direction: int, layer: int) -> str:
    return f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"


def expected_datasets(cfg: BiLMConfig) -> dict[str, tuple[int, ...]]:
    """Every dataset a bilm-tf ``weights.hdf5`` for ``cfg`` holds, with its shape.

    ``char_embed`` is listed with 261 rows; 262 is accepted too.
    """
    d, f_total, p, c = cfg.char_dim, cfg.n_filters, cfg.projection_dim, cfg.lstm_dim
    shapes: dict[str, tuple[int, ...]] = {"char_embed": (N_CHAR_IDS - 1, d)}
    for i, (w, n) in enumerate(cfg.filters):
        shapes[f"CNN/W_cnn_{i}"] = (1, w, d, n)
        shapes[f"CNN/b_cnn_{i}"] = (n,)
    for k in range(cfg.n_highway):
        for part in ("carry", "transform"):
            shapes[f"CNN_high_{k}/W_{part}"] = (f_total, f_total)
            shapes[f"CNN_high_{k}/b_{part}"] = (f_total,)
    shapes["CNN_proj/W_proj"] = (f_total, p)
    shapes["CNN_proj/b_proj"] = (p,)
    for direction in (0, 1):
        for layer in range(cfg.n_layers):
            pre = lstm_prefix(direction, layer)
            shapes[f"{pre}/W_0"] = (p + p, 4 * c)  # every layer's input is P wide
            shapes[f"{pre}/B"] = (4 * c,)
            shapes[f"{pre}/W_P_0"] = (c, p)
    return shapes


# TF packs gate columns (i, j, f, o), j being the candidate; ours are (i, f, o, g)
_TF_TO_OURS = (0, 2, 3, 1)
_OURS_TO_TF = tuple(_TF_TO_OURS.index(k) for k in range(4))  # (0, 3, 1, 2)
_TF_FORGET = 2


def _gates(x: np.ndarray, order: tuple[int, ...]) -> np.ndarray:
    """Reorder the four gate blocks along axis 0."""
    blocks = np.split(x, 4, axis=0)
    return np.concatenate([blocks[k] for k in order], axis=0)


def _t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))


def state_dict_from_bilm(arrays: dict[str, np.ndarray], cfg: BiLMConfig) -> dict[str, torch.Tensor]:
    """bilm-tf arrays (name -> array, shapes already checked) -> our ``BiLM`` state dict."""
    p = cfg.projection_dim
    sd: dict[str, torch.Tensor] = {}
    char_embed = np.zeros((N_CHAR_IDS, cfg.char_dim), dtype=np.float32)
    char_embed[1:] = arrays["char_embed"][: N_CHAR_IDS - 1]  # AllenNLP: prepend a zero row
    sd["token_encoder.char_embed.weight"] = _t(char_embed)
    for i in range(len(cfg.filters)):
        # [1, w, d, n] -> [n, d, w]
        sd[f"token_encoder.convs.{i}.weight"] = _t(arrays[f"CNN/W_cnn_{i}"][0].transpose(2, 1, 0))
        sd[f"token_encoder.convs.{i}.bias"] = _t(arrays[f"CNN/b_cnn_{i}"])
    for k in range(cfg.n_highway):
        hw = f"CNN_high_{k}"
        # one Linear with rows [transform ; carry]; gate = sigmoid(carry) multiplies the transform
        w = np.concatenate([arrays[f"{hw}/W_transform"].T, arrays[f"{hw}/W_carry"].T], axis=0)
        b = np.concatenate([arrays[f"{hw}/b_transform"], arrays[f"{hw}/b_carry"]])
        sd[f"token_encoder.highways.{k}.weight"] = _t(w)
        sd[f"token_encoder.highways.{k}.bias"] = _t(b)
    sd["token_encoder.projection.weight"] = _t(arrays["CNN_proj/W_proj"].T)
    sd["token_encoder.projection.bias"] = _t(arrays["CNN_proj/b_proj"])
    for direction, name in ((0, "forward_layers"), (1, "backward_layers")):
        for layer in range(cfg.n_layers):
            pre = lstm_prefix(direction, layer)
            w = _gates(arrays[f"{pre}/W_0"].T.astype(np.float32), _TF_TO_OURS)  # [4C, P + P]
            bias = arrays[f"{pre}/B"].astype(np.float32).copy()
            c = bias.shape[0] // 4
            bias[_TF_FORGET * c : (_TF_FORGET + 1) * c] += 1.0  # TF adds it at run time
            sd[f"{name}.{layer}.w_ih.weight"] = _t(w[:, :p])
            sd[f"{name}.{layer}.w_ih.bias"] = _t(_gates(bias, _TF_TO_OURS))
            sd[f"{name}.{layer}.w_hh.weight"] = _t(w[:, p:])
            sd[f"{name}.{layer}.w_proj.weight"] = _t(arrays[f"{pre}/W_P_0"].T)
    return sd


def bilm_arrays_from_model(model: BiLM) -> dict[str, np.ndarray]:
    """The inverse of :func:`state_dict_from_bilm` (``char_embed`` with 261 rows)."""
    cfg = model.cfg
    sd = {k: v.detach().to("cpu", torch.float32).numpy() for k, v in model.state_dict().items()}
    out: dict[str, np.ndarray] = {"char_embed": sd["token_encoder.char_embed.weight"][1:]}
    for i in range(len(cfg.filters)):
        out[f"CNN/W_cnn_{i}"] = sd[f"token_encoder.convs.{i}.weight"].transpose(2, 1, 0)[None]
        out[f"CNN/b_cnn_{i}"] = sd[f"token_encoder.convs.{i}.bias"]
    f_total = cfg.n_filters
    for k in range(cfg.n_highway):
        w, b = sd[f"token_encoder.highways.{k}.weight"], sd[f"token_encoder.highways.{k}.bias"]
        out[f"CNN_high_{k}/W_transform"] = w[:f_total].T
        out[f"CNN_high_{k}/W_carry"] = w[f_total:].T
        out[f"CNN_high_{k}/b_transform"] = b[:f_total]
        out[f"CNN_high_{k}/b_carry"] = b[f_total:]
    out["CNN_proj/W_proj"] = sd["token_encoder.projection.weight"].T
    out["CNN_proj/b_proj"] = sd["token_encoder.projection.bias"]
    for direction, name in ((0, "forward_layers"), (1, "backward_layers")):
        for layer in range(cfg.n_layers):
            pre = lstm_prefix(direction, layer)
            w = np.concatenate(
                [sd[f"{name}.{layer}.w_ih.weight"], sd[f"{name}.{layer}.w_hh.weight"]], axis=1
            )
            out[f"{pre}/W_0"] = _gates(w, _OURS_TO_TF).T
            bias = _gates(sd[f"{name}.{layer}.w_ih.bias"], _OURS_TO_TF).copy()
            c = bias.shape[0] // 4
            bias[_TF_FORGET * c : (_TF_FORGET + 1) * c] -= 1.0
            out[f"{pre}/B"] = bias
            out[f"{pre}/W_P_0"] = sd[f"{name}.{layer}.w_proj.weight"].T
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


# --------------------------------------------------------------------------- reading
def _fmt(shape: tuple[int, ...]) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def read_bilm_weights(weights_path: str | Path, cfg: BiLMConfig) -> dict[str, np.ndarray]:
    """Read and check every dataset ``cfg`` needs; raise :class:`ArtifactError` naming it."""
    from elmo_service.embed_file import h5py_module

    h5py = h5py_module()

    weights_path = Path(weights_path)
    name = weights_path.name
    if not weights_path.is_file():
        raise ArtifactError(f"weights file {weights_path} does not exist", field="weights")
    try:
        fin = h5py.File(weights_path, "r")
    except OSError as e:
        raise ArtifactError(f"{name} is not a readable HDF5 file: {e}", field="weights") from e
    arrays: dict[str, np.ndarray] = {}
    with fin:
        for ds, shape in expected_datasets(cfg).items():
            obj = fin.get(ds)
            if not isinstance(obj, h5py.Dataset):
                raise ArtifactError(
                    f"{name} lacks dataset {ds!r} (expected shape {_fmt(shape)})", field=ds
                )
            got = tuple(obj.shape)
            ok = got == shape or (
                ds == "char_embed" and got in [(r, cfg.char_dim) for r in CHAR_EMBED_ROWS]
            )
            if not ok:
                want = f"[261 or 262, {cfg.char_dim}]" if ds == "char_embed" else _fmt(shape)
                raise ArtifactError(
                    f"{name}: dataset {ds!r} has shape {_fmt(got)}, expected {want}", field=ds
                )
            if obj.dtype.kind != "f":
                raise ArtifactError(
                    f"{name}: dataset {ds!r} has dtype {obj.dtype}, expected float32", field=ds
                )
            arr = obj[...]
            if not np.isfinite(arr).all():
                raise ArtifactError(
                    f"{name}: dataset {ds!r} holds NaN or infinite values", field=ds
                )
            arrays[ds] = arr
    return arrays


def read_bilm_options(options_path: str | Path) -> dict[str, Any]:
    options_path = Path(options_path)
    if not options_path.is_file():
        raise ConfigError(f"options file {options_path} does not exist", field="options")
    try:
        return json.loads(options_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{options_path.name} is not valid JSON: {e}", field="options") from e


def load_bilm(options_path: str | Path, weights_path: str | Path) -> tuple[BiLM, dict[str, Any]]:
    """A bilm-tf model as our ``BiLM`` (eval mode) plus facts for the provenance."""
    cfg = config_from_options(read_bilm_options(options_path))
    arrays = read_bilm_weights(weights_path, cfg)
    model = BiLM(cfg)
    model.load_state_dict(state_dict_from_bilm(arrays, cfg))
    model.eval()
    facts = {"char_embed_rows": int(arrays["char_embed"].shape[0])}
    return model, facts


# --------------------------------------------------------------------------- public API
def convert_bilm(
    options_path: str | Path,
    weights_path: str | Path,
    out_dir: str | Path,
    lowercase: bool = False,
    overwrite: bool = False,
) -> str:
    """Convert bilm-tf ``options.json`` + ``weights.hdf5`` to an artifact; returns its version.

    The artifact uses :class:`WordTokenizer` (``lowercase`` for models trained
    on lowercased text). Its provenance names both source files with their
    sha256. Raises :class:`ConfigError` for bad options and
    :class:`ArtifactError` naming any missing or malformed dataset.
    """
    options_path, weights_path = Path(options_path), Path(weights_path)
    model, facts = load_bilm(options_path, weights_path)
    provenance = {
        "source": f"converted from {SOURCE_FORMAT}",
        "source_format": SOURCE_FORMAT,
        "source_files": {
            "options": {"name": options_path.name, "sha256": sha256_file(options_path)},
            "weights": {"name": weights_path.name, "sha256": sha256_file(weights_path)},
        },
        "char_embed_rows": facts["char_embed_rows"],
    }
    version = save_artifact(
        model,
        WordTokenizer(lowercase=lowercase),
        out_dir,
        provenance=provenance,
        overwrite=overwrite,
    )
    write_selftest(out_dir)  # fixed sentences and their vectors: GET /v1/selftest checks a server
    return version


def export_bilm(
    artifact_dir: str | Path,
    options_out: str | Path,
    weights_out: str | Path,
    *,
    allow_subword: bool = False,
) -> None:
    """Write an artifact as bilm-tf ``options.json`` + ``weights.hdf5`` (AllenNLP loads them).

    ``char_embed`` is written with 261 rows, the LSTM gates in TF order with
    the forget bias of +1.0 taken back out. AllenNLP and bilm-tf feed whole
    words to the character CNN; a model trained on sentencepiece pieces is
    refused unless ``allow_subword`` (its users must then feed pieces).
    AllenNLP only loads models with ``use_skip_connections`` true.
    """
    from elmo_service.embed_file import h5py_module

    h5py = h5py_module()

    art = load_artifact(artifact_dir)
    if art.config.char_vocab_size is not None:
        raise ConfigError(
            f"{art.name} reads characters from an ELMoForManyLangs lexicon, not bytes: "
            "bilm-tf/AllenNLP cannot read it",
            field="tokenizer",
        )
    if art.tokenizer.kind != "word" and not allow_subword:
        raise ConfigError(
            f"{art.name} reads {art.tokenizer.kind} pieces, but bilm-tf/AllenNLP feed whole words;"
            " pass allow_subword=True to export it anyway",
            field="tokenizer",
        )
    options = options_from_config(art.config)
    options["elmo_service"] = {  # ignored by AllenNLP and bilm-tf, kept for people
        "version": art.version,
        "tokenizer": {
            "type": art.tokenizer.kind,
            "lowercase": getattr(art.tokenizer, "lowercase", False),
        },
    }
    arrays = bilm_arrays_from_model(art.model)
    options_out, weights_out = Path(options_out), Path(weights_out)
    for path in (options_out, weights_out):
        path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(weights_out) as tmp, h5py.File(tmp, "w") as fout:
        for ds, arr in arrays.items():
            fout.create_dataset(ds, data=arr, dtype="float32")
    write_json(options_out, options)


__all__ = [
    "config_from_options",
    "convert_bilm",
    "expected_datasets",
    "export_bilm",
    "load_bilm",
    "options_from_config",
]
