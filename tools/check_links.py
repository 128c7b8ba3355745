"""Checks a built documentation site: every internal link and anchor resolves, and the API reference
documents every public name (run by `make docs` after `mkdocs build --strict`).

    python tools/check_links.py build/site
"""

from __future__ import annotations

import os
import sys
from html.parser import HTMLParser
from urllib.parse import unquote, urldefrag, urlparse


class _Page(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if a.get("id"):
            self.ids.add(a["id"])
        if tag == "a" and a.get("name"):
            self.ids.add(a["name"])
        for key in ("href", "src"):
            if a.get(key) and tag in ("a", "img", "link", "script"):
                self.links.append(a[key])


def _parse(path: str) -> _Page:
    page = _Page()
    with open(path, encoding="utf-8") as f:
        page.feed(f.read())
    return page


def check(site: str) -> list[str]:
    """Every broken internal link or anchor in ``site``, as 'page: link' lines."""
    pages = {}
    for root, _, files in os.walk(site):
        for name in files:
            if name.endswith(".html"):
                path = os.path.join(root, name)
                pages[os.path.normpath(path)] = _parse(path)
    problems = []
    for path, page in sorted(pages.items()):
        for link in page.links:
            url = urlparse(link)
            if url.scheme or link.startswith("//") or link.startswith("mailto:"):
                continue  # external: not checked (the build machine may be offline)
            target, frag = urldefrag(unquote(link))
            if target.startswith("/"):  # root-relative (the 404 page's links)
                dest = os.path.normpath(os.path.join(site, target.lstrip("/")))
            else:
                dest = os.path.normpath(os.path.join(os.path.dirname(path), target)) if target else path
            if os.path.isdir(dest):
                dest = os.path.join(dest, "index.html")
            if not os.path.exists(dest):
                problems.append(f"{os.path.relpath(path, site)}: {link} (no such file)")
            elif frag and dest.endswith(".html") and frag not in pages[os.path.normpath(dest)].ids:
                problems.append(f"{os.path.relpath(path, site)}: {link} (no such anchor)")
    return problems


def missing_api(site: str) -> list[str]:
    """Names in ``shardpoint.__all__`` that the generated API reference does not document."""
    import shardpoint

    ids = _parse(os.path.join(site, "reference", "api", "index.html")).ids
    missing = []
    for n in shardpoint.__all__:
        # documented under the package (``shardpoint.save``) or where it is defined
        # (``shardpoint.saving.async_save.async_save``, whose short name is also its module's)
        where = getattr(getattr(shardpoint, n), "__module__", None)
        if f"shardpoint.{n}" not in ids and f"{where}.{n}" not in ids:
            missing.append(n)
    return missing


def main() -> int:
    site = sys.argv[1] if len(sys.argv) > 1 else "build/site"
    problems = check(site)
    missing = missing_api(site)
    for p in problems:
        print(f"broken link: {p}")
    for n in missing:
        print(f"not in the API reference: shardpoint.{n}")
    n_pages = sum(1 for _, _, fs in os.walk(site) for f in fs if f.endswith(".html"))
    print(f"checked {n_pages} pages: {len(problems)} broken link(s), {len(missing)} undocumented public name(s)")
    return 1 if problems or missing else 0


if __name__ == "__main__":
    sys.exit(main())
