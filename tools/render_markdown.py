"""Render Markdown pages to HTML roughly as GitHub shows them, to look at in a browser:

    python tools/render_markdown.py OUT_DIR README.md docs/diffs/*.guided.md

CommonMark with tables (markdown-it-py, in requirements-dev.txt), GitHub's heading anchors, and
```diff blocks coloured line by line as GitHub colours them. tools/screenshot_pages.sh runs it.
"""
import html
import re
import sys
from pathlib import Path

from markdown_it import MarkdownIt

STYLE = """
body {font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; max-width: 1012px;
      margin: 1.5em auto; padding: 0 2em; color: #1f2328; font-size: 16px; line-height: 1.5}
h1, h2 {border-bottom: 1px solid #d1d9e0; padding-bottom: .3em}
code {background: #eff1f3; padding: .2em .4em; border-radius: 6px; font-size: 85%}
pre {background: #f6f8fa; padding: 16px; overflow: auto; border-radius: 6px; font-size: 85%; line-height: 1.45}
pre code {background: none; padding: 0; font-size: 100%}
table {border-collapse: collapse} td, th {border: 1px solid #d1d9e0; padding: 6px 13px}
a {color: #0969da; text-decoration: none}
.gi {color: #116329; background: #dafbe1} .gd {color: #82071e; background: #ffebe9} .gh {color: #8250df}
"""


def slug(text):
    """GitHub's anchor of a heading: lowercased, punctuation but - and _ removed, spaces to -."""
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def diff_lines(code):
    spans = []
    for line in code.rstrip("\n").split("\n"):
        cls = {"+": "gi", "-": "gd", "@": "gh"}.get(line[:1], "")
        spans.append(f'<span class="{cls}">{html.escape(line)}</span>' if cls else html.escape(line))
    return "\n".join(spans)


def render(text):
    md = MarkdownIt("commonmark").enable("table")
    tokens = md.parse(text)
    seen = {}
    for k, token in enumerate(tokens):
        if token.type == "heading_open":
            base = slug(tokens[k + 1].content.replace("`", ""))
            count = seen.get(base, 0)
            seen[base] = count + 1
            token.attrSet("id", base if count == 0 else f"{base}-{count}")
    body = md.renderer.render(tokens, md.options, {})
    body = re.sub(r'<pre><code class="language-diff">(.*?)</code></pre>',
                  lambda m: '<pre><code class="language-diff">' + diff_lines(html.unescape(m.group(1))) +
                  "</code></pre>", body, flags=re.S)
    return f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><style>{STYLE}</style></head><body>\n{body}</body></html>\n"


def main(argv):
    out_dir = Path(argv[0])
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in argv[1:]:
        target = out_dir / (Path(name).name.removesuffix(".md") + ".md.html")
        target.write_text(render(Path(name).read_text()))
        print(target)


if __name__ == "__main__":
    main(sys.argv[1:])
