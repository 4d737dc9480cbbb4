#!/usr/bin/env bash
# Stage the pinned FP8 stack for the GPU machine (../shared/gpu/stage.sh), then move small.tar out of .gpu/p0 into a
# part of its own: p0 (59 MB) plus this working tree (13 MB and growing with profiles/) passes the device's 64 MiB
# per call. receive.sh installs once every part has arrived, in any order. Prints the parts to send.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
bash ../shared/gpu/stage.sh > /dev/null
last=$(ls -d .gpu/p* | sort -V | tail -1)
own=".gpu/p$(( ${last#.gpu/p} + 1 ))"
mkdir -p "$own" && mv .gpu/p0/small.tar "$own/" && cp .gpu/p0/receive.sh "$own/"
echo "Send each part in its own run call (carry [\".gpu/pN\"], command bash .gpu/pN/receive.sh):"
ls -d .gpu/p* | sort -V | while read -r part; do echo "  $part ($(du -sh "$part" | cut -f1))"; done
