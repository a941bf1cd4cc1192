#!/bin/sh
# The init container wait-for-model of every baton pod: baton starts only on a complete, verified
# model file. Waits until the marker MODEL_DIR/MODEL_FILE.sha256, which fetch-model.sh writes
# after renaming the verified file into place, names MODEL_SHA256; then checks the file's sha256
# itself (a volume filled by hand, a damaged copy). A mismatch fails the container, and the
# kubelet retries it with back-off. POSIX sh; needs sha256sum and cut.
set -eu

: "${MODEL_DIR:?}" "${MODEL_FILE:?}" "${MODEL_SHA256:?}"
file="$MODEL_DIR/$MODEL_FILE"
marker="$file.sha256"
poll="${MODEL_POLL_SECONDS:-5}"

waited=0
until [ -f "$marker" ] && [ "$(cut -d' ' -f1 "$marker")" = "$MODEL_SHA256" ]; do
  if [ $((waited % 60)) -lt "$poll" ]; then
    echo "wait-for-model: waiting for $marker with sha256 $MODEL_SHA256 (Job baton-fetch-model writes it)"
  fi
  sleep "$poll"
  waited=$((waited + poll))
done

if ! echo "$MODEL_SHA256  $file" | sha256sum -c --status; then
  echo "wait-for-model: $file does not match sha256 $MODEL_SHA256: refill the volume" \
    "(delete the file and its .sha256, then rerun Job baton-fetch-model)" >&2
  exit 1
fi
echo "wait-for-model: $file matches sha256 $MODEL_SHA256"
