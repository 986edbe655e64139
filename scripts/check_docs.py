"""Checks the built book and the front page: every internal link resolves
(the page exists, and so does the anchor), and the shipped config schema
accepts the example configs and refuses broken ones. Run by
scripts/check-docs after mdBook built the book into target/book."""

import copy
import json
import re
import sys
import tomllib
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import jsonschema

REPO = Path(__file__).resolve().parent.parent
BOOK = REPO / "target" / "book"
SOURCE = REPO / "docs" / "book" / "src"
# Pages mdBook writes for itself (navigation, search, print view).
GENERATED = {"print.html", "toc.html", "404.html"}


class Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.links = set(), []

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if attrs.get("id"):
            self.ids.add(attrs["id"])
        if tag == "a" and attrs.get("href"):
            self.links.append(attrs["href"])


def parse(path, cache={}):
    if path not in cache:
        page = Page()
        page.feed(path.read_text(errors="replace"))
        cache[path] = page
    return cache[path]


def broken_link(base, href):
    """Why `href`, on a page in directory `base`, does not resolve (None: it does)."""
    parts = urlsplit(href)
    if parts.scheme or parts.netloc or href.startswith("mailto:"):
        return None  # outside the book: not checked (no network in CI)
    target = (base / unquote(parts.path)).resolve() if parts.path else None
    if target is not None:
        if target.is_dir():
            target = target / "index.html"
        if not target.exists():
            return f"{parts.path}: no such file"
    if parts.fragment and (target is None or target.suffix == ".html"):
        return None if unquote(parts.fragment) in parse(target).ids else f"#{parts.fragment}: no such anchor"
    return None


def check_book():
    problems = []
    pages = [p for p in BOOK.rglob("*.html") if p.name not in GENERATED]
    for page in pages:
        for href in parse(page).links:
            why = broken_link(page.parent, href) if not href.startswith("#") else broken_link(page.parent, page.name + href)
            if why:
                problems.append(f"{page.relative_to(BOOK)}: link {href}: {why}")
    # Every chapter's source is in the summary (mdBook builds only those).
    summary = (SOURCE / "SUMMARY.md").read_text()
    for md in SOURCE.glob("*.md"):
        if md.name != "SUMMARY.md" and f"({md.name})" not in summary:
            problems.append(f"docs/book/src/{md.name}: not in SUMMARY.md, so not in the book")
    return problems, len(pages)


def check_front_page():
    """README.md's relative links: the file exists; a link into the book's
    sources has its anchor in the built page."""
    problems = []
    text = (REPO / "README.md").read_text()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for href in re.findall(r"\]\(([^)\s]+)\)", text):
        parts = urlsplit(href)
        if parts.scheme:
            continue
        target = REPO / parts.path
        if not target.exists():
            problems.append(f"README.md: link {href}: no such file")
            continue
        if parts.fragment and target.is_relative_to(SOURCE) and target.suffix == ".md":
            built = BOOK / target.relative_to(SOURCE).with_suffix(".html")
            if parts.fragment not in parse(built).ids:
                problems.append(f"README.md: link {href}: no such anchor in the book")
    lines = (REPO / "README.md").read_text().count("\n")
    if lines > 250:
        problems.append(f"README.md: {lines} lines; the front page stays within 250 (the rest belongs in the book)")
    return problems


def check_config_schema():
    """The shipped schema accepts every example config and the defaults, and
    refuses what the loader refuses."""
    schema = json.loads((SOURCE / "config.schema.json").read_text())
    validator = jsonschema.Draft7Validator(schema)
    problems = []
    configs = sorted((REPO / "configs").glob("*.toml"))
    for path in configs:
        for e in validator.iter_errors(tomllib.loads(path.read_text())):
            problems.append(f"{path.relative_to(REPO)}: {'.'.join(map(str, e.absolute_path))}: {e.message}")
    base = tomllib.loads((REPO / "configs" / "dlrm.toml").read_text())

    def mutated(change):
        config = copy.deepcopy(base)
        change(config)
        return config

    refused = {
        "a misspelt key (model.hiden)": mutated(lambda c: c.setdefault("model", {}).update({"hiden": [64]})),
        "an unknown table ([trian])": mutated(lambda c: c.update({"trian": {"epochs": 1}})),
        "a value outside an enum (model.kind = xgboost)": mutated(lambda c: c.setdefault("model", {}).update({"kind": "xgboost"})),
        "a wrong type (train.batch_size = \"big\")": mutated(lambda c: c.setdefault("train", {}).update({"batch_size": "big"})),
        "a negative count (train.epochs = -1)": mutated(lambda c: c.setdefault("train", {}).update({"epochs": -1})),
    }
    for what, config in refused.items():
        if validator.is_valid(config):
            problems.append(f"config.schema.json accepts {what}")
    return problems, len(configs), len(refused)


def main():
    book, pages = check_book()
    front = check_front_page()
    schema, configs, refused = check_config_schema()
    problems = book + front + schema
    for p in problems:
        print(p)
    if problems:
        sys.exit(1)
    print(f"docs: {pages} pages, every internal link resolves; README.md's links resolve; "
          f"config.schema.json accepts {configs} example configs and refuses {refused} broken ones")


if __name__ == "__main__":
    main()
