"""The live page at `/gateway/`: weights, gates, error rates, latency per backend, recent divergences.

The first render is done on the server (so the page shows the figures without JavaScript); a
small script then re-reads `/gateway/status` every second and redraws the same elements.
"""

from __future__ import annotations

import html
import json
from typing import Any

_SCRIPT = """
function fmt(v, scale, unit) { return v === null || v === undefined ? 'n/a' : (v * scale).toFixed(1) + unit; }
function draw(s) {
  const w = s.canary.weights;
  document.getElementById('weight-primary').textContent = (w.primary * 100).toFixed(1) + '%';
  document.getElementById('weight-candidate').textContent = (w.candidate * 100).toFixed(1) + '%';
  document.getElementById('rollback').textContent = s.canary.rolled_back ? 'ROLLED BACK: ' + s.canary.rollback_reason
                                                                          : 'no rollback';
  const rows = Object.entries(s.backends).map(([name, b]) => {
    const win = b.window || {};
    return '<tr><td>' + name + '</td><td>' + b.breaker.state + '</td><td>' + (win.requests || 0) + '</td><td>'
      + fmt(win.error_rate, 100, '%') + '</td><td>' + fmt(win.p95_ttft_s, 1000, ' ms') + '</td><td>'
      + fmt(win.p95_tpot_s, 1000, ' ms') + '</td></tr>';
  });
  document.getElementById('backends').innerHTML = rows.join('');
  const sh = s.shadow;
  document.getElementById('shadow').textContent = 'compared ' + sh.compared + ', diverged ' + sh.diverged
    + ', dropped ' + sh.dropped + ', in flight ' + sh.in_flight;
  document.getElementById('divergences').innerHTML = sh.recent_divergences.map(
    d => '<li>' + d.tiers.join(', ') + ' (request ' + d.request_sha256 + ')</li>').join('');
  document.getElementById('updated').textContent = 'refreshed live at ' + new Date().toISOString();
}
// NOTE: fetch() refuses a URL with credentials (a page opened as http://user:key@host/ has them);
// without them the browser sends the Basic credentials it used for this page.
const statusUrl = new URL('status', location.href);
statusUrl.username = ''; statusUrl.password = '';
async function refresh() {
  try { const r = await fetch(statusUrl); if (r.ok) draw(await r.json()); } catch (e) {}
}
refresh();
setInterval(refresh, 1000);
"""


def _pct(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 100:.1f}%"


def _ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value * 1000:.1f} ms"


def _backend_rows(status: dict[str, Any]) -> str:
    rows = []
    for name, b in status["backends"].items():
        w = b.get("window") or {}
        cells = [name, b["breaker"]["state"], str(w.get("requests", 0)), _pct(w.get("error_rate")),
                 _ms(w.get("p95_ttft_s")), _ms(w.get("p95_tpot_s"))]
        rows.append("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in cells) + "</tr>")
    return "".join(rows)


def render_status_page(status: dict[str, Any]) -> str:
    """The whole HTML page for one `Gateway.status()` document."""
    c, sh = status["canary"], status["shadow"]
    w = c["weights"]
    rollback = f"ROLLED BACK: {c['rollback_reason']}" if c["rolled_back"] else "no rollback"
    divergences = "".join(f"<li>{html.escape(', '.join(d['tiers']))} (request {d['request_sha256']})</li>"
                          for d in sh["recent_divergences"])
    gates = html.escape(json.dumps(c["gates"]))
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>tandem gateway</title>
<style>body{{font-family:sans-serif;margin:2em}} td,th{{padding:.2em .8em;border-bottom:1px solid #ccc}}</style>
</head><body>
<h1>tandem gateway</h1>
<p id="updated">rendered by the server</p>
<h2>Weights</h2>
<p>primary <b id="weight-primary">{w['primary'] * 100:.1f}%</b> &middot;
candidate <b id="weight-candidate">{w['candidate'] * 100:.1f}%</b> &middot;
step {c['step']} of {len(c['steps'])} &middot; <span id="rollback">{html.escape(rollback)}</span></p>
<h2>Gates</h2><p><code>{gates}</code></p>
<h2>Backends (last {c['gates']['window_s']:g} s)</h2>
<table><thead><tr><th>backend</th><th>breaker</th><th>requests</th><th>error rate</th><th>p95 TTFT</th>
<th>p95 TPOT</th></tr></thead><tbody id="backends">{_backend_rows(status)}</tbody></table>
<h2>Shadow</h2><p id="shadow">compared {sh['compared']}, diverged {sh['diverged']}, dropped {sh['dropped']},
in flight {sh['in_flight']}</p>
<h3>Recent divergences</h3><ul id="divergences">{divergences}</ul>
<script>{_SCRIPT}</script>
</body></html>
"""
