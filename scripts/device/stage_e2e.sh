#!/usr/bin/env bash
# Stages what scripts/device/sd_e2e.sh needs into DEST (a folder of the checkout the device
# tool sends, ignored by git, named in `carry`): the release `sd` (portable: build it without
# target-cpu=native, e.g. RUSTFLAGS="-C target-cpu=x86-64-v3"), the xtask binary, the ggml
# source llama-cpp-sys-2 builds, and the scripts. Then on the device:
#   cd DEST && PHASES=... bash sd_e2e.sh "$OUT"
# usage: stage_e2e.sh TARGET_DIR DEST
set -euo pipefail
T=${1:?target dir}
DEST=${2:?dest}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$DEST"
cp "$T/release/sd" "$DEST/sd"
strip "$DEST/sd" 2>/dev/null || true
cp "$T/release/xtask" "$DEST/xtask" 2>/dev/null || cp "$T/debug/xtask" "$DEST/xtask"
G=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/llama-cpp-sys-2-*/llama.cpp/ggml | tail -1)
tar -czf "$DEST/ggml.tgz" -C "$G" .
cp "$HERE/sd_e2e.sh" "$HERE/random_sd15.py" "$HERE/compare.py" "$DEST/"
du -sh "$DEST"
