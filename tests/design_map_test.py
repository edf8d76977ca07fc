#!/usr/bin/env python3
"""The docs follow the tree (issue 44, item 5). Plain python3, no torch; CTest `design_map`.

Checks, from the repository root given as argv[1] (default: this file's parent's parent):
  1. every path docs/DESIGN.md names as a repository file (in backticks, with a "/" and an
     extension) exists;
  2. every .cpp and .h under core/ is named in docs/DESIGN.md (its full path, in backticks);
  3. every docs/*.md page is linked from README.md;
  4. README.md has at most 250 lines;
  5. every relative link in README.md and docs/*.md points at an existing file, and a link
     to a heading of a Markdown page (page.md#anchor) at a heading that page has, with
     GitHub's anchors (lower case, punctuation but "-" and "_" dropped, spaces to "-",
     "-1", "-2"... for repeats).
Prints each problem on a line of its own and exits 1 when there is any, else prints a summary
and exits 0.
"""
import pathlib
import re
import sys

README_MAX_LINES = 250

CODE_SPAN = re.compile(r"`([^`\n]+)`")
# A repository file: a relative path with at least one "/" and an extension, nothing else
# (no spaces, braces, globs or placeholders).
REPO_FILE = re.compile(r"^[A-Za-z0-9_.\-]+(?:/[A-Za-z0-9_.\-]+)+\.[A-Za-z0-9]+$")
# [text](target) and ![alt](target); a target ends at the first space or ")".
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")


def outside_fences(text):
    """The lines of a Markdown text that are not inside fenced code blocks."""
    inside = False
    for line in text.split("\n"):
        if FENCE.match(line):
            inside = not inside
            continue
        if not inside:
            yield line


def slug(heading):
    """GitHub's anchor for a heading: inline code marks and punctuation dropped, but - and _."""
    text = heading.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text):
    seen = {}
    out = set()
    for line in outside_fences(text):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        out.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return out


def check(root):
    problems = []
    design_path = root / "docs" / "DESIGN.md"
    readme_path = root / "README.md"
    design = design_path.read_text(encoding="utf-8")
    readme = readme_path.read_text(encoding="utf-8")

    # 1. Every repository file DESIGN.md names exists.
    named = set()
    for span in CODE_SPAN.findall(design):
        if REPO_FILE.match(span):
            named.add(span)
            if not (root / span).is_file():
                problems.append(f"docs/DESIGN.md names `{span}`, which is not a file of the repository")

    # 2. Every core source file is named in DESIGN.md.
    core_files = sorted(
        str(p.relative_to(root)) for p in (root / "core").rglob("*") if p.suffix in (".cpp", ".h") and p.is_file()
    )
    for f in core_files:
        if f not in named:
            problems.append(f"{f} is not named in docs/DESIGN.md: add it to the file list (a line on what it holds)")

    # 3. Every docs page is linked from the README.
    readme_targets = {t.split("#", 1)[0] for t in LINK.findall("\n".join(outside_fences(readme)))}
    pages = sorted(p for p in (root / "docs").glob("*.md"))
    for page in pages:
        rel = str(page.relative_to(root))
        if rel not in readme_targets:
            problems.append(f"README.md does not link {rel}: add it to the docs map")

    # 4. The README stays short.
    lines = readme.count("\n") + (0 if readme.endswith("\n") else 1)
    if lines > README_MAX_LINES:
        problems.append(f"README.md has {lines} lines, more than {README_MAX_LINES}: move reference text into docs/")

    # 5. Relative links (and their anchors) resolve.
    anchor_cache = {}
    for doc in [readme_path] + pages:
        text = doc.read_text(encoding="utf-8")
        for target in LINK.findall("\n".join(outside_fences(text))):
            if re.match(r"^[a-z][a-z0-9+.\-]*:", target):  # http:, https:, mailto: ...
                continue
            path_part, _, anchor = target.partition("#")
            dest = doc if path_part == "" else (doc.parent / path_part).resolve()
            where = doc.relative_to(root)
            if not dest.exists():
                problems.append(f"{where}: link ({target}) points at {path_part}, which does not exist")
                continue
            if anchor and dest.suffix == ".md":
                if dest not in anchor_cache:
                    anchor_cache[dest] = anchors(dest.read_text(encoding="utf-8"))
                if anchor not in anchor_cache[dest]:
                    problems.append(f"{where}: link ({target}) names #{anchor}, which is no heading of {dest.name}")
    return problems, len(named), len(core_files), len(pages), lines


def main():
    root = pathlib.Path(sys.argv[1] if len(sys.argv) > 1 else pathlib.Path(__file__).resolve().parent.parent).resolve()
    problems, named, core_files, pages, lines = check(root)
    for p in problems:
        print(f"design_map: {p}")
    if problems:
        print(f"design_map: {len(problems)} problem(s)")
        return 1
    print(f"design_map: ok: DESIGN.md names {named} files, all present, covering all {core_files} core sources; "
          f"README.md ({lines} lines) links all {pages} docs pages; every relative link resolves")
    return 0


if __name__ == "__main__":
    sys.exit(main())
