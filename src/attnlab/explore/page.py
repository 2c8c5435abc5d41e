"""The explorer's HTML: the maps (encoding.py) and statistics (stats.py) as JSON, with the
page's script and style inline. No CDN, no network: the file works offline, from disk or
inside a notebook output.

`fragment()` is a self-contained <div> (its own id, so that several outputs of one notebook
never clash) followed by its script; `document()` wraps it into a whole HTML file.
"""

from __future__ import annotations

import html
import json
import uuid
from importlib import resources

from attnlab.explore.data import Capture
from attnlab.explore.encoding import encode_group
from attnlab.explore.stats import head_stats

LABEL_SHOWN = 24  # characters of a token's label drawn in the page (the head view fits ~15)
LABEL_TIP = 500  # characters of a shortened label kept for its tooltip


def payload(capture: Capture, bits: int) -> dict:
    """The data the page reads: title, notes, cuts and each group's stored maps.

    Args:
        capture: the maps to show.
        bits: 8 or 16 bits per stored value.

    Returns:
        A JSON-ready dict (see encoding.encode_group for each group's stored maps). Token
        labels longer than LABEL_SHOWN characters are shortened ("queries", "keys"), their
        text kept up to LABEL_TIP characters for the tooltip ("query_tips", "key_tips":
        {index: text}), so that a huge token makes no huge page.
    """
    groups = []
    for group in capture.groups:
        heads = group.shape[1]
        queries, query_tips = shown_labels(group.query_tokens)
        keys, key_tips = shown_labels(group.key_tokens)
        groups.append(
            {
                "name": group.name,
                "layers": list(group.layer_names),
                "heads": heads,
                "queries": queries,
                "keys": keys,
                "query_tips": query_tips,
                "key_tips": key_tips,
                "scores": group.scores,
                "stats": head_stats(group),
                **encode_group(group, bits),
            }
        )
    return {
        "title": capture.title,
        "notes": list(capture.notes),
        "cuts": list(capture.cuts),
        "groups": groups,
    }


def shown_labels(labels: tuple[str, ...]) -> tuple[list[str], dict[str, str]]:
    """Labels as the page draws them: each at most LABEL_SHOWN characters (cut with an
    ellipsis), and {index: its text} for those cut, for the tooltip (past LABEL_TIP
    characters, cut too, with its length).

    Args:
        labels: the tokens' full texts.

    Returns:
        (shown labels, tooltips of the shortened ones keyed by their index as a string).
    """
    shown, tips = [], {}
    for index, label in enumerate(labels):
        if len(label) <= LABEL_SHOWN:
            shown.append(label)
            continue
        shown.append(label[: LABEL_SHOWN - 1] + "\u2026")
        tips[str(index)] = (
            label
            if len(label) <= LABEL_TIP
            else f"{label[: LABEL_TIP - 1]}\u2026 ({len(label):,} characters)"
        )
    return shown, tips


def fragment(data: dict) -> str:
    """A self-contained <div> showing `data` (payload's output), with a unique id.

    Args:
        data: payload's dict.

    Returns:
        HTML: the div (holding the data as JSON) and its script, style inline.
    """
    root_id = f"axp-{uuid.uuid4().hex[:12]}"
    text = json.dumps(data, separators=(",", ":"), allow_nan=False)
    text = text.replace("<", "\\u003c")  # no "</script>" inside the data
    script = _asset("explore.js").replace("__ROOT_ID__", json.dumps(root_id))
    return (
        f"<style>{_asset('explore.css')}</style>\n"
        f'<div class="axp" id="{root_id}">'
        f'<p class="axp-loading">attnlab explorer: {html.escape(data["title"])} (drawing; '
        "this page needs JavaScript)</p>"
        f'<script type="application/json" class="axp-data">{text}</script></div>\n'
        f"<script>{script}</script>\n"
    )


def document(data: dict) -> str:
    """A whole HTML file showing `data` (payload's output).

    Args:
        data: payload's dict.

    Returns:
        The HTML document, with no external resource.
    """
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">\n'
        f"<title>{html.escape(data['title'])}</title>\n"
        '<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
        "script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data: blob:; "
        'connect-src blob:">\n'
        f"</head><body>\n{fragment(data)}</body></html>\n"
    )


def read_payload(page: str) -> list[dict]:
    """The data of every explorer in an HTML page (a file or notebook output), in order.

    Args:
        page: the HTML text.

    Returns:
        Each explorer's payload dict.
    """
    marker = '<script type="application/json" class="axp-data">'
    found = []
    for chunk in page.split(marker)[1:]:
        found.append(json.loads(chunk.split("</script>", 1)[0]))
    return found


def _asset(name: str) -> str:
    return resources.files("attnlab.explore").joinpath(name).read_text(encoding="utf-8")
