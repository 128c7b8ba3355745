#!/usr/bin/env bash
# Builds the wheel and the sdist, and installs each into a fresh venv that already has torch, proving that
# the install leaves torch alone:
#   - the wheel, with every runtime requirement at its lowest tested version (constraints-min.txt) and no
#     extras, so the missing-extra hints are exercised too;
#   - the sdist, with the extras at the versions tested together (constraints.txt).
# Each install is checked by tools/smoke_install.py, run from outside the source tree.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
ROOT=$PWD
OUT=$ROOT/build/package-check
BUILD_PY=${BUILD_PY:-$ROOT/.venv/bin/python}
rm -rf "$OUT" && mkdir -p "$OUT/dist" "$OUT/run"

"$BUILD_PY" -m build --outdir "$OUT/dist" . >"$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
WHEEL=$(ls "$OUT"/dist/shardpoint-*.whl)
SDIST=$(ls "$OUT"/dist/shardpoint-*.tar.gz)
echo "built $(basename "$WHEEL") and $(basename "$SDIST")"
# the sdist carries what a rebuild needs, and no stray build or venv folders
tar tzf "$SDIST" >"$OUT/sdist.txt"
grep -q '/pyproject.toml$' "$OUT/sdist.txt"
grep -q '/shardpoint/format/manifest.py$' "$OUT/sdist.txt"
if grep -qE '/(\.venv|build|site)/' "$OUT/sdist.txt"; then echo "the sdist holds build output"; exit 1; fi
grep -q '/LICENSE$' "$OUT/sdist.txt" || { echo "the sdist lacks LICENSE"; exit 1; }
# the wheel ships the typing marker and the license text
"$BUILD_PY" -m zipfile -l "$WHEEL" >"$OUT/wheel.txt"
grep -q 'shardpoint/py.typed' "$OUT/wheel.txt" || { echo "the wheel lacks shardpoint/py.typed"; exit 1; }
grep -qE '\.dist-info/(licenses/)?LICENSE' "$OUT/wheel.txt" || { echo "the wheel lacks LICENSE"; exit 1; }

$PY -m venv "$OUT/venv"
PIP="$OUT/venv/bin/pip"
$PIP install -q -c "$ROOT/constraints.txt" torch==2.13.0
torch_before=$($PIP freeze | grep -i '^torch==')

check() {  # $1: what was installed
  local torch_after
  torch_after=$($PIP freeze | grep -i '^torch==')
  if [ "$torch_before" != "$torch_after" ]; then echo "$1 changed torch: $torch_before -> $torch_after"; exit 1; fi
  (cd "$OUT/run" && "$OUT/venv/bin/python" "$ROOT/tools/smoke_install.py")
}

$PIP install -q -c "$ROOT/constraints-min.txt" "$WHEEL"
$PIP freeze >"$OUT/freeze-min.txt"
for req in $(grep -E '^(numpy|xxhash|fsspec|psutil)==' "$ROOT/constraints-min.txt"); do
  grep -qix "$req" "$OUT/freeze-min.txt" || { echo "expected $req in the lowest-version install"; cat "$OUT/freeze-min.txt"; exit 1; }
done
# no extras were asked for, so none of their packages may be there
if grep -qiE '^(rich|tqdm|safetensors|boto3|matplotlib)==' "$OUT/freeze-min.txt"; then
  echo "the core install pulled in an optional package:"; cat "$OUT/freeze-min.txt"; exit 1
fi
check "the wheel (lowest tested requirements, no extras)"

$PIP uninstall -q -y shardpoint
$PIP install -q -c "$ROOT/constraints.txt" "$SDIST[all]"
check "the sdist (with all extras)"
echo "package-check: wheel and sdist install beside torch ($torch_before) and work"
