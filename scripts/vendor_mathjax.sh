#!/usr/bin/env bash
# Copy MathJax's browser build (the es5 folder of the `mathjax` npm package) into a folder of the book's
# static files. Called by scripts/setup.sh:  bash scripts/vendor_mathjax.sh VERSION INTEGRITY DEST
# `npm pack` fetches the package's tarball as published (no install scripts run); its integrity hash is
# checked against the one pinned in scripts/setup.sh before anything is unpacked.
set -euo pipefail
version=$1 integrity=$2 dest=$3
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent --json --fetch-retries=1 "mathjax@$version" > pack.json)
got=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[0]["integrity"])' "$tmp/pack.json")
if [ "$got" != "$integrity" ]; then
  echo "!! mathjax@$version: integrity $got, expected $integrity" >&2
  exit 1
fi
tar xzf "$tmp/mathjax-$version.tgz" -C "$tmp"
rm -rf "$dest"
mkdir -p "$dest"
# Only what the CommonHTML output of tex-mml-chtml.js loads: the component itself, its fonts, the TeX
# extensions it autoloads, and the menu's accessibility parts (a11y, speech rule engine, ui).
es5="$tmp/package/es5"
cp "$es5/tex-mml-chtml.js" "$tmp/package/LICENSE" "$dest/"
mkdir -p "$dest/output"
cp -r "$es5/output/chtml" "$dest/output/"
cp -r "$es5/input" "$es5/a11y" "$es5/sre" "$es5/ui" "$es5/adaptors" "$dest/"
echo "$version" > "$dest/VERSION"
