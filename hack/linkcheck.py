#!/usr/bin/env python3
"""Checks the relative links of markdown files; hack/book.sh runs it after `mdbook build docs`.

    hack/linkcheck.py --book docs --html docs/book README.md docs/src/*.md

Every relative link (inline `[text](target)`, image or reference definition, outside code) must
name an existing file or folder, relative to the file that holds it. Every `#anchor` must name a
heading of the target markdown file, by mdBook's id rule (the heading's text, lowercased, spaces
to '-', every character dropped that is not alphanumeric, '-' or '_'; a repeated id gets -1, -2,
...), which is also GitHub's for these headings. When the target is a chapter of the book (a
markdown file under BOOK/src), its page in HTML must exist (SUMMARY.md lists it) and carry
id="anchor". Links with a scheme (https:, mailto:) are not followed.

As a check of the id rule itself, every heading id computed here for a chapter must be an id of a
heading of the page mdBook rendered from it.

Exit status 1, with one line per problem (FILE:LINE: link TARGET: what is wrong), when anything
is broken. Standard library only.
"""
import argparse
import html
import os
import re
import sys

SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:|^//")
FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
# [text](target "title") and ![alt](target); the text may hold one level of brackets and wrap.
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^()\s<>]*)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REF_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
HTML_HEADING_ID = re.compile(r"<h[1-6][^>]*\bid=\"([^\"]*)\"")
ANY_ID = re.compile(r"\bid=\"([^\"]*)\"")


def prose(text):
    """The text with fenced code blocks blanked (lines kept, so that line numbers hold)."""
    out, fence = [], None
    for line in text.split("\n"):
        m = FENCE.match(line)
        if fence is None and m:
            fence = m.group(1)[0] * len(m.group(1))
            out.append("")
            continue
        if fence is not None:
            if line.strip().startswith(fence) and set(line.strip()) <= {fence[0]}:
                fence = None
            out.append("")
            continue
        out.append(line)
    return "\n".join(out)


def heading_text(raw):
    """The plain text mdBook renders from a heading's markdown (what its id is made from)."""
    t = re.sub(r"[ \t]+#+$", "", raw.strip())  # closing hashes
    t = re.sub(r"\\([!-/:-@\[-`{-~])", r"\1", t)  # backslash escapes
    t = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", t)  # links, images
    t = CODE_SPAN.sub(lambda m: m.group(2).strip(" "), t)
    t = re.sub(r"<[^>]+>", "", t)  # inline HTML
    t = re.sub(r"\*+", "", t)  # emphasis
    t = re.sub(r"(?<![A-Za-z0-9])_+([^_]+?)_+(?![A-Za-z0-9])", r"\1", t)
    return html.unescape(t)


def id_from_content(content):
    """mdBook 0.5's id rule (crates/mdbook-html/src/utils.rs, id_from_content)."""
    out = []
    for ch in content.strip().lower():
        if ch.isalnum() or ch in "_-":
            out.append(ch)
        elif ch.isspace():
            out.append("-")
    return "".join(out)


def heading_ids(path, cache={}):
    """The ids of the headings of a markdown file, in order, made unique as mdBook does."""
    if path not in cache:
        used, ids = set(), []
        with open(path, encoding="utf-8") as f:
            for line in prose(f.read()).split("\n"):
                m = ATX.match(line)
                if not m:
                    continue
                raw = m.group(2) or ""
                explicit = re.search(r"\s*\{#([^}\s]+)[^}]*\}\s*$", raw)
                ident = explicit.group(1) if explicit else id_from_content(heading_text(raw))
                base, n = ident, 0
                while ident in used:
                    n += 1
                    ident = f"{base}-{n}"
                used.add(ident)
                ids.append(ident)
        cache[path] = ids
    return cache[path]


def page_of(path, src, html_dir):
    """The rendered page of a chapter under src, or None if the file is not under src."""
    rel = os.path.relpath(path, src)
    if rel.startswith(".."):
        return None
    return os.path.join(html_dir, os.path.splitext(rel)[0] + ".html")


def html_ids(page, cache={}):
    if page not in cache:
        with open(page, encoding="utf-8") as f:
            text = f.read()
        cache[page] = (set(ANY_ID.findall(text)), set(HTML_HEADING_ID.findall(text)))
    return cache[page]


def links(text):
    """(line, target) of every link outside code in a markdown text."""
    body = prose(text)
    # Blank code spans, keeping their length and newlines, so that offsets stay right.
    body = CODE_SPAN.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), body)
    found = [(m.start(1), m.group(1)) for m in INLINE.finditer(body)]
    found += [(m.start(1), m.group(1)) for m in REF_DEF.finditer(body)]
    return sorted((body.count("\n", 0, pos) + 1, target) for pos, target in found)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--book", required=True, help="the book's root (holds book.toml and src/)")
    ap.add_argument("--html", required=True, help="where mdbook build wrote the HTML")
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    src = os.path.join(args.book, "src")
    problems, counted, anchors, against_html = [], 0, 0, 0

    def bad(where, target, what):
        problems.append(f"{where}: link {target}: {what}")

    for md in args.files:
        with open(md, encoding="utf-8") as f:
            text = f.read()
        for line, target in links(text):
            if not target or SCHEME.match(target):
                continue
            counted += 1
            where = f"{md}:{line}"
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(md), path)) if path else md
            if not os.path.exists(dest):
                bad(where, target, f"{dest} does not exist")
                continue
            page = page_of(dest, src, args.html) if dest.endswith(".md") else None
            if page is not None and os.path.basename(dest) != "SUMMARY.md" and not os.path.exists(page):
                bad(where, target, f"{dest} is not in the book ({page} was not rendered: add it to {src}/SUMMARY.md)")
                continue
            if not anchor:
                continue
            anchors += 1
            if not dest.endswith(".md"):
                bad(where, target, f"#{anchor}: {dest} is not markdown, its anchors cannot be checked")
                continue
            ids = heading_ids(dest)
            if anchor not in ids:
                near = [i for i in ids if anchor[:6] in i][:5]
                hint = f" (similar: {', '.join(near)})" if near else ""
                bad(where, target, f"#{anchor} names no heading of {dest}{hint}")
                continue
            if page is not None:
                against_html += 1
                if anchor not in html_ids(page)[0]:
                    bad(where, target, f"#{anchor}: no id=\"{anchor}\" in the rendered page {page}")

    # Every chapter is rendered, and the id rule above agrees with mdBook's on its headings.
    for root, _, names in os.walk(src):
        for name in sorted(names):
            if not name.endswith(".md") or name == "SUMMARY.md":
                continue
            chapter = os.path.join(root, name)
            page = page_of(chapter, src, args.html)
            if not os.path.exists(page):
                problems.append(f"{chapter}: not in the book: {page} was not rendered (add it to {src}/SUMMARY.md)")
                continue
            rendered = html_ids(page)[1]
            for ident in heading_ids(chapter):
                if ident not in rendered:
                    problems.append(
                        f"{chapter}: heading id {ident!r} computed by {sys.argv[0]} is not a heading id of {page} "
                        f"(it has: {', '.join(sorted(rendered))}): the checker's id rule disagrees with mdBook's")

    # In the rendered pages, every relative link must name a file that exists, the book's own
    # pages and the repository's files it links out to (hack/book.sh points those back at the
    # markdown: mdBook turns every .md link into .html).
    rendered_links = 0
    for name in sorted(os.listdir(args.html)):
        page = os.path.join(args.html, name)
        if not name.endswith(".html") or name in ("print.html", "toc.html", "404.html"):
            continue
        text = open(page, encoding="utf-8").read()
        main_part = re.search(r"<main>(.*)</main>", text, re.S)
        for href in re.findall(r'href="([^"]+)"', main_part.group(1) if main_part else text):
            href = html.unescape(href)
            if SCHEME.match(href) or href.startswith("#"):
                continue
            rendered_links += 1
            target = os.path.normpath(os.path.join(args.html, href.split("#")[0]))
            if not os.path.exists(target):
                problems.append(f"{page}: link {href}: {target} does not exist")

    if problems:
        for p in problems:
            print(p, file=sys.stderr)
        print(f"{len(problems)} broken link(s) or page(s) in {len(args.files)} file(s); fix them and rerun hack/book.sh",
              file=sys.stderr)
        return 1
    print(f"links: {counted} relative links in {len(args.files)} files exist; {anchors} anchors name headings, "
          f"{against_html} of them checked against the rendered pages too; the rendered pages' "
          f"{rendered_links} relative links exist", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
