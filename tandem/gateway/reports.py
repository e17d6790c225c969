"""Report files of `tandem compare` and `tandem drill`: JSON (the whole document), Markdown and
HTML (the tables a reader needs)."""

from __future__ import annotations

import html
import json
import os
from typing import Any


def _cell(items: list[dict[str, str]]) -> str:
    return "; ".join(f"{d['tier']}: {d['detail']}" for d in items) or "-"


def compare_markdown(report: dict[str, Any]) -> str:
    """The Markdown page of a `tandem compare` report."""
    s = report["summary"]
    lines = [
        f"# tandem compare: A {report['a']['url']} ({report['a']['model']}) vs B {report['b']['url']} "
        f"({report['b']['model']})", "",
        f"{s['requests']} cases; diverged {s['diverged_rate']:.0%}, A vs itself (noise) {s['noise_rate']:.0%}, "
        f"beyond noise {s['diverged_beyond_noise_rate']:.0%}; {s['failed_checks']} failed checks; "
        f"{s.get('cases_not_run', 0)} cases not run on either side.", "",
        "| tier | A vs B | A vs A (noise) | beyond noise |", "|---|---|---|---|",
    ]
    for tier, r in s["tiers"].items():
        lines.append(f"| {tier} | {r['divergence_rate']:.0%} | {r['noise_rate']:.0%} | {r['beyond_noise_rate']:.0%} |")
    lines += ["", "| case | A status | B status | differences beyond noise | noise (A vs A) | failed checks |",
              "|---|---|---|---|---|---|"]
    for c in report["cases"]:
        checks = "; ".join(f"{side}: {m}" for side in ("a", "b") for m in c["failed_checks"][side]) or "-"
        if c.get("not_run"):
            checks = f"not run on either side ({c['not_run']})"
        lines.append(f"| {c['name']} | {c['a']['status']} | {c['b']['status']} | {_cell(c['diffs_beyond_noise'])} "
                     f"| {_cell(c['noise_diffs'])} | {checks} |".replace("\n", " "))
    return "\n".join(lines) + "\n"


def markdown_to_html(markdown: str, title: str) -> str:
    """A small HTML page of the Markdown this module writes (headings, paragraphs, pipe tables)."""
    out, table = [], False
    for line in markdown.splitlines():
        if line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if set("".join(cells)) <= set("-: "):
                continue
            if not table:
                out.append("<table>")
                table, tag = True, "th"
            else:
                tag = "td"
            out.append("<tr>" + "".join(f"<{tag}>{html.escape(c)}</{tag}>" for c in cells) + "</tr>")
            continue
        if table:
            out.append("</table>")
            table = False
        if line.startswith("#"):
            level = len(line) - len(line.lstrip("#"))
            out.append(f"<h{level}>{html.escape(line.lstrip('#').strip())}</h{level}>")
        elif line.strip():
            out.append(f"<p>{html.escape(line)}</p>")
    if table:
        out.append("</table>")
    style = "body{font-family:sans-serif;margin:2em} td,th{padding:.2em .6em;border-bottom:1px solid #ccc;" \
            "text-align:left;vertical-align:top}"
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
            f"<style>{style}</style></head><body>\n" + "\n".join(out) + "\n</body></html>\n")


def write_reports(report: dict[str, Any], markdown: str, output_dir: str, stem: str) -> list[str]:
    """Writes DIR/STEM.json, .md and .html; returns their paths."""
    os.makedirs(output_dir, exist_ok=True)
    paths = [os.path.join(output_dir, f"{stem}.{ext}") for ext in ("json", "md", "html")]
    with open(paths[0], "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, ensure_ascii=False)
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write(markdown)
    with open(paths[2], "w", encoding="utf-8") as f:
        f.write(markdown_to_html(markdown, f"tandem {stem}"))
    return paths
