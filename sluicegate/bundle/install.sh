#!/usr/bin/env bash
# Installs Sluicegate from this offline bundle (made by `sluicegate bundle`) on a line PC
# that cannot reach a package registry: it checks the Python, verifies every file against
# MANIFEST.json, creates a virtualenv, installs the bundled wheels with pip --no-index and
# nothing else (pip's own configuration and PIP_* variables are ignored, so no index or
# extra wheel folder of the machine can slip in), and puts the models and example configs
# under the prefix. It never downloads anything and never touches files outside --prefix.
set -euo pipefail

PYTHON_VERSION="@PYTHON_VERSION@"
VERSION="@VERSION@"
BUNDLE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
PREFIX=/opt/sluicegate
PY=""
VERIFY_ONLY=0
REPLACE=0

usage() {
  cat <<EOF
usage: install.sh [--prefix DIR] [--python PATH] [--replace] [--verify-only]

Installs sluicegate $VERSION for Python $PYTHON_VERSION from this bundle, offline:
  DIR/venv     the virtualenv (DIR defaults to $PREFIX)
  DIR/models   the models, verified against their manifests at build time
  DIR/config   example configs (existing files are kept)

  --python PATH    the Python $PYTHON_VERSION to use (default: python$PYTHON_VERSION, then python3)
  --replace        remove an existing DIR/venv first (default: refuse to touch it)
  --verify-only    check the bundle against MANIFEST.json and this machine, install nothing
EOF
}

fail() {
  echo "install.sh: error: $*" >&2
  exit 1
}

while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) [ $# -ge 2 ] || fail "--prefix needs a folder"; PREFIX=$2; shift 2 ;;
    --prefix=*) PREFIX=${1#--prefix=}; shift ;;
    --python) [ $# -ge 2 ] || fail "--python needs a path"; PY=$2; shift 2 ;;
    --python=*) PY=${1#--python=}; shift ;;
    --replace) REPLACE=1; shift ;;
    --verify-only) VERIFY_ONLY=1; shift ;;
    -h | --help) usage; exit 0 ;;
    *) usage >&2; fail "unknown option '$1'" ;;
  esac
done

# 1. The interpreter: the bundled wheels are built for exactly one Python minor version.
if [ -z "$PY" ]; then
  PY=$(command -v "python$PYTHON_VERSION" || command -v python3 || true)
  [ -n "$PY" ] || fail "no python$PYTHON_VERSION or python3 on PATH; pass --python PATH"
fi
HAVE=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])') || fail "cannot run $PY"
[ "$HAVE" = "$PYTHON_VERSION" ] ||
  fail "this bundle is for Python $PYTHON_VERSION; $PY is Python $HAVE (pass --python PATH)"

# 2. The bundle: every file as MANIFEST.json lists it, nothing more; and this machine's
# architecture and C library as new as the newest wheel needs.
"$PY" - "$BUNDLE" <<'VERIFY' || fail "the bundle failed its checks; nothing was installed"
import hashlib, json, os, pathlib, platform, sys

root = pathlib.Path(sys.argv[1])
manifest = json.loads((root / "MANIFEST.json").read_text())
listed = {entry["path"]: entry for entry in manifest["files"]}
bad = []
for path, entry in sorted(listed.items()):
    digest = hashlib.sha256()
    try:
        with open(root / path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    except OSError as exc:
        bad.append(f"{path}: cannot be read ({exc.strerror})")
        continue
    if digest.hexdigest() != entry["sha256"]:
        bad.append(f"{path}: sha256 {digest.hexdigest()}, MANIFEST.json says {entry['sha256']}")
for path in sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()):
    if path != "MANIFEST.json" and path not in listed:
        bad.append(f"{path}: not in MANIFEST.json")
for line in bad:
    print(f"install.sh: {line}", file=sys.stderr)
if bad:
    sys.exit("install.sh: the bundle is damaged or was changed; copy it again from the build "
             "machine and compare the archive's sha256 with the one the build printed")
if platform.machine() != manifest["arch"]:
    sys.exit(f"install.sh: this bundle is for {manifest['arch']}; this machine is {platform.machine()}")
need = manifest["requires_glibc"]
if need is not None:
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        libc = ""
    have = libc.removeprefix("glibc ").split(".")[:2] if libc.startswith("glibc ") else ["0"]
    if tuple(map(int, have)) < tuple(map(int, need.split("."))):
        sys.exit(f"install.sh: the bundled wheels need glibc {need} or newer; "
                 f"this machine has {libc or 'another C library'}")
print(f"verified {len(listed)} files against MANIFEST.json "
      f"(sluicegate {manifest['version']}, commit {manifest['commit'] or 'unknown'})")
VERIFY
[ "$VERIFY_ONLY" = 0 ] || exit 0

# 3. The virtualenv, and pip from the bundle (so no ensurepip is needed on the line PC).
mkdir -p "$PREFIX"
PREFIX=$(cd "$PREFIX" && pwd)
VENV=$PREFIX/venv
if [ -e "$VENV" ]; then
  [ "$REPLACE" = 1 ] || fail "$VENV exists; pass --replace to install over it"
  rm -rf "$VENV"
fi
"$PY" -m venv --without-pip "$VENV"
PIP_WHEELS=("$BUNDLE"/wheels/pip-*.whl)
[ -f "${PIP_WHEELS[0]}" ] || fail "no pip wheel in $BUNDLE/wheels"
PIP_CONFIG_FILE=/dev/null "$VENV/bin/python" "${PIP_WHEELS[0]}/pip" --isolated install \
  --no-index --find-links "$BUNDLE/wheels" --only-binary=:all: --no-cache-dir \
  --disable-pip-version-check --quiet pip "sluicegate==$VERSION"

# 4. Models (where the installed sluicegate looks for them) and example configs.
mkdir -p "$PREFIX/models" "$VENV/share/sluicegate"
cp "$BUNDLE"/models/* "$PREFIX/models/"
ln -sfn "$PREFIX/models" "$VENV/share/sluicegate/models"
if [ -d "$BUNDLE/config" ]; then
  mkdir -p "$PREFIX/config"
  for file in "$BUNDLE"/config/*; do
    [ -e "$PREFIX/config/$(basename "$file")" ] || cp "$file" "$PREFIX/config/"
  done
fi
env -u SLUICEGATE_MODELS_DIR "$VENV/bin/sluicegate" models list

echo
echo "Installed sluicegate $VERSION in $VENV, models in $PREFIX/models."
echo "The installed sluicegate finds the models by itself (through $VENV/share/sluicegate/models);"
echo "for another folder set SLUICEGATE_MODELS_DIR=DIR or [edge] models_dir in the config"
echo "(\`sluicegate models list --models-dir DIR\` checks one)."
echo "Next, on a line PC:"
if "$VENV/bin/sluicegate" edge install --help >/dev/null 2>&1; then
  echo "  install the edge agent as a systemd service (see docs/deployment.md):"
  echo "    sudo $VENV/bin/sluicegate edge install --id LINE-ID --zone ZONE --mqtt-host MQTT-HOST"
  echo "  or run it by hand:"
fi
if [ -f "$PREFIX/config/edge.toml" ]; then
  echo "    $VENV/bin/sluicegate edge run --config $PREFIX/config/edge.toml"
  echo "  after setting its id, zone, MQTT host and TLS files there (a commented example)."
else
  echo "    $VENV/bin/sluicegate edge run --id LINE-ID --zone ZONE --host MQTT-HOST"
fi
