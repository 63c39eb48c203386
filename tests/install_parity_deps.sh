#!/usr/bin/env bash
# Install AllenNLP 2.10.1 for tests/elmo_service/test_convert_parity.py, and
# ELMoForManyLangs 0.0.4.post2 for tests/elmo_service/test_efml_parity.py, beside torch 2.13.
#
#   bash tests/install_parity_deps.sh [PIP]     (default: .venv/bin/pip)
#
# AllenNLP 2.10.1 pins torch<1.13, so it and everything below go in with
# --no-deps: pip must never resolve a dependency, or it would fetch another
# torch. Only what `import allennlp.modules.elmo` needs and what installs
# cleanly here is installed; the packages that cannot be (transformers, spacy,
# fairscale, torchvision, the s3/gs/hf SDKs of cached-path) are stood in for by
# tests/support/allennlp_shim.py, which documents why each is never executed.
#
# Idempotent and fast: a package already present is left alone (allennlp and
# cached-path must match their pins exactly), so a second run installs nothing
# and needs no network.
set -euo pipefail

PIP="${1:-.venv/bin/pip}"
case "$PIP" in /*) ;; *) PIP="$PWD/$PIP" ;; esac
PY="$(dirname "$PIP")/python"
cd "$(dirname "$0")/.."

PINS=(
  allennlp==2.10.1          # the code under test (no deps: it pins torch<1.13)
  cached-path==1.1.6        # allennlp.common.file_utils; resolves the local file paths
  requests==2.34.2          # imported by cached-path's http scheme
  urllib3==2.8.0            #   requests
  charset-normalizer==3.5.2 #   requests
  idna==3.20                #   requests
  certifi==2026.10.18       #   requests
  rich==15.0.0              # imported by cached-path's download progress
  pygments==2.21.0          #   rich
  base58==2.1.1             # allennlp.common.util
  dill==0.4.1               # allennlp.common.util
  lmdb==3.0.0               # allennlp.common.file_utils
  more-itertools==11.2.1    # allennlp.data.data_loaders
  elmoformanylangs==0.0.4.post2  # ELMoForManyLangs (no deps: only torch, numpy, h5py, overrides)
  overrides==3.1.0          #   its Highway; overrides >= 4 fails at its import
)

missing="$("$PY" - "${PINS[@]}" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version

for spec in sys.argv[1:]:
    name, want = spec.split("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        print(spec)
        continue
    if name in ("allennlp", "cached-path", "elmoformanylangs", "overrides") and have != want:
        print(spec)
EOF
)"

if [ -z "$missing" ]; then
  exit 0  # everything in place: no network, no imports
fi

torch_version() { "$PY" -c 'from importlib.metadata import version; print(version("torch"))'; }
before="$(torch_version)"
# shellcheck disable=SC2086  # one spec per word
"$PIP" install --quiet --no-deps $missing
after="$(torch_version)"
if [ "$before" != "$after" ]; then
  echo "install_parity_deps: torch changed from $before to $after" >&2
  exit 1
fi

# the same import the parity tests do, so a broken install fails here, loudly
"$PY" -c 'from tests.support.allennlp_shim import import_allennlp_elmo; import_allennlp_elmo()'
"$PY" -c 'import elmoformanylangs'
echo "install_parity_deps: installed $(echo "$missing" | tr '\n' ' ')(torch $after untouched)"
