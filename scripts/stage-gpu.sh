#!/usr/bin/env bash
# Stage the pinned FP8 stack for the GPU machine (../shared/gpu/stage.sh), then cut its TransformerEngine wheel into
# 16 MiB parts and give small.tar a part of its own: each call carries one part plus this working tree, under the
# device's 64 MiB per call while the tracked tree stays under ~47.5 MiB (41 MiB on 2026-11-29, growing with
# profiles/: `git ls-files -z | xargs -0 du -cb | tail -1`; past that, split smaller). receive.sh installs once every
# part has arrived, in any order, joining the parts in name order. Prints the parts to send.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
bash ../shared/gpu/stage.sh > /dev/null
work=.gpu/restage
mkdir -p "$work"
cat $(ls .gpu/p*/core.part.* | awk -F/ '{print $NF " " $0}' | sort | cut -d' ' -f2) > "$work/core"
mv .gpu/p0/core.sha256 .gpu/p0/receive.sh .gpu/p0/small.tar "$work/"
rm -rf .gpu/p[0-9]*
split -b 16m -d "$work/core" "$work/core.part."
parts=0
for piece in $(ls "$work"/core.part.* | sort); do
  mkdir -p ".gpu/p$parts" && mv "$piece" ".gpu/p$parts/" && cp "$work/receive.sh" ".gpu/p$parts/"
  parts=$((parts + 1))
done
mv "$work/core.sha256" .gpu/p0/ && echo "$parts" > .gpu/p0/parts
mkdir -p ".gpu/p$parts" && mv "$work/small.tar" "$work/receive.sh" ".gpu/p$parts/"
rm -rf "$work"
# DeepGEMM's sdist, pinned in launch/build_deepgemm.sh, rides with small.tar: the GPU machine reaches no network.
eval "$(grep -E '^(VERSION|SHA256|URL)=' launch/build_deepgemm.sh)"
sdist=".gpu/p$parts/deepinfer_gemm-$VERSION.tar.gz"
curl -sSLo "$sdist" "$URL"
echo "$SHA256  $sdist" | sha256sum -c --quiet
echo "DeepGEMM's sdist: $sdist (launch/build_deepgemm.sh $sdist TARGET on the GPU machine)"
echo "Send each part in its own run call (carry [\".gpu/pN\"], command bash .gpu/pN/receive.sh):"
ls -d .gpu/p* | sort -V | while read -r part; do echo "  $part ($(du -sh "$part" | cut -f1))"; done
