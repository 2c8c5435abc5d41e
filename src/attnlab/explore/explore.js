(function (rootId) {
  "use strict";
  // attnlab explorer: decodes the maps stored in the page and draws them. No network, no
  // library: vanilla JS, canvas, the browser's own DecompressionStream.
  const here = document.currentScript;
  const root = (here && here.previousElementSibling && here.previousElementSibling.id === rootId)
    ? here.previousElementSibling : document.getElementById(rootId);
  const spec = JSON.parse(root.querySelector("script.axp-data").textContent);
  const LEVELS = { 8: 254, 16: 65534 };
  const THUMB = 44;
  const ROW_H = 16;
  const state = { group: 0, panels: [null, null], pinned: [null, null], stat: "entropy" };
  let groups = [];

  function el(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function bytesOf(b64) {
    const bin = atob(b64);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  async function inflate(b64) {
    const stream = new Blob([bytesOf(b64)]).stream().pipeThrough(new DecompressionStream("deflate"));
    return new Response(stream).arrayBuffer();
  }

  async function decode(g) {
    const buffer = await inflate(g.data);
    const codes = g.bits === 8 ? new Uint8Array(buffer) : new Uint16Array(buffer);
    const q = g.queries.length, k = g.keys.length;
    return Object.assign({}, g, { codes: codes, q: q, k: k, top: LEVELS[g.bits], data: null });
  }

  // the value of cell (query i, key j) of map (l, h), or null where masked
  function value(g, l, h, i, j) {
    const m = l * g.heads + h;
    const code = g.codes[(m * g.q + i) * g.k + j];
    if (code > g.top) return null;
    return g.lo[m] + code * ((g.hi[m] - g.lo[m]) / g.top);
  }

  function halfStep(g, m) { return (g.hi[m] - g.lo[m]) / (2 * g.top); }

  // one decimal past the step, so that rounding for display adds at most a twentieth of it
  function decimals(half) {
    if (!(half > 0)) return 4;
    return Math.max(2, Math.min(9, Math.ceil(-Math.log10(half)) + 1));
  }

  // what a shown value is within: half a step, plus the display's rounding
  function shownPrecision(g, m) {
    const half = halfStep(g, m);
    return half + 0.5 * Math.pow(10, -decimals(half));
  }

  function fmt(g, m, v) { return v === null ? "masked" : v.toFixed(decimals(halfStep(g, m))); }

  // Blues: 0 -> near white, 1 -> dark blue
  function colour(t) {
    t = Math.max(0, Math.min(1, t));
    return [247 - 239 * t, 251 - 203 * t, 255 - 148 * t];
  }

  // share of a map's range: weights from 0, scores from their lowest
  function shade(g, m, v) {
    const span = g.hi[m] - g.lo[m];
    return span > 0 ? (v - g.lo[m]) / span : 0;
  }

  // paint map (l, h) into an ImageData, cell px per cell; a block of cells shrinks to its
  // largest value where the map is larger than the image (thumbnails)
  function paint(ctx, g, l, h, rows, cols, cell, hatch) {
    const m = l * g.heads + h;
    const img = ctx.createImageData(cols * cell, rows * cell);
    const px = img.data, width = cols * cell;
    for (let r = 0; r < rows; r++) {
      const i0 = Math.floor(r * g.q / rows), i1 = Math.max(i0 + 1, Math.floor((r + 1) * g.q / rows));
      for (let c = 0; c < cols; c++) {
        const j0 = Math.floor(c * g.k / cols), j1 = Math.max(j0 + 1, Math.floor((c + 1) * g.k / cols));
        let best = null;
        for (let i = i0; i < i1; i++) for (let j = j0; j < j1; j++) {
          const v = value(g, l, h, i, j);
          if (v !== null && (best === null || v > best)) best = v;
        }
        const rgb = best === null ? null : colour(shade(g, m, best));
        for (let y = r * cell; y < (r + 1) * cell; y++) for (let x = c * cell; x < (c + 1) * cell; x++) {
          const o = (y * width + x) * 4;
          if (rgb === null) {  // masked: grey (hatched), never the colour of a zero
            const dark = hatch && (x + y) % 4 < 2;
            px[o] = px[o + 1] = px[o + 2] = dark ? 170 : (hatch ? 232 : 200);
          } else { px[o] = rgb[0]; px[o + 1] = rgb[1]; px[o + 2] = rgb[2]; }
          px[o + 3] = 255;
        }
      }
    }
    ctx.putImageData(img, 0, 0);
  }

  // a shortened token's text for its tooltip (the page draws at most 24 characters)
  function tipOf(tips, i) {
    const text = tips && tips[String(i)];
    return text === undefined ? "" : ": \u201c" + text + "\u201d";
  }

  function mapName(gi, l, h) {
    const g = groups[gi];
    return g.name + " \u00b7 " + g.layers[l] + " \u00b7 head " + h;
  }

  function statText(g, m) {
    if (!g.stats) return "";
    const s = g.stats[m];
    return "entropy " + s.entropy.toFixed(3) + " nats \u00b7 mean distance " +
      s.distance.toFixed(2) + " tokens \u00b7 first token " + s.first.toFixed(3);
  }

  function buildShell() {
    root.textContent = "";
    root.appendChild(el("h2", "axp-title", spec.title));
    const notes = el("ul", "axp-notes");
    spec.notes.forEach(function (n) { notes.appendChild(el("li", "", n)); });
    spec.cuts.forEach(function (n) { notes.appendChild(el("li", "axp-cut", n)); });
    root.appendChild(notes);
    const tabs = el("div", "axp-tabs");
    groups.forEach(function (g, gi) {
      const b = el("button", "", g.name + " (" + g.layers.length + "\u00d7" + g.heads + ")");
      b.type = "button";
      b.dataset.group = gi;
      b.addEventListener("click", function () { showGroup(gi); });
      tabs.appendChild(b);
    });
    root.appendChild(tabs);
    root.appendChild(el("div", "axp-gridwrap"));
    const bar = el("div", "axp-bar");
    const statLabel = el("label", "", "statistic table: ");
    const statSel = el("select", "axp-statsel");
    [["entropy", "entropy"], ["distance", "mean distance"], ["first", "share on first token"]]
      .forEach(function (o) { const op = el("option", "", o[1]); op.value = o[0]; statSel.appendChild(op); });
    statSel.addEventListener("change", function () { state.stat = statSel.value; drawStats(); });
    statLabel.appendChild(statSel);
    bar.appendChild(statLabel);
    const cmpLabel = el("label", "", "compare with: ");
    const cmp = el("select", "axp-compare");
    cmp.appendChild(Object.assign(el("option", "", "(nothing)"), { value: "" }));
    groups.forEach(function (g, gi) {
      for (let l = 0; l < g.layers.length; l++) for (let h = 0; h < g.heads; h++) {
        const op = el("option", "", mapName(gi, l, h));
        op.value = gi + "/" + l + "/" + h;
        cmp.appendChild(op);
      }
    });
    cmp.addEventListener("change", function () {
      if (!cmp.value) { select(1, null); return; }
      const p = cmp.value.split("/").map(Number);
      select(1, { g: p[0], l: p[1], h: p[2] });
    });
    cmpLabel.appendChild(cmp);
    bar.appendChild(cmpLabel);
    bar.appendChild(el("span", "axp-legend",
      "click a thumbnail to open it, shift-click to compare; hover a query token for its row, click to pin it"));
    root.appendChild(bar);
    root.appendChild(el("div", "axp-statswrap"));
    const details = el("div", "axp-details");
    [0, 1].forEach(function (p) {
      const d = el("div", "axp-detail");
      d.dataset.panel = p;
      d.hidden = true;
      details.appendChild(d);
    });
    root.appendChild(details);
  }

  function showGroup(gi) {
    state.group = gi;
    root.querySelectorAll(".axp-tabs button").forEach(function (b) {
      b.classList.toggle("axp-on", Number(b.dataset.group) === gi);
    });
    const g = groups[gi];
    const table = el("table", "axp-grid");
    const head = el("tr");
    head.appendChild(el("th", "", ""));
    for (let h = 0; h < g.heads; h++) head.appendChild(el("th", "", "head " + h));
    table.appendChild(head);
    for (let l = 0; l < g.layers.length; l++) {
      const tr = el("tr");
      tr.appendChild(el("th", "", g.layers[l]));
      for (let h = 0; h < g.heads; h++) {
        const td = el("td");
        const c = el("canvas", "axp-thumb");
        const rows = Math.min(g.q, THUMB), cols = Math.min(g.k, THUMB);
        c.width = cols; c.height = rows;
        c.dataset.layer = l; c.dataset.head = h;
        c.title = mapName(gi, l, h) + (g.stats ? "\n" + statText(g, l * g.heads + h) : "");
        paint(c.getContext("2d"), g, l, h, rows, cols, 1, false);
        c.addEventListener("click", function (ev) {
          const p = ev.shiftKey ? 1 : 0;
          select(p, { g: gi, l: l, h: h });
          root.querySelector('.axp-detail[data-panel="' + p + '"]').scrollIntoView({ block: "nearest" });
        });
        td.appendChild(c);
        tr.appendChild(td);
      }
      table.appendChild(tr);
    }
    const wrap = root.querySelector(".axp-gridwrap");
    wrap.textContent = "";
    wrap.appendChild(table);
    drawStats();
    markThumbs();
  }

  function drawStats() {
    const g = groups[state.group];
    const wrap = root.querySelector(".axp-statswrap");
    wrap.textContent = "";
    if (!g.stats) {
      wrap.appendChild(el("div", "axp-legend", "scores, not weights: no per-head statistics"));
      return;
    }
    const table = el("table", "axp-stats");
    const top = el("tr");
    top.appendChild(el("th", "", state.stat));
    for (let h = 0; h < g.heads; h++) top.appendChild(el("th", "", "head " + h));
    table.appendChild(top);
    let most = 0;
    g.stats.forEach(function (s) { most = Math.max(most, s[state.stat]); });
    for (let l = 0; l < g.layers.length; l++) {
      const tr = el("tr");
      tr.appendChild(el("th", "", g.layers[l]));
      for (let h = 0; h < g.heads; h++) {
        const s = g.stats[l * g.heads + h][state.stat];
        const td = el("td", "", s.toFixed(state.stat === "distance" ? 2 : 3));
        const rgb = colour(most > 0 ? 0.6 * s / most : 0);
        td.style.background = "rgb(" + rgb.join(",") + ")";
        td.addEventListener("click", function () { select(0, { g: state.group, l: l, h: h }); });
        tr.appendChild(td);
      }
      table.appendChild(tr);
    }
    wrap.appendChild(table);
  }

  function markThumbs() {
    root.querySelectorAll("canvas.axp-thumb").forEach(function (c) {
      [0, 1].forEach(function (p) {
        const s = state.panels[p];
        const on = s && s.g === state.group && s.l === Number(c.dataset.layer) && s.h === Number(c.dataset.head);
        c.classList.toggle(p === 0 ? "axp-a" : "axp-b", Boolean(on));
      });
    });
  }

  function select(p, sel) {
    state.panels[p] = sel;
    state.pinned[p] = null;
    const panel = root.querySelector('.axp-detail[data-panel="' + p + '"]');
    if (p === 1) root.querySelector("select.axp-compare").value = sel ? sel.g + "/" + sel.l + "/" + sel.h : "";
    panel.hidden = !sel;
    if (sel) drawDetail(panel, p, sel);
    markThumbs();
  }

  function drawDetail(panel, p, sel) {
    const g = groups[sel.g], m = sel.l * g.heads + sel.h;
    panel.textContent = "";
    panel.dataset.group = sel.g; panel.dataset.layer = sel.l; panel.dataset.head = sel.h;
    panel.appendChild(el("h3", "axp-detail-title", mapName(sel.g, sel.l, sel.h)));
    panel.appendChild(el("div", "axp-summary",
      (g.stats ? statText(g, m) + " \u00b7 " : "") + "range " + fmt(g, m, g.lo[m]) + " to " +
      fmt(g, m, g.hi[m]) + " \u00b7 stored in " + g.bits + " bits, shown to \u00b1" +
      shownPrecision(g, m).toPrecision(2)));
    const views = el("div", "axp-views");
    const hv = el("div", "axp-headview");
    const heat = el("div", "axp-heatwrap");
    views.appendChild(hv); views.appendChild(heat);
    panel.appendChild(views);
    const row = el("div", "axp-row");
    panel.appendChild(row);
    const view = { g: g, m: m, sel: sel, p: p, hv: hv, row: row };
    buildHeadView(view);
    buildHeatmap(view, heat);
    focusRow(view, null);
  }

  function buildHeadView(view) {
    const g = view.g, n = Math.max(g.q, g.k);
    view.hv.style.height = (n * ROW_H + 4) + "px";
    const c = el("canvas");
    c.width = 84; c.height = n * ROW_H;
    view.hv.appendChild(c);
    view.lines = c.getContext("2d");
    view.qTok = []; view.kTok = [];
    g.queries.forEach(function (t, i) {
      const d = el("div", "axp-tok axp-q", t);
      d.style.top = (i * ROW_H) + "px";
      d.dataset.q = i;
      d.title = "query " + i + tipOf(g.query_tips, i);
      d.addEventListener("mouseenter", function () { if (state.pinned[view.p] === null) focusRow(view, i); });
      d.addEventListener("click", function () {
        state.pinned[view.p] = state.pinned[view.p] === i ? null : i;
        focusRow(view, i);
      });
      view.hv.appendChild(d);
      view.qTok.push(d);
    });
    g.keys.forEach(function (t, j) {
      const d = el("div", "axp-tok axp-k", t);
      d.style.top = (j * ROW_H) + "px";
      d.dataset.k = j;
      d.title = "key " + j + tipOf(g.key_tips, j);
      view.hv.appendChild(d);
      view.kTok.push(d);
    });
    view.hv.addEventListener("mouseleave", function () { if (state.pinned[view.p] === null) focusRow(view, null); });
  }

  // lines from query i to every key, opacity and width following the weight relative to
  // the row's largest; with no focused row, every row's lines, fainter (on a large map,
  // only each row's strongest line, so that drawing stays quick)
  function drawLines(view, focus) {
    const g = view.g, ctx = view.lines, sel = view.sel;
    ctx.clearRect(0, 0, ctx.canvas.width, ctx.canvas.height);
    const rows = focus === null ? [...Array(g.q).keys()] : [focus];
    ctx.strokeStyle = "#283593";
    rows.forEach(function (i) {
      let most = 0;
      for (let j = 0; j < g.k; j++) {
        const v = value(g, sel.l, sel.h, i, j);
        if (v !== null) most = Math.max(most, shade(g, view.m, v));
      }
      if (!(most > 0)) return;
      for (let j = 0; j < g.k; j++) {
        const v = value(g, sel.l, sel.h, i, j);
        if (v === null) continue;
        const t = shade(g, view.m, v) / most;
        if (t < (focus === null && g.q * g.k > 4096 ? 1 : 0.02)) continue;
        ctx.globalAlpha = focus === null ? 0.5 * t : t;
        ctx.lineWidth = focus === null ? 0.5 + t : 0.5 + 2.5 * t;
        ctx.beginPath();
        ctx.moveTo(0, i * ROW_H + ROW_H / 2);
        ctx.lineTo(ctx.canvas.width, j * ROW_H + ROW_H / 2);
        ctx.stroke();
      }
    });
    ctx.globalAlpha = 1;
  }

  function focusRow(view, i) {
    const g = view.g, sel = view.sel, pinned = state.pinned[view.p];
    view.focus = i;
    drawLines(view, i);
    view.qTok.forEach(function (d, q) {
      d.classList.toggle("axp-focus", q === i);
      d.classList.toggle("axp-pinned", q === pinned);
    });
    view.kTok.forEach(function (d, j) {
      d.classList.toggle("axp-masked", i !== null && value(g, sel.l, sel.h, i, j) === null);
    });
    const row = view.row;
    row.textContent = "";
    row.dataset.query = i === null ? "" : i;
    if (i === null) {
      row.appendChild(el("div", "axp-legend", "hover a query token (left) for its row"));
      return;
    }
    row.appendChild(el("div", "axp-legend",
      "row of query " + i + " \u201c" + g.queries[i] + "\u201d" + (pinned === i ? " (pinned)" : "") + ":"));
    for (let j = 0; j < g.k; j++) {
      const v = value(g, sel.l, sel.h, i, j);
      const cell = el("span", "axp-cell" + (v === null ? " axp-masked" : ""), g.keys[j] + " " + fmt(g, view.m, v));
      cell.dataset.key = j;
      cell.dataset.value = v === null ? "masked" : fmt(g, view.m, v);
      row.appendChild(cell);
    }
  }

  function buildHeatmap(view, wrap) {
    const g = view.g, sel = view.sel;
    const cell = Math.max(1, Math.min(40, Math.floor(512 / Math.max(g.q, g.k))));
    const c = el("canvas", "axp-heat");
    c.width = g.k * cell; c.height = g.q * cell;
    paint(c.getContext("2d"), g, sel.l, sel.h, g.q, g.k, cell, true);
    wrap.appendChild(c);
    const tip = el("div", "axp-tip", "hover a cell for its exact value");
    wrap.appendChild(tip);
    const legend = el("div", "axp-legend");
    legend.appendChild(el("span", "axp-swatch axp-hatch"));
    legend.appendChild(document.createTextNode(" masked (no value)   "));
    const zero = el("span", "axp-swatch");
    zero.style.background = "rgb(" + colour(0).join(",") + ")";
    legend.appendChild(zero);
    legend.appendChild(document.createTextNode(" " + fmt(g, view.m, g.lo[view.m]) + "   "));
    const full = el("span", "axp-swatch");
    full.style.background = "rgb(" + colour(1).join(",") + ")";
    legend.appendChild(full);
    legend.appendChild(document.createTextNode(" " + fmt(g, view.m, g.hi[view.m])));
    wrap.appendChild(legend);
    c.addEventListener("mousemove", function (ev) {
      const box = c.getBoundingClientRect();
      const i = Math.floor((ev.clientY - box.top) * g.q / box.height);
      const j = Math.floor((ev.clientX - box.left) * g.k / box.width);
      if (i < 0 || j < 0 || i >= g.q || j >= g.k) return;
      const v = value(g, sel.l, sel.h, i, j);
      tip.dataset.q = i; tip.dataset.k = j;
      tip.dataset.value = v === null ? "masked" : fmt(g, view.m, v);
      tip.textContent = "query " + i + " \u201c" + g.queries[i] + "\u201d \u2192 key " + j + " \u201c" +
        g.keys[j] + "\u201d: " + (v === null ? "masked" : fmt(g, view.m, v) + " (\u00b1" +
        shownPrecision(g, view.m).toPrecision(2) + ")");
      if (state.pinned[view.p] === null && view.focus !== i) focusRow(view, i);
    });
  }

  async function start() {
    try {
      groups = await Promise.all(spec.groups.map(decode));
      buildShell();
      showGroup(0);
      select(0, { g: 0, l: 0, h: 0 });
      root.dataset.readyMs = performance.now().toFixed(0);
      root.dataset.ready = "1";
    } catch (err) {
      root.appendChild(el("div", "axp-error", "attnlab explorer could not draw this page: " + err));
      root.dataset.ready = "error";
      throw err;
    }
  }

  start();
})(__ROOT_ID__);
