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
from pathlib import Path
from typing import Any

import torch

from elmo_service.artifact import save_artifact, sha256_file
from elmo_service.bilm.config import BiLMConfig
from elmo_service.bilm.lexicon import Lexicon
from elmo_service.bilm.model import BiLM
from elmo_service.errors import ArtifactError, ConfigError
from elmo_service.tokenizers import LexiconTokenizer

SOURCE_FORMAT = "elmoformanylangs"
TOKEN_EMBEDDER_FILE, ENCODER_FILE = "token_embedder.pkl", "encoder.pkl"
# its gates (i, f, g, o) -> ours (i, f, o, g)
_EFML_TO_OURS = (0, 1, 3, 2)


def is_efml_dir(path: str | Path) -> bool:
    """A folder holding an ELMoForManyLangs model (its two pickles and config.json)."""
    p = Path(path)
    return p.is_dir() and all((p / f).is_file() for f in ("config.json", ENCODER_FILE))


def _need(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"ELMoForManyLangs model: {field} {msg}", field=field)


# what a converted folder may hold: far above any published model, far below what would
# hang the converter or exhaust memory (#56)
MAX_JSON_BYTES = 1 << 20
MAX_JSON_DEPTH = 32
LIMITS = {
    "token_embedder.char_dim": 4096,
    "token_embedder.word_dim": 4096,
    "token_embedder.n_highway": 16,
    "token_embedder.max_characters_per_token": 1000,
    "encoder.projection_dim": 16384,
    "encoder.dim": 65536,
    "encoder.n_layers": 16,
}
MAX_FILTERS, MAX_FILTER_WIDTH, MAX_FILTER_COUNT = 64, 64, 65536


def _depth(x: Any, limit: int, at: int = 0) -> int:
    if at > limit:
        return at
    if isinstance(x, dict):
        return max((_depth(v, limit, at + 1) for v in x.values()), default=at)
    if isinstance(x, list):
        return max((_depth(v, limit, at + 1) for v in x), default=at)
    return at


def _read_json(path: Path, field: str) -> Any:
    """A small JSON file, or one line naming it: no file of gigabytes read, no nesting that
    would take the parser's recursion."""
    size = path.stat().st_size
    if size > MAX_JSON_BYTES:
        raise ConfigError(
            f"{path.name} is {size:,} bytes; a network config is a few hundred "
            f"(limit {MAX_JSON_BYTES:,})",
            field=field,
        )
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path.name} is not valid JSON: {e}", field=field) from e
    except RecursionError:
        raise ConfigError(f"{path.name} is nested too deeply", field=field) from None
    if _depth(value, MAX_JSON_DEPTH) > MAX_JSON_DEPTH:
        raise ConfigError(f"{path.name} is nested over {MAX_JSON_DEPTH} levels deep", field=field)
    return value


def _package_config(name: str) -> Path | None:
    """The sample network config of that name shipped in an installed ``elmoformanylangs``
    (its ``configs/`` folder: the published models' config.json names those files)."""
    import importlib.util

    spec = importlib.util.find_spec("elmoformanylangs")
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        p = Path(root) / "configs" / name
        if p.is_file():
            return p
    return None


def read_network_config(
    model_dir: str | Path, network_config: str | Path | None = None
) -> tuple[dict[str, Any], str]:
    """Its ``config.json`` -> the network config it names and that file's name. The named
    path is read only inside the folder (a config.json cannot point the converter at any
    other file); published folders name their authors' absolute paths, so the file's name is
    looked up in the folder, then in an installed ``elmoformanylangs``' sample configs.
    ``network_config``: a path the user gives explicitly, read wherever it is."""
    model_dir = Path(model_dir)
    top = model_dir / "config.json"
    if not top.is_file():
        raise ConfigError(f"{model_dir} has no config.json", field="config.json")
    outer = _read_json(top, "config.json")
    if network_config is not None:
        path = Path(network_config)
        if not path.is_file():
            raise ConfigError(f"network config {path} does not exist", field="network_config")
        return _read_json(path, "network_config"), path.name
    name = outer.get("config_path") if isinstance(outer, dict) else None
    _need(isinstance(name, str) and name, "config_path", "must name the network config")
    root = model_dir.resolve()
    candidates = [model_dir / name, model_dir / Path(name).name]
    path = next(
        (p for p in candidates if p.is_file() and p.resolve().is_relative_to(root)), None
    ) or _package_config(Path(name).name)
    if path is None:
        raise ConfigError(
            f"network config {Path(name).name!r} is not in {model_dir} (config.json's "
            f"config_path {name!r}; a path outside the folder is not read) nor in an installed "
            "elmoformanylangs' configs/ (pip install elmoformanylangs, or copy the file into "
            "the folder)",
            field="config_path",
        )
    return _read_json(path, "config_path"), path.name


def _int_in(v: Any, field: str, lo: int, hi: int) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ConfigError(
            f"ELMoForManyLangs model: {field} is {v!r}; it must be an integer in [{lo}, {hi}]",
            field=field,
        )
    return v


def _check_sizes(te: dict, enc: dict) -> None:
    """Every size and count of the network config within sane maxima, before anything is
    built from them (a config of 100,000 layers would hang, of 1e9 characters a token
    allocate gigabytes an embed)."""
    for key, hi in LIMITS.items():
        part, name = key.split(".")
        obj = te if part == "token_embedder" else enc
        if name in obj or name not in ("word_dim", "n_highway"):
            lo = 0 if name in ("word_dim", "n_highway") else 1
            v = obj.get(name)
            if name == "word_dim" and v is None:
                continue
            _int_in(v, key, lo, hi)
    filters = te.get("filters")
    if not isinstance(filters, list) or not 1 <= len(filters) <= MAX_FILTERS:
        raise ConfigError(
            f"ELMoForManyLangs model: token_embedder.filters must be a list of 1 to "
            f"{MAX_FILTERS} [width, count] pairs",
            field="token_embedder.filters",
        )
    total = 0
    for i, f in enumerate(filters):
        if not isinstance(f, list) or len(f) != 2:
            raise ConfigError(
                f"ELMoForManyLangs model: token_embedder.filters[{i}] must be [width, count]",
                field=f"token_embedder.filters[{i}]",
            )
        _int_in(f[0], f"token_embedder.filters[{i}][0]", 1, MAX_FILTER_WIDTH)
        total += _int_in(f[1], f"token_embedder.filters[{i}][1]", 1, MAX_FILTER_COUNT)
    _int_in(total, "token_embedder.filters (their counts together)", 1, MAX_FILTER_COUNT)


def config_from_network(net: Any, char_rows: int, word_rows: int) -> BiLMConfig:
    """Its network config -> :class:`BiLMConfig`; anything we do not compute is refused."""
    _need(isinstance(net, dict), "network config", "must be a JSON object")
    te, enc = net.get("token_embedder"), net.get("encoder")
    _need(isinstance(te, dict), "token_embedder", "is missing or not an object")
    _need(isinstance(enc, dict), "encoder", "is missing or not an object")
    te_name, enc_name = str(te.get("name", "")).lower(), str(enc.get("name", "")).lower()
    _need(te_name == "cnn", "token_embedder.name", f"{te_name!r} is not supported (only 'cnn')")
    _need(enc_name == "elmo", "encoder.name", f"{enc_name!r} is not supported (only 'elmo')")
    _need(
        isinstance(te.get("char_dim"), int) and te["char_dim"] > 0,
        "token_embedder.char_dim",
        "must be > 0 (a model without characters is not supported)",
    )
    _need(
        te.get("activation") in ("relu", "tanh"),
        "token_embedder.activation",
        f"{te.get('activation')!r} is not supported (relu or tanh)",
    )
    _check_sizes(te, enc)
    word_dim = te.get("word_dim") or 0
    clip = {k: (enc.get(k) or None) for k in ("cell_clip", "proj_clip")}  # its `if clip:`
    dropout = net.get("dropout", 0.1)
    try:
        return BiLMConfig(
            char_dim=te["char_dim"],
            filters=tuple(tuple(f) for f in te["filters"]),
            n_highway=te.get("n_highway", 0),
            activation=te["activation"],
            max_chars_per_token=te["max_characters_per_token"],
            char_vocab_size=char_rows,
            word_dim=word_dim,
            word_vocab_size=word_rows if word_dim else 0,
            projection_dim=enc["projection_dim"],
            lstm_dim=enc["dim"],
            n_layers=enc["n_layers"],
            cell_clip=clip["cell_clip"],
            proj_clip=clip["proj_clip"],
            residual=True,
            dropout=dropout if isinstance(dropout, int | float) and 0 <= dropout < 1 else 0.1,
        )
    except KeyError as e:
        raise ConfigError(
            f"ELMoForManyLangs model: network config lacks {e.args[0]!r}", field=str(e.args[0])
        ) from e
    except (TypeError, ValueError) as e:
        raise ConfigError(f"ELMoForManyLangs model: network config: {e}", field="config") from e


def _load_tensors(path: Path) -> dict[str, torch.Tensor]:
    if not path.is_file():
        raise ArtifactError(f"missing {path.name} in {path.parent}", field=path.name)
    try:  # tensors only, never unpickled freely; mapped, so a declared size costs no memory
        state = _torch_load(path)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
        raise ArtifactError(
            f"{path.name} is not a state dict of tensors: {_first_line(e)}", field=path.name
        ) from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ArtifactError(f"{path.name} is not a state dict of tensors", field=path.name)
    for k, v in state.items():
        if v.device.type != "cpu" or not v.is_floating_point():
            raise ArtifactError(
                f"{path.name}: {k} is a {v.dtype} tensor on {v.device.type}; weights are "
                "floating-point tensors with their values",
                field=k,
            )
        if v.untyped_storage().nbytes() < (v.storage_offset() + v.numel()) * v.element_size():
            raise ArtifactError(
                f"{path.name}: {k} declares {v.numel():,} values its file does not hold",
                field=k,
            )
    return state


def _torch_load(path: Path) -> dict:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):
            raise
    # the legacy (pre-zip) format cannot be mapped: read it, tensors only still
    return torch.load(path, map_location="cpu", weights_only=True)


def _first_line(e: BaseException) -> str:
    """torch's message, without its advice to load with ``weights_only=False`` (which
    would run whatever code the file carries): never advice we pass on."""
    if "Weights only load failed" in str(e) or "Unsupported global" in str(e):
        return "it holds objects other than tensors (refused: never unpickled)"
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    keep = [ln for ln in lines if "weights_only" not in ln and "WeightsUnpickler" not in ln]
    return (keep or ["it holds something other than tensors (refused, never run)"])[0][:300]


def _check_finite(path: Path, state: dict) -> dict:
    for k, v in state.items():
        if v.is_floating_point() and not torch.isfinite(v).all():
            raise ArtifactError(f"{path.name}: {k} holds NaN or infinite values", field=k)
    return state


def gates_from_allennlp(x: torch.Tensor) -> torch.Tensor:
    """AllenNLP's ``LstmCellWithProjection`` gate blocks (ELMoForManyLangs' too) in ours."""
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
            sd[f"{ours}.{layer}.w_ih.weight"] = gates_from_allennlp(
                e(f"{pre}.input_linearity.weight")
            )
            sd[f"{ours}.{layer}.w_ih.bias"] = gates_from_allennlp(e(f"{pre}.state_linearity.bias"))
            sd[f"{ours}.{layer}.w_hh.weight"] = gates_from_allennlp(
                e(f"{pre}.state_linearity.weight")
            )
            sd[f"{ours}.{layer}.w_proj.weight"] = e(f"{pre}.state_projection.weight")
    return sd


def load_efml(model_dir: str | Path) -> tuple[BiLM, Lexicon, dict[str, Any]]:
    """An ELMoForManyLangs model folder as our ``BiLM`` (eval mode), its lexicon and facts
    for the provenance."""
    model_dir = Path(model_dir)
    net, net_name = read_network_config(model_dir)
    te = _load_tensors(model_dir / TOKEN_EMBEDDER_FILE)
    enc = _load_tensors(model_dir / ENCODER_FILE)
    te_cfg = net.get("token_embedder") if isinstance(net, dict) else None
    words = isinstance(te_cfg, dict) and bool(te_cfg.get("word_dim"))
    char_w = te.get("char_emb_layer.embedding.weight")
    word_w = te.get("word_emb_layer.embedding.weight")
    cfg = config_from_network(
        net,
        char_rows=int(char_w.shape[0]) if char_w is not None and char_w.ndim == 2 else 1,
        word_rows=int(word_w.shape[0]) if word_w is not None and word_w.ndim == 2 else 0,
    )
    if words and word_w is None:
        raise ArtifactError(
            f"{TOKEN_EMBEDDER_FILE} lacks 'word_emb_layer.embedding.weight' (word_dim > 0)",
            field="word_emb_layer.embedding.weight",
        )
    lexicon = Lexicon.from_dir(model_dir, words=words)
    if lexicon.max_char_id >= cfg.char_vocab_size:
        raise ArtifactError(
            f"char.dic holds id {lexicon.max_char_id}, the character embedding "
            f"{cfg.char_vocab_size} rows",
            field="char.dic",
        )
    if words and lexicon.max_word_id >= cfg.word_vocab_size:
        raise ArtifactError(
            f"word.dic holds id {lexicon.max_word_id}, the word embedding "
            f"{cfg.word_vocab_size} rows",
            field="word.dic",
        )
    for name, ids in (("char.dic", lexicon.chars), ("word.dic", lexicon.words or {})):
        values = list(ids.values())
        if values and min(values) < 0:
            raise ArtifactError(f"{name} holds a negative id ({min(values)})", field=name)
        if len(set(values)) != len(values):
            dup = next(v for v in values if values.count(v) > 1)
            raise ArtifactError(f"{name} gives id {dup} to more than one entry", field=name)
    # every tensor's shape against the config before anything is built: the model's own
    # shapes come from a model on the meta device (no memory), the tensors are mapped files
    with torch.device("meta"):
        own = BiLM(cfg).state_dict()
    state = state_dict_from_efml(te, enc, cfg)
    for k, v in state.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise ArtifactError(
                f"{k}: shape {list(v.shape)} does not fit the network config "
                f"(expected {list(own[k].shape)})",
                field=k,
            )
    _check_finite(Path(TOKEN_EMBEDDER_FILE), te)
    _check_finite(Path(ENCODER_FILE), enc)
    model = BiLM(cfg)
    model.load_state_dict(state)
    model.eval()
    files = [
        f for f in ("config.json", net_name, "char.dic", "word.dic") if (model_dir / f).is_file()
    ]
    facts = {
        "source_files": {
            f: {"sha256": sha256_file(model_dir / f)}
            for f in (*files, TOKEN_EMBEDDER_FILE, ENCODER_FILE)
        },
        "characters": len(lexicon.chars),
        "words": 0 if lexicon.words is None else len(lexicon.words),
    }
    return model, lexicon, facts


def convert_efml(model_dir: str | Path, out_dir: str | Path, overwrite: bool = False) -> str:
    """Convert an ELMoForManyLangs model folder to an artifact; returns its version.

    The artifact's tokenizer is :class:`LexiconTokenizer` (its ``char.dic``/``word.dic``
    inside). Raises :class:`ConfigError` for a network config we do not compute and
    :class:`ArtifactError` naming a missing or malformed file or tensor.
    """
    model, lexicon, facts = load_efml(model_dir)
    provenance = {
        "source": f"converted from {SOURCE_FORMAT}",
        "source_format": SOURCE_FORMAT,
        **facts,
    }
    return save_artifact(
        model, LexiconTokenizer(lexicon), out_dir, provenance=provenance, overwrite=overwrite
    )


__all__ = [
    "config_from_network",
    "convert_efml",
    "is_efml_dir",
    "load_efml",
    "state_dict_from_efml",
]
