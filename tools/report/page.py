"""The run report as one self-contained HTML page: the report's markdown rendered by markdown-it-py
(CommonMark + tables), the PNG charts embedded as data URIs, the SVG plots inlined, and a style that reads
well on a screen and prints.

Raw HTML in the markdown is shown as text, escaped exactly once by the renderer, except the report's own
collapsed blocks: a line `<details><summary>TEXT</summary>` (TEXT without markup) and a line `</details>`.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

DETAILS_OPEN = re.compile(r"<details><summary>([^<>]*)</summary>")

STYLE = """
:root { color-scheme: light; --ink: #1d232a; --muted: #5b6570; --rule: #d5dbe1; --band: #f4f6f8; --accent: #1f7a4d; }
body { font: 15px/1.55 system-ui, -apple-system, "Segoe UI", Roboto, "Noto Sans", sans-serif; color: var(--ink);
       max-width: 72rem; margin: 2rem auto; padding: 0 1.5rem; }
h1 { font-size: 1.6rem; margin-bottom: .4rem; }
h2 { font-size: 1.2rem; margin-top: 2rem; padding-bottom: .25rem; border-bottom: 1px solid var(--rule); }
code { font: .9em ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; background: var(--band);
       padding: .05em .3em; border-radius: 3px; }
pre { background: var(--band); padding: .8rem 1rem; border-radius: 4px; overflow-x: auto; }
pre code { background: none; padding: 0; }
table { border-collapse: collapse; width: 100%; margin: .8rem 0; font-size: .92em; }
th, td { border: 1px solid var(--rule); padding: .35rem .55rem; text-align: left; vertical-align: top; }
th { background: var(--band); }
tbody tr:nth-child(even) { background: #fafbfc; }
td[style*="text-align:right"], th[style*="text-align:right"] { white-space: nowrap; }
td code { white-space: nowrap; }
strong { color: var(--accent); }
details { margin: .4rem 0 1rem; }
summary { cursor: pointer; color: var(--muted); }
svg { max-width: 100%; height: auto; display: block; margin: .5rem 0; }
img { max-width: 100%; height: auto; border: 1px solid var(--rule); border-radius: 4px; margin: .5rem 1rem .5rem 0; }
@media print { body { max-width: none; margin: 0; } }
"""


def escape_cell(text: str) -> str:
    """Free text (a verdict message) as markdown that renders as exactly that text: one line, no
    table breaks, and no character markdown would read as markup or an entity."""
    text = text.replace("\\", "\\\\").replace("\n", " ").replace("|", "\\|")
    for char in "`*_[]<&":
        text = text.replace(char, "\\" + char)
    return text


def render_html(markdown: str, charts: list[Path], *, title: str = "TrainBridge report") -> str:
    """The page for `markdown`; its image references to `charts` (by file name) become embedded PNGs and inline SVGs
    (the report writes the SVGs itself: tools/report/rounds_svg.py)."""
    from markdown_it import MarkdownIt

    embedded = {p.name: f"data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}" for p in charts if p.suffix == ".png"}
    inline = {p.name: p.read_text(encoding="utf-8") for p in charts if p.suffix == ".svg"}
    md = MarkdownIt("commonmark", {"html": True}).enable("table")
    default_image = md.renderer.rules["image"]  # bound to the renderer

    def image(renderer, tokens, idx, options, env):
        src = tokens[idx].attrGet("src")
        if src in inline:
            return inline[src]
        if src in embedded:
            tokens[idx].attrSet("src", embedded[src])
        return default_image(tokens, idx, options, env)

    def html_block(renderer, tokens, idx, options, env):
        content = tokens[idx].content
        if content.strip() == "</details>":
            return "</details>\n"
        opened = DETAILS_OPEN.fullmatch(content.strip())
        if opened:
            return f"<details><summary>{html.escape(html.unescape(opened.group(1)))}</summary>\n"
        return f"<p>{html.escape(content)}</p>\n"

    def html_inline(renderer, tokens, idx, options, env):
        return html.escape(tokens[idx].content)

    md.add_render_rule("image", image)
    md.add_render_rule("html_block", html_block)
    md.add_render_rule("html_inline", html_inline)
    body = md.render(markdown)
    return ("<!doctype html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">\n"
            f"<title>{html.escape(title)}</title>\n<style>{STYLE}</style>\n</head>\n<body>\n{body}</body>\n</html>\n")
