#!/usr/bin/env bash
# Builds the book (docs/, mdBook) and checks its links and README.md's.
#
#   hack/book.sh            build into docs/book (git-ignored), then check the links
#   open docs/book/index.html
#
# mdBook 0.5.4 is installed once with cargo into the cache outside the repository
# ($FENCEDLEASE_CACHE/mdbook-0.5.4, default ~/.cache/fencedlease), built in a target folder of its
# own under the cache and at the lowest priority, so that it never waits on or disturbs the
# project's target/. Later runs take a second.
#
# The link check (hack/linkcheck.py) fails naming the file, the link and what is wrong: every
# relative link in docs/src/*.md and README.md must name an existing file, and every #anchor a
# heading of the target markdown file (mdBook's id rule), and for a page of the book an id the
# rendered page carries. mdBook itself has no option to fail on broken links (its guide points
# to the mdbook-linkcheck2 backend); book.toml's `create-missing = false` makes it fail on a
# chapter SUMMARY.md names but that is missing, and this script fails on any warning it prints.
set -euo pipefail
# shellcheck source=hack/lib.sh
source "$(dirname "$0")/lib.sh"
cd "$FL_REPO"

VERSION=0.5.4
ROOT="$FL_CACHE/mdbook-$VERSION"
MDBOOK="$ROOT/bin/mdbook"

works() { [ -x "$MDBOOK" ] && "$MDBOOK" --version 2>/dev/null | grep -q "^mdbook v$VERSION\$"; }

if ! works; then
  mkdir -p "$ROOT" || die "cannot create $ROOT: set FENCEDLEASE_CACHE to a writable folder"
  # One installer at a time; the others wait, then reuse.
  exec 9>"$ROOT/.install.lock"
  if ! flock -n 9; then
    log "another install of mdBook $VERSION is running (lock: $ROOT/.install.lock); waiting for it"
    flock 9
  fi
  if ! works; then
    command -v cargo >/dev/null || die "cargo not found: install Rust with rustup (https://rustup.rs), then rerun"
    build="$FL_CACHE/mdbook-$VERSION-build"
    log "installing mdBook $VERSION into $ROOT: this takes a few minutes once (build folder: $build)"
    # From the cache folder, so that no cargo configuration of the repository applies.
    (cd "$FL_CACHE" && CARGO_TARGET_DIR="$build" with_heartbeat "cargo install mdbook $VERSION" "$ROOT/install.log" \
      nice -n 19 cargo install mdbook --version "$VERSION" --locked --root "$ROOT")
    works || die "cargo install finished but $MDBOOK does not report mdbook v$VERSION (log: $ROOT/install.log); remove $ROOT and rerun"
    rm -rf "$build"
    log "mdBook $VERSION installed at $MDBOOK"
  fi
  exec 9>&-
fi

out="$(mktemp)"
trap 'rm -f "$out"' EXIT
log "mdbook build docs (into docs/book)"
if ! "$MDBOOK" build docs >"$out" 2>&1; then
  cat "$out" >&2
  die "mdbook build docs failed (above): a chapter SUMMARY.md names is missing, or docs/book.toml is wrong"
fi
if grep -E '(^| )(WARN|ERROR)( |$)' "$out" >&2; then
  die "mdbook build docs printed the warnings above: fix them"
fi

# mdBook renders a link to any .md file as .html, also to the repository's files outside the
# book (../../BENCHMARKS.md): point those back at the markdown file, which exists.
python3 - docs/book <<'PY'
import os, re, sys
book = sys.argv[1]
for name in os.listdir(book):
    if not name.endswith(".html"):
        continue
    page = os.path.join(book, name)
    text = open(page, encoding="utf-8").read()
    def md(m):
        md_path = os.path.normpath(os.path.join(book, m.group(1) + ".md"))
        return f'href="{m.group(1)}.md{m.group(2) or ""}"' if os.path.exists(md_path) else m.group(0)
    new = re.sub(r'href="(\.\./\.\./[^"#]+)\.html(#[^"]*)?"', md, text)
    if new != text:
        open(page, "w", encoding="utf-8").write(new)
PY
log "checking the links of docs/src/*.md and README.md, and of the rendered pages"
python3 hack/linkcheck.py --book docs --html docs/book README.md docs/src/*.md
log "the book is in docs/book/index.html; links checked"
