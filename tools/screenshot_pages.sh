#!/usr/bin/env bash
# Screenshot every generated reading page as a reader's browser shows it (1600x1000, headless
# Chromium), to look at: side-by-side diffs that wrap or overflow, guided pages that read badly. The
# Markdown pages (the README, the guided pages) are rendered first as GitHub renders them
# (tools/render_markdown.py, with the dev requirements).
#
#   bash tools/screenshot_pages.sh [OUT_DIR]      # default: /tmp/ladder-screenshots
# Needs Debian's chromium (apt-get install -y chromium). Writes one PNG per page into OUT_DIR.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-/tmp/ladder-screenshots}
mkdir -p "$OUT"
BROWSER=$(command -v chromium || command -v chromium-browser || true)
[ -n "$BROWSER" ] || { echo "screenshot_pages: no chromium (apt-get install -y chromium)" >&2; exit 2; }
PROFILE=$(mktemp -d)
trap 'rm -rf "$PROFILE"' EXIT
PYTHON=${PYTHON:-.venv/bin/python}
RENDERED=$(mktemp -d)
trap 'rm -rf "$PROFILE" "$RENDERED"' EXIT
"$PYTHON" tools/render_markdown.py "$RENDERED" README.md docs/diffs/*.guided.md > /dev/null
for page in docs/diffs/*.html "$RENDERED"/*.html; do
    name=$(basename "$page" .html)
    "$BROWSER" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
        --disable-background-networking --disable-component-update --disable-sync \
        --user-data-dir="$PROFILE" --hide-scrollbars --window-size=1600,1000 \
        --screenshot="$OUT/$name.png" "file://$(realpath "$page")" > /dev/null 2>&1
    echo "$OUT/$name.png"
done
