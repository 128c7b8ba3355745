#!/usr/bin/env bash
# Builds the wheel and the sdist, and installs them into fresh venvs that already have torch, proving that
# the install leaves torch alone, at both ends of the supported torch range:
#   - beside the lowest supported torch (constraints-min.txt), the wheel with every runtime requirement at
#     its lowest tested version and no extras, so the missing-extra hints are exercised too;
#   - beside the newest tested torch (constraints.txt), the wheel and then the sdist, with the extras at the
#     versions tested together.
# Each install is checked by tools/smoke_install.py and, for each torch, tools/smoke_dist.py (a 2-rank
# FSDP2 save and its resharding loads), both run from outside the source tree.
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

# $1: the venv; $2: the constraints file that pins its torch. Prints how long the venv took.
make_venv() {
  local t0=$SECONDS
  $PY -m venv "$1"
  "$1/bin/pip" install -q -c "$2" torch
  echo "venv with $(grep -E '^torch==' "$2"): $((SECONDS - t0)) s"
}

check() {  # $1: the venv; $2: the torch it had before; $3: what was installed
  local torch_after
  torch_after=$("$1/bin/pip" freeze | grep -i '^torch==')
  if [ "$2" != "$torch_after" ]; then echo "$3 changed torch: $2 -> $torch_after"; exit 1; fi
  (cd "$OUT/run" && "$1/bin/python" "$ROOT/tools/smoke_install.py")
}

# The lowest end: the wheel with the lowest tested requirements and no extras.
LOW=$OUT/venv-min
make_venv "$LOW" "$ROOT/constraints-min.txt"
low_torch=$("$LOW/bin/pip" freeze | grep -i '^torch==')
"$LOW/bin/pip" install -q -c "$ROOT/constraints-min.txt" "$WHEEL"
"$LOW/bin/pip" freeze >"$OUT/freeze-min.txt"
for req in $(grep -E '^(numpy|xxhash|fsspec|psutil)==' "$ROOT/constraints-min.txt"); do
  grep -qix "$req" "$OUT/freeze-min.txt" || { echo "expected $req in the lowest-version install"; cat "$OUT/freeze-min.txt"; exit 1; }
done
# no extras were asked for, so none of their packages may be there
if grep -qiE '^(rich|tqdm|safetensors|boto3|matplotlib)==' "$OUT/freeze-min.txt"; then
  echo "the core install pulled in an optional package:"; cat "$OUT/freeze-min.txt"; exit 1
fi
check "$LOW" "$low_torch" "the wheel (lowest tested requirements, no extras)"
(cd "$OUT/run" && "$LOW/bin/python" "$ROOT/tools/smoke_dist.py")
rm -rf "$LOW"  # several GB

# The newest end: the wheel, then the sdist, with all extras at the tested versions.
NEW=$OUT/venv
make_venv "$NEW" "$ROOT/constraints.txt"
new_torch=$("$NEW/bin/pip" freeze | grep -i '^torch==')
"$NEW/bin/pip" install -q -c "$ROOT/constraints.txt" "$WHEEL[all]"
check "$NEW" "$new_torch" "the wheel (with all extras)"
(cd "$OUT/run" && "$NEW/bin/python" "$ROOT/tools/smoke_dist.py")
"$NEW/bin/pip" uninstall -q -y shardpoint
"$NEW/bin/pip" install -q -c "$ROOT/constraints.txt" "$SDIST[all]"
check "$NEW" "$new_torch" "the sdist (with all extras)"
echo "package-check: the wheel installs beside $low_torch and $new_torch, the sdist beside $new_torch; both work"
