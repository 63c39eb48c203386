"""Random-weight bilm-tf models (``options.json`` + ``weights.hdf5``) for tests.

The files follow the published layout (see ``elmo_service/convert.py``): TF
``x @ W`` matrices, conv2d kernels ``[1, width, char_dim, n]``, LSTM ``W_0``
with rows ``[x ; h]`` and gate columns ``(i, j, f, o)``, no forget bias.

Weights are drawn at the scale that keeps every stage informative: about unit
variance pre-activations, so sigmoids and tanhs are not saturated and the
cell/projection clips bite rarely. Saturated or clipped values would hide a
swapped gate or a missing transpose.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import h5py
import numpy as np

SMALL = {
    "filters": [[1, 4], [2, 8], [3, 16]],
    "char_dim": 4,
    "lstm_dim": 32,
    "projection_dim": 16,
    "n_layers": 2,
    "clip": 3.0,
}


def bilm_options(
    *,
    n_characters: int = 262,
    activation: str = "relu",
    n_highway: int = 1,
    use_skip_connections: bool | None = True,
    filters: list[list[int]] | None = None,
    char_dim: int = SMALL["char_dim"],
    lstm_dim: int = SMALL["lstm_dim"],
    projection_dim: int = SMALL["projection_dim"],
    n_layers: int = SMALL["n_layers"],
    clip: float | None = SMALL["clip"],
) -> dict[str, Any]:
    """A training-time style ``options.json`` (extra keys included, as in the wild).

    ``use_skip_connections=None`` leaves the key out.
    """
    lstm: dict[str, Any] = {
        "dim": lstm_dim,
        "projection_dim": projection_dim,
        "n_layers": n_layers,
        "cell_clip": clip,
        "proj_clip": clip,
    }
    if use_skip_connections is not None:
        lstm["use_skip_connections"] = use_skip_connections
    return {
        "bidirectional": True,
        "char_cnn": {
            "activation": activation,
            "embedding": {"dim": char_dim},
            "filters": [list(f) for f in (filters or SMALL["filters"])],
            "max_characters_per_token": 50,
            "n_characters": n_characters,
            "n_highway": n_highway,
        },
        "dropout": 0.1,
        "lstm": lstm,
        "all_clip_norm_val": 10.0,
        "n_epochs": 10,
        "n_train_tokens": 768648884,
        "batch_size": 128,
        "n_tokens_vocab": 793471,
        "unroll_steps": 20,
        "n_negative_samples_batch": 8192,
    }


def bilm_arrays(
    options: dict[str, Any], *, char_rows: int = 261, seed: int = 0
) -> dict[str, np.ndarray]:
    """Random float32 datasets for ``options``, keyed by their HDF5 path."""
    rng = np.random.default_rng(seed)
    cnn, lstm = options["char_cnn"], options["lstm"]
    d = cnn["embedding"]["dim"]
    filters = cnn["filters"]
    f_total = sum(n for _, n in filters)
    p, c = lstm["projection_dim"], lstm["dim"]

    def normal(*shape: int, scale: float) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    arrays: dict[str, np.ndarray] = {"char_embed": normal(char_rows, d, scale=1.0)}
    for i, (w, n) in enumerate(filters):
        arrays[f"CNN/W_cnn_{i}"] = normal(1, w, d, n, scale=1.0 / np.sqrt(w * d))
        arrays[f"CNN/b_cnn_{i}"] = normal(n, scale=0.3)
    for k in range(cnn.get("n_highway", 0)):
        hw = f"CNN_high_{k}"
        arrays[f"{hw}/W_carry"] = normal(f_total, f_total, scale=1.0 / np.sqrt(f_total))
        arrays[f"{hw}/b_carry"] = normal(f_total, scale=0.5)
        arrays[f"{hw}/W_transform"] = normal(f_total, f_total, scale=1.0 / np.sqrt(f_total))
        arrays[f"{hw}/b_transform"] = normal(f_total, scale=0.3)
    arrays["CNN_proj/W_proj"] = normal(f_total, p, scale=1.0 / np.sqrt(f_total))
    arrays["CNN_proj/b_proj"] = normal(p, scale=0.3)
    for direction in (0, 1):
        for layer in range(lstm["n_layers"]):
            pre = f"RNN_{direction}/RNN/MultiRNNCell/Cell{layer}/LSTMCell"
            arrays[f"{pre}/W_0"] = normal(2 * p, 4 * c, scale=1.0 / np.sqrt(2 * p))
            arrays[f"{pre}/B"] = normal(4 * c, scale=0.5)
            arrays[f"{pre}/W_P_0"] = normal(c, p, scale=1.5 / np.sqrt(c))
    return arrays


def write_hdf5(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    with h5py.File(path, "w") as fout:
        for name, arr in arrays.items():
            fout.create_dataset(name, data=arr)
    return path


def write_bilm(
    directory: str | Path,
    *,
    n_characters: int = 261,
    seed: int = 0,
    **option_kwargs: Any,
) -> tuple[Path, Path]:
    """Write ``options.json`` and ``weights.hdf5`` into ``directory``.

    ``n_characters`` is both the options value and the row count of
    ``char_embed`` (261 as bilm-tf trains, 262 as some re-exports ship).
    Other keyword arguments go to :func:`bilm_options`.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    options = bilm_options(n_characters=n_characters, **option_kwargs)
    options_path = directory / "options.json"
    options_path.write_text(json.dumps(options, indent=2))
    weights_path = write_hdf5(
        directory / "weights.hdf5", bilm_arrays(options, char_rows=n_characters, seed=seed)
    )
    return options_path, weights_path


def edit_hdf5(
    path: Path,
    *,
    delete: tuple[str, ...] = (),
    replace: dict[str, np.ndarray] | None = None,
) -> Path:
    """Remove or overwrite datasets of an existing weights file (for error tests)."""
    with h5py.File(path, "a") as f:
        for name in (*delete, *(replace or {})):
            if name in f:
                del f[name]
        for name, arr in (replace or {}).items():
            f.create_dataset(name, data=arr)
    return path
