// The lens page's one renderer. With an embedded payload (vlens.viz files, `vlens lens`) it draws that;
// served by `vlens serve` at /lens it builds the same payload from the server's own API (completions with
// the `vlens` extension) and draws it. The payload's shape is documented in vlens/viz/payload.py.
"use strict";
(() => {
  const K = 5; // top-k of the served page's logit lens and SAE features
  const byId = (id) => document.getElementById(id);

  function el(tag, attrs = {}, text) {
    const e = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs)) {
      if (value !== undefined && value !== null) e.setAttribute(name, String(value));
    }
    if (text !== undefined) e.textContent = text;
    return e;
  }

  // Whitespace made visible, so " Paris" and "\n" read as what they are; any other blank or control character
  // ("\r", a no-break space) as its code point, so that no token shows as an empty box.
  const visible = (text) => text.replace(/ /g, "\u2423").replace(/\n/g, "\u21b5").replace(/\t/g, "\u21e5")
    .replace(/[\p{Cc}\p{Z}\u200b\ufeff]/gu, (c) => `\\u${c.codePointAt(0).toString(16).padStart(4, "0")}`);
  const tokenText = (p, id) => (p.texts[String(id)] === undefined ? "#" + id : visible(p.texts[String(id)]));
  const fixed = (x) => x.toFixed(2);
  const range = (n) => Array.from({ length: n }, (_, i) => i);

  // Bytes of base64 text: the payload's attention weights, the API's inline activations.
  function bytesOf(base64) {
    const text = atob(base64);
    const bytes = new Uint8Array(text.length);
    for (let i = 0; i < text.length; i++) bytes[i] = text.charCodeAt(i);
    return bytes;
  }

  // A shade for a value in [0, 1] (hsl(212, 75%, 98% .. 30%), as RGB for a canvas's pixels too), with ink that
  // stays readable on it (the value is always written too).
  function shadeRgb(x) {
    const v = Math.max(0, Math.min(1, x));
    const l = 0.98 - 0.68 * v;
    const a = 0.75 * Math.min(l, 1 - l);
    const f = (n) => {
      const k = (n + 212 / 30) % 12;
      return Math.round(255 * (l - a * Math.max(-1, Math.min(k - 3, 9 - k, 1))));
    };
    return [f(0), f(8), f(4)];
  }
  const ink = (x) => (x > 0.7 ? "#fff" : "#111");

  function shade(cell, x) {
    const [r, g, b] = shadeRgb(x);
    cell.style.background = `rgb(${r}, ${g}, ${b})`;
    cell.style.color = ink(x);
  }

  function setError(id, message) {
    byId(id).textContent = message;
  }

  function status(text) {
    const s = byId("status");
    if (s) s.textContent = text;
  }

  // Arrow keys (and Home/End) move the focus between a table's focusable cells: one tab stop per table.
  function gridKeys(table) {
    const cells = Array.from(table.querySelectorAll("td[tabindex]"));
    cells.forEach((c, i) => c.setAttribute("tabindex", i === 0 ? "0" : "-1"));
    table.addEventListener("keydown", (event) => {
      const cell = event.target.closest("td[tabindex]");
      if (!cell) return;
      const row = cell.parentElement;
      const rows = Array.from(table.querySelectorAll("tr")).filter((r) => r.querySelector("td[tabindex]"));
      const inRow = (r) => Array.from(r.querySelectorAll("td[tabindex]"));
      const col = inRow(row).indexOf(cell);
      const r = rows.indexOf(row);
      let next = null;
      if (event.key === "ArrowRight") next = inRow(row)[col + 1];
      else if (event.key === "ArrowLeft") next = inRow(row)[col - 1];
      else if (event.key === "ArrowDown" && rows[r + 1]) next = inRow(rows[r + 1])[Math.min(col, inRow(rows[r + 1]).length - 1)];
      else if (event.key === "ArrowUp" && rows[r - 1]) next = inRow(rows[r - 1])[Math.min(col, inRow(rows[r - 1]).length - 1)];
      else if (event.key === "Home") next = inRow(row)[0];
      else if (event.key === "End") next = inRow(row)[inRow(row).length - 1];
      if (!next) return;
      event.preventDefault();
      cell.setAttribute("tabindex", "-1");
      next.setAttribute("tabindex", "0");
      next.focus();
    });
  }

  function tokenHeader(p, positions, corner) {
    const tr = el("tr");
    tr.append(el("th", { scope: "col" }, corner));
    for (const pos of positions) tr.append(el("th", { scope: "col", title: `position ${pos}` }, tokenText(p, p.token_ids[pos])));
    return el("thead").appendChild(tr).parentElement;
  }

  // ---- the views ---------------------------------------------------------------------------------------

  function renderTokens(p) {
    const list = byId("tokens");
    list.replaceChildren();
    p.token_ids.forEach((id, pos) => {
      const generated = pos >= p.prompt_tokens;
      const li = el("li", { "data-pos": pos, "data-token-id": id, class: generated ? "generated" : "prompt",
        title: `position ${pos}, token id ${id}${generated ? ", generated" : ""}` }, tokenText(p, id));
      list.append(li);
    });
    byId("completion").textContent = p.completion === null ? "" : `Completion: ${p.completion}`;
    byId("model-line").textContent = p.model ? `Model: ${p.model}` : "";
    byId("tokens-section").hidden = false;
  }

  function showTopK(p, layer, row) {
    const pos = layer.positions[row];
    const box = byId("lens-detail");
    box.replaceChildren(el("p", {}, `Layer ${layer.layer} (${layer.hook}), position ${pos} (${tokenText(p, p.token_ids[pos])}): top ${layer.ids[row].length}`));
    const list = el("ol");
    layer.ids[row].forEach((id, i) => {
      const lp = layer.logprobs[row][i];
      list.append(el("li", { "data-token-id": id }, `${tokenText(p, id)}  ${Math.exp(lp).toFixed(4)}  (log-prob ${lp.toFixed(3)})`));
    });
    box.append(list);
  }

  // A lens row's name: its layer, and its hook unless the usual hook_resid_post, so that a lens read at several hooks
  // of a layer (hook_resid_pre and hook_resid_post, say) names its rows apart.
  const rowName = (layer) => `L${layer.layer}` +
    (layer.hook.endsWith(".hook_resid_post") ? "" : ` ${layer.hook.replace(/^blocks\.\d+\./, "")}`);

  function renderLens(p) {
    const table = byId("lens-table");
    table.replaceChildren();
    byId("lens-detail").replaceChildren();
    const lens = p.lens;
    byId("lens-k").textContent = String(lens.k);
    byId("lens-title").textContent = lens.tuned ? "Tuned lens" : "Logit lens";
    table.append(tokenHeader(p, lens.layers[0].positions, "layer \\ token"));
    const body = el("tbody");
    for (const layer of lens.layers) {
      const tr = el("tr");
      tr.append(el("th", { scope: "row", title: layer.hook }, rowName(layer)));
      layer.positions.forEach((pos, r) => {
        const id = layer.ids[r][0];
        const prob = Math.exp(layer.logprobs[r][0]);
        const td = el("td", { tabindex: "-1", "data-layer": layer.layer, "data-pos": pos, "data-token-id": id, "data-prob": prob,
          "aria-label": `layer ${layer.layer}, position ${pos}: ${tokenText(p, id)} ${fixed(prob)}` });
        td.append(el("span", { class: "tok" }, tokenText(p, id)), el("span", { class: "num" }, fixed(prob)));
        shade(td, prob);
        const show = () => showTopK(p, layer, r);
        td.addEventListener("mouseenter", show);
        td.addEventListener("focus", show);
        tr.append(td);
      });
      body.append(tr);
    }
    table.append(body);
    gridKeys(table);
    byId("lens-section").hidden = false;
  }

  // ---- attention: one head at a time, on a canvas ---------------------------------------------------------
  // A head has a cell per query and key: drawn as table cells, a 300-token prompt's 9 heads took Chromium 23 s
  // (and n² grows fast). So the layer's heads are thumbnails (CircuitsVis's attention-heads view) and the
  // chosen one is drawn on a canvas the size of its scroll box: only the cells in sight, again on each scroll.

  const CELL = 28; // px of a cell, which has its weight written in it (2 decimals)
  const ROW_LABELS = 120; // px left of the cells: each query's position and token
  const KEY_LABELS = 80; // px above them: each key's token, written upwards
  const THUMB = 64; // px of a head's thumbnail at most (and of its canvas, so no pixel is lost by scaling)
  const MASKED = [238, 238, 238]; // a key after its query
  const rgb = (c) => `rgb(${c[0]}, ${c[1]}, ${c[2]})`;

  // One layer's attention, the payload's layout (vlens/viz/payload.py): per head a Float32Array of its lower
  // triangle, row r (the query at positions[r]) holding keys 0..positions[r], rows one after the other.
  class Pattern {
    constructor(layer, heads, positions, weights) {
      Object.assign(this, { layer, heads, positions, weights });
      this.keys = positions.reduce((a, b) => Math.max(a, b + 1), 0);
      this.starts = []; // where each row begins in a head's array
      let start = 0;
      for (const pos of positions) {
        this.starts.push(start);
        start += pos + 1;
      }
      this.cells = start; // of a head
    }

    // A payload's entry: each head's base64 little-endian float32 (as every browser's Float32Array reads them).
    static decode(entry) {
      const weights = entry.weights.map((b) => new Float32Array(bytesOf(b).buffer));
      return new Pattern(entry.layer, entry.heads, entry.positions, weights);
    }

    // The server's hook_pattern [rows, heads, keys] (a parsed safetensors tensor): each head's triangle taken out.
    static ofRows(layer, positions, t) {
      const [, heads, width] = t.shape;
      const pattern = new Pattern(layer, range(heads), positions, []);
      pattern.weights = range(heads).map((h) => {
        const out = new Float32Array(pattern.cells);
        positions.forEach((pos, r) => {
          for (let k = 0; k <= pos; k++) out[pattern.starts[r] + k] = t.data[(r * heads + h) * width + k];
        });
        return out;
      });
      return pattern;
    }

    // Head index h's weight of query row r on key `key`; null for a key after the query (masked).
    weight(h, r, key) {
      return key <= this.positions[r] ? this.weights[h][this.starts[r] + key] : null;
    }
  }

  const patterns = new Map(); // layer -> its Pattern, for the prompt on screen (decoded or fetched once)
  const shown = { p: null, pattern: null, h: 0, cursor: null }; // what the canvas draws; cursor: [row, key]

  function renderAttention(p, pattern, head) {
    shown.p = p;
    shown.pattern = pattern;
    const rows = pattern.positions.length;
    const [width, height] = [Math.min(pattern.keys, THUMB), Math.min(rows, THUMB)];
    byId("attention-heads").replaceChildren(...pattern.heads.map((name, h) => {
      const canvas = el("canvas", { width, height, "aria-hidden": "true" });
      canvas.style.height = `${Math.max(4, Math.round((THUMB * rows) / pattern.keys))}px`;
      paintThumbnail(canvas, pattern, h);
      const button = el("button", { type: "button", "data-head": name, "aria-pressed": "false", title: `head ${name}` });
      button.append(canvas, el("span", {}, `H${name}`));
      button.addEventListener("click", () => selectHead(h));
      return button;
    }));
    const sizer = byId("attention-sizer");
    sizer.style.width = `${ROW_LABELS + pattern.keys * CELL}px`;
    sizer.style.height = `${KEY_LABELS + rows * CELL}px`;
    byId("attention-section").hidden = false;
    byId("attention-view").hidden = false;
    selectHead(pattern.heads.indexOf(head));
  }

  // Each pixel the largest weight of the cells it covers, so a thin line (the diagonal, a column on the first
  // token) survives the shrink of a long prompt.
  function paintThumbnail(canvas, pattern, h) {
    const { width, height } = canvas;
    const rows = pattern.positions.length;
    const top = new Float32Array(width * height).fill(-1); // -1: every cell under the pixel masked
    const w = pattern.weights[h];
    pattern.positions.forEach((pos, r) => {
      const line = Math.floor((r * height) / rows) * width;
      const start = pattern.starts[r];
      for (let k = 0; k <= pos; k++) {
        const i = line + Math.floor((k * width) / pattern.keys);
        if (w[start + k] > top[i]) top[i] = w[start + k];
      }
    });
    const ctx = canvas.getContext("2d");
    const image = ctx.createImageData(width, height);
    top.forEach((v, i) => image.data.set([...(v < 0 ? MASKED : shadeRgb(v)), 255], 4 * i));
    ctx.putImageData(image, 0, 0);
  }

  function selectHead(h) {
    const { pattern } = shown;
    const name = pattern.heads[h];
    shown.h = h;
    shown.cursor = null;
    byId("head").value = String(name);
    for (const button of byId("attention-heads").children) {
      button.setAttribute("aria-pressed", String(button.dataset.head === String(name)));
    }
    const canvas = byId("attention-canvas");
    canvas.dataset.layer = String(pattern.layer);
    canvas.dataset.head = String(name);
    const caption = `Layer ${pattern.layer}, head ${name}: ${pattern.positions.length} queries by ${pattern.keys} keys`;
    byId("attention-caption").textContent = caption;
    byId("attention-scroll").setAttribute("aria-label", `${caption}; arrow keys move between cells`);
    drawPattern();
    showTip();
  }

  function clearAttention() {
    shown.pattern = null;
    byId("attention-heads").replaceChildren();
    byId("attention-view").hidden = true;
    byId("attention-tip").hidden = true;
  }

  // The longest start of `text` that fits `width` px, with an ellipsis if cut.
  function fit(ctx, text, width) {
    if (ctx.measureText(text).width <= width) return text;
    let n = text.length;
    while (n > 0 && ctx.measureText(text.slice(0, n) + "\u2026").width > width) n--;
    return text.slice(0, n) + "\u2026";
  }

  // The canvas covers the scroll box's view; cell (r, k) sits at ROW_LABELS + k * CELL - scrollLeft (and likewise
  // down), with the labels of the rows and keys in sight held at the left and top.
  function drawPattern() {
    const { p, pattern, h, cursor } = shown;
    const box = byId("attention-scroll");
    const canvas = byId("attention-canvas");
    const [w, ht, dpr] = [box.clientWidth, box.clientHeight, window.devicePixelRatio || 1];
    if (canvas.width !== Math.round(w * dpr) || canvas.height !== Math.round(ht * dpr)) {
      [canvas.width, canvas.height] = [Math.round(w * dpr), Math.round(ht * dpr)];
      [canvas.style.width, canvas.style.height] = [`${w}px`, `${ht}px`];
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(dpr, 0, 0, dpr, 0, 0);
    ctx.clearRect(0, 0, w, ht);
    if (!pattern) return;
    const [x0, y0] = [box.scrollLeft, box.scrollTop];
    const k0 = Math.floor(x0 / CELL);
    const k1 = Math.min(pattern.keys, Math.ceil((x0 + w - ROW_LABELS) / CELL));
    const r0 = Math.floor(y0 / CELL);
    const r1 = Math.min(pattern.positions.length, Math.ceil((y0 + ht - KEY_LABELS) / CELL));
    const [cr, ck] = cursor || [-1, -1];
    ctx.font = "10px ui-monospace, monospace";
    ctx.textBaseline = "middle";

    ctx.save();
    ctx.beginPath();
    ctx.rect(ROW_LABELS, KEY_LABELS, w - ROW_LABELS, ht - KEY_LABELS);
    ctx.clip();
    ctx.textAlign = "center";
    for (let r = r0; r < r1; r++) {
      const y = KEY_LABELS + r * CELL - y0;
      for (let k = k0; k < k1; k++) {
        const x = ROW_LABELS + k * CELL - x0;
        const v = pattern.weight(h, r, k);
        ctx.fillStyle = rgb(v === null ? MASKED : shadeRgb(v));
        ctx.fillRect(x, y, CELL - 1, CELL - 1); // (the pixel left is the white between cells)
        if (v === null) continue;
        ctx.fillStyle = ink(v);
        ctx.fillText(fixed(v), x + CELL / 2, y + CELL / 2);
      }
    }
    if (cursor) {
      ctx.strokeStyle = "#d97706";
      ctx.lineWidth = 2;
      ctx.strokeRect(ROW_LABELS + ck * CELL - x0, KEY_LABELS + cr * CELL - y0, CELL - 1, CELL - 1);
    }
    ctx.restore();

    const label = (bold) => {
      ctx.font = `${bold ? "bold " : ""}11px ui-monospace, monospace`;
      ctx.fillStyle = bold ? "#b45309" : "#333";
    };
    ctx.save();
    ctx.beginPath();
    ctx.rect(ROW_LABELS, 0, w - ROW_LABELS, KEY_LABELS);
    ctx.clip();
    ctx.textAlign = "left";
    for (let k = k0; k < k1; k++) {
      label(k === ck);
      ctx.setTransform(dpr, 0, 0, dpr, dpr * (ROW_LABELS + k * CELL - x0 + CELL / 2), dpr * (KEY_LABELS - 4));
      ctx.rotate(-Math.PI / 2);
      ctx.fillText(fit(ctx, tokenText(p, p.token_ids[k]), KEY_LABELS - 8), 0, 0);
    }
    ctx.restore();
    ctx.save();
    ctx.beginPath();
    ctx.rect(0, KEY_LABELS, ROW_LABELS, ht - KEY_LABELS);
    ctx.clip();
    for (let r = r0; r < r1; r++) {
      const y = KEY_LABELS + r * CELL - y0 + CELL / 2;
      const pos = String(pattern.positions[r]);
      label(r === cr);
      ctx.textAlign = "left";
      ctx.fillText(pos, 2, y);
      ctx.textAlign = "right";
      const room = ROW_LABELS - 12 - ctx.measureText(pos).width;
      ctx.fillText(fit(ctx, tokenText(p, p.token_ids[pattern.positions[r]]), room), ROW_LABELS - 4, y);
    }
    ctx.restore();
    label(false);
    ctx.fillStyle = "#666";
    ctx.textAlign = "left";
    ctx.fillText("query \\ key", 2, KEY_LABELS - 8);
  }

  // The cell under the cursor, beside it: its tokens and weight, also in data-* for scripts (and the tests).
  function showTip() {
    const tip = byId("attention-tip");
    const { p, pattern, h, cursor } = shown;
    const box = byId("attention-scroll");
    if (!pattern || !cursor) return void (tip.hidden = true);
    const [r, key] = cursor;
    const x = ROW_LABELS + key * CELL - box.scrollLeft;
    const y = KEY_LABELS + r * CELL - box.scrollTop;
    const outOfSight = x < ROW_LABELS - CELL || y < KEY_LABELS - CELL || x > box.clientWidth || y > box.clientHeight;
    if (outOfSight) return void (tip.hidden = true);
    const query = pattern.positions[r];
    const v = pattern.weight(h, r, key);
    Object.assign(tip.dataset, { layer: pattern.layer, head: pattern.heads[h], query, key });
    if (v === null) delete tip.dataset.weight;
    else tip.dataset.weight = String(v);
    tip.textContent = `layer ${pattern.layer}, head ${pattern.heads[h]}\n` +
      `query ${query} ${tokenText(p, p.token_ids[query])}\nkey   ${key} ${tokenText(p, p.token_ids[key])}\n` +
      (v === null ? "masked: the key is after the query" : `weight ${v.toPrecision(4)}`);
    tip.hidden = false;
    const right = x + CELL + 6 + tip.offsetWidth <= box.clientWidth;
    const below = y + CELL + 6 + tip.offsetHeight <= box.clientHeight;
    tip.style.left = `${Math.max(0, right ? x + CELL + 6 : x - 6 - tip.offsetWidth)}px`;
    tip.style.top = `${Math.max(0, below ? y + CELL + 6 : y - 6 - tip.offsetHeight)}px`;
  }

  function moveTo(cursor) {
    shown.cursor = cursor;
    drawPattern();
    showTip();
  }

  function cellAt(event) {
    const box = byId("attention-scroll");
    const rect = box.getBoundingClientRect();
    const x = event.clientX - rect.left - box.clientLeft;
    const y = event.clientY - rect.top - box.clientTop;
    if (x < ROW_LABELS || y < KEY_LABELS || x >= box.clientWidth || y >= box.clientHeight) return null;
    const r = Math.floor((y - KEY_LABELS + box.scrollTop) / CELL);
    const key = Math.floor((x - ROW_LABELS + box.scrollLeft) / CELL);
    return r < shown.pattern.positions.length && key < shown.pattern.keys ? [r, key] : null;
  }

  // Arrow keys (Home, End; Page Up and Down by 10 rows) move between a query's keys up to itself, as in the
  // tables; the box scrolls to keep the cell in sight.
  function patternKeys(event) {
    const { pattern } = shown;
    if (!pattern) return;
    const [r, key] = shown.cursor || [0, 0];
    const moves = { ArrowRight: [r, key + 1], ArrowLeft: [r, key - 1], ArrowDown: [r + 1, key], ArrowUp: [r - 1, key],
      Home: [r, 0], End: [r, Infinity], PageDown: [r + 10, key], PageUp: [r - 10, key] };
    if (!(event.key in moves)) return;
    event.preventDefault();
    const clamp = (x, hi) => Math.max(0, Math.min(x, hi));
    const row = clamp(moves[event.key][0], pattern.positions.length - 1);
    const col = clamp(moves[event.key][1], pattern.positions[row]);
    const box = byId("attention-scroll");
    const [x, y] = [col * CELL - box.scrollLeft, row * CELL - box.scrollTop]; // (from the cells' own corner)
    if (x < 0) box.scrollLeft = col * CELL;
    else if (ROW_LABELS + x + CELL > box.clientWidth) box.scrollLeft = ROW_LABELS + (col + 1) * CELL - box.clientWidth;
    if (y < 0) box.scrollTop = row * CELL;
    else if (KEY_LABELS + y + CELL > box.clientHeight) box.scrollTop = KEY_LABELS + (row + 1) * CELL - box.clientHeight;
    moveTo([row, col]);
  }

  function patternEvents() {
    const box = byId("attention-scroll");
    // Where the cells are, for scripts that point at one: cell (r, k) at left + k * cell - scrollLeft, likewise down.
    Object.assign(box.dataset, { cell: CELL, left: ROW_LABELS, top: KEY_LABELS });
    let frame = 0;
    const redraw = () => {
      if (!frame) frame = requestAnimationFrame(() => { frame = 0; drawPattern(); showTip(); });
    };
    box.addEventListener("scroll", redraw);
    new ResizeObserver(redraw).observe(box);
    box.addEventListener("mousemove", (event) => {
      const cell = shown.pattern && cellAt(event);
      if (cell && shown.cursor && cell[0] === shown.cursor[0] && cell[1] === shown.cursor[1]) return;
      if (cell || document.activeElement !== box) moveTo(cell);
    });
    box.addEventListener("mouseleave", () => { if (document.activeElement !== box) moveTo(null); });
    box.addEventListener("focus", () => { if (shown.pattern && !shown.cursor) moveTo([0, 0]); });
    box.addEventListener("keydown", patternKeys);
  }

  // The layer's pattern: the payload's, or (served) the server's hook_pattern of every head, fetched once a prompt.
  async function patternOf(p, layer) {
    if (patterns.has(layer)) return patterns.get(layer);
    let pattern;
    if (embedded) {
      pattern = Pattern.decode(p.attention.find((a) => a.layer === layer));
    } else {
      const hook = `blocks.${layer}.attn.hook_pattern`;
      const r = await server.complete(p.token_ids, 0, { capture: { hooks: hook, dtype: "float32", positions: "all" } });
      const t = await server.tensors(r.vlens.activations);
      pattern = Pattern.ofRows(layer, t.positions.data, t[hook]);
    }
    if (p === current) patterns.set(layer, pattern); // (an earlier prompt's is not kept)
    return pattern;
  }

  function headOf() {
    const text = byId("head").value.trim();
    return text === "" ? null : Number(text);
  }

  // The form's layer and head (the layer's first if none); each answer drawn only if still the latest.
  async function showAttention() {
    setError("head-error", "");
    if (!current) return setError("head-error", "run a prompt first");
    const [p, id, ticket] = [current, runId, ++latest.attention];
    const layer = Number(byId("layer").value);
    const head = headOf();
    if (!patterns.has(layer)) clearAttention(); // (no other layer's pattern on screen while this one loads)
    try {
      const pattern = await patternOf(p, layer);
      if (id !== runId || ticket !== latest.attention) return;
      if (head !== null && !pattern.heads.includes(head)) {
        clearAttention();
        const heads = pattern.heads.join(", ");
        return setError("head-error", `head ${byId("head").value}: this view has heads ${heads} of layer ${layer}`);
      }
      renderAttention(p, pattern, head === null ? pattern.heads[0] : head);
    } catch (e) {
      if (id !== runId || ticket !== latest.attention) return;
      clearAttention();
      setError("head-error", e.message);
    }
  }

  function chooseFeature(feature) {
    byId("sae-feature").value = String(feature);
    showFeature();
  }

  function renderSae(p) {
    const sae = p.sae;
    const table = byId("sae-table");
    table.replaceChildren();
    byId("sae-strip").replaceChildren();
    table.append(el("caption", {}, `${sae.name} at ${sae.hook}: top latents per token`));
    const body = el("tbody");
    sae.positions.forEach((pos, r) => {
      const tr = el("tr");
      tr.append(el("th", { scope: "row", title: `position ${pos}` }, `${pos} ${tokenText(p, p.token_ids[pos])}`));
      sae.ids[r].forEach((feature, i) => {
        const value = sae.values[r][i];
        if (!(value > 0)) return; // a top-k entry that did not fire names no latent in particular
        const td = el("td", { tabindex: "-1", "data-pos": pos, "data-feature": feature, "data-value": value,
          title: `feature ${feature} at position ${pos}: ${value}; Enter shows it at every position` }, `${feature}: ${fixed(value)}`);
        td.addEventListener("click", () => chooseFeature(feature));
        td.addEventListener("keydown", (event) => {
          if (event.key === "Enter" || event.key === " ") {
            event.preventDefault();
            chooseFeature(feature);
          }
        });
        tr.append(td);
      });
      body.append(tr);
    });
    table.append(body);
    gridKeys(table);
    byId("sae-section").hidden = false;
  }

  function renderFeature(p) {
    const f = p.feature;
    const table = byId("sae-strip");
    table.replaceChildren();
    table.append(el("caption", {}, `Feature ${f.feature} at every position` +
      (f.values.includes(null) ? " (\u2013: not among that token's top latents, so not in this file)" : "")));
    table.append(tokenHeader(p, f.positions, "feature"));
    const tr = el("tr");
    tr.append(el("th", { scope: "row" }, String(f.feature)));
    const top = Math.max(1e-9, ...f.values.filter((v) => v !== null));
    f.positions.forEach((pos, r) => {
      const value = f.values[r];
      const td = el("td", { tabindex: "-1", "data-pos": pos, "data-feature": f.feature, "data-value": value === null ? undefined : value },
        value === null ? "\u2013" : fixed(value));
      if (value !== null) shade(td, value / top);
      tr.append(td);
    });
    table.append(el("tbody").appendChild(tr).parentElement);
    gridKeys(table);
  }

  function fillLayers(layers) {
    const select = byId("layer");
    const chosen = select.value;
    select.replaceChildren(...layers.map((l) => el("option", { value: l }, String(l))));
    if (layers.map(String).includes(chosen)) select.value = chosen;
  }

  // ---- static: a payload in the page -------------------------------------------------------------------

  let current = null; // the payload of the prompt on screen

  function showStaticFeature() {
    const feature = Number(byId("sae-feature").value);
    const sae = current.sae;
    const values = sae.ids.map((row, r) => (row.includes(feature) ? sae.values[r][row.indexOf(feature)] : null));
    current.feature = { feature, positions: sae.positions, values };
    renderFeature(current);
  }

  function renderAll(p) {
    current = p;
    renderTokens(p);
    if (p.lens) renderLens(p);
    if (p.attention.length) {
      fillLayers(p.attention.map((a) => a.layer));
      showAttention();
    }
    if (p.sae) {
      byId("sae-name").replaceChildren(el("option", { value: p.sae.name }, p.sae.name));
      renderSae(p);
    }
    if (p.feature) renderFeature(p);
  }

  // ---- served: the server's API --------------------------------------------------------------------------

  class ApiError extends Error {}

  function parseSafetensors(buf) {
    const n = Number(new DataView(buf).getBigUint64(0, true));
    const header = JSON.parse(new TextDecoder().decode(new Uint8Array(buf, 8, n)));
    const out = {};
    for (const [name, info] of Object.entries(header)) {
      if (name === "__metadata__") continue;
      const bytes = buf.slice(8 + n + info.data_offsets[0], 8 + n + info.data_offsets[1]);
      const read = { F32: (b) => new Float32Array(b), F64: (b) => new Float64Array(b), I32: (b) => new Int32Array(b),
        I64: (b) => Array.from(new BigInt64Array(b), Number) }[info.dtype];
      if (!read) throw new ApiError(`${name}: dtype ${info.dtype} is not one this page reads (F32, F64, I32, I64)`);
      out[name] = { shape: info.shape, data: Array.from(read(bytes)) };
    }
    return out;
  }

  function nested(t) {
    const build = (offset, dims) => {
      if (dims.length === 0) return t.data[offset];
      const stride = dims.slice(1).reduce((a, b) => a * b, 1);
      return range(dims[0]).map((i) => build(offset + i * stride, dims.slice(1)));
    };
    return build(0, t.shape);
  }

  const server = {
    headers() {
      const key = byId("api-key").value.trim();
      return key ? { "Content-Type": "application/json", Authorization: `Bearer ${key}` } : { "Content-Type": "application/json" };
    },
    async call(method, path, body) {
      let r;
      try {
        r = await fetch(path, { method, headers: this.headers(), body: body === undefined ? undefined : JSON.stringify(body) });
      } catch (e) {
        throw new ApiError(`the server did not answer (${e.message})`);
      }
      if (!r.ok) {
        let message = `${r.status} ${r.statusText}`;
        try {
          const error = (await r.json()).error;
          if (error && error.message) message = error.message;
        } catch (e) { /* not JSON: the status line says it */ }
        throw new ApiError(message);
      }
      return r;
    },
    async json(method, path, body) {
      return (await this.call(method, path, body)).json();
    },
    model: null, // the model of the run on screen: the served one, or one steered by a vector (null: the served)
    // Greedy; max_tokens 0 reads the prompt only (the API asks for echo then).
    complete(prompt, maxTokens, vlens) {
      const body = { prompt, max_tokens: maxTokens, temperature: 0 };
      if (this.model) body.model = this.model;
      if (maxTokens === 0) body.echo = true;
      if (vlens) body.vlens = vlens;
      return this.json("POST", "v1/completions", body);
    },
    async tensors(activations) {
      const buf = activations.data !== undefined
        ? bytesOf(activations.data).buffer
        : await (await this.call("GET", activations.url)).arrayBuffer();
      return parseSafetensors(buf);
    },
    async nameTokens(p, ids) {
      const missing = Array.from(new Set(ids)).filter((id) => p.texts[String(id)] === undefined);
      if (!missing.length) return;
      const { texts } = await this.json("POST", "lens/texts", { tokens: missing });
      missing.forEach((id, i) => { p.texts[String(id)] = texts[i]; });
    },
  };

  let info = null; // what the server serves: model, layers, hooks, SAEs (asked until it answers)

  async function serverInfo() {
    if (info) return info;
    const [models, hooks, saes, vectors] = await Promise.all([server.json("GET", "v1/models"),
      server.json("GET", "v1/hooks"), server.json("GET", "v1/saes"), server.json("GET", "v1/steering_vectors")]);
    const layers = 1 + Math.max(...hooks.data.map((h) => Number((/^blocks\.(\d+)\./.exec(h.name) || [0, -1])[1])));
    const residual = hooks.data.filter((h) => !h.optional && h.shape.length === 1 && h.shape[0] > 1).map((h) => h.name);
    info = { model: models.data[0].id, layers, residual, saes: saes.data, tuned: models.data[0].tuned_lens === true };
    byId("tuned-row").hidden = !info.tuned;
    // (the layers that attend: a hybrid's others, a Mamba's all, have no pattern)
    const patterns = hooks.data.filter((h) => h.name.endsWith(".attn.hook_pattern"));
    fillLayers(patterns.map((h) => Number(h.name.split(".")[1])));
    const hookSelect = byId("steer-hook");
    hookSelect.replaceChildren(...residual.map((h) => el("option", { value: h }, h)));
    const middle = `blocks.${Math.floor(layers / 2)}.hook_resid_post`;
    if (residual.includes(middle)) hookSelect.value = middle;
    byId("sae-name").replaceChildren(...info.saes.map((s) => el("option", { value: s.name }, `${s.name} (${s.hook}, ${s.d_sae} latents)`)));
    byId("steer-sae-row").hidden = info.saes.length === 0;
    byId("steer-vector").replaceChildren(...vectors.data.map((v) => el("option", { value: v.name },
      `${v.name} (${Object.keys(v.hooks).join(", ")})`)));
    byId("steer-vector-row").hidden = vectors.data.length === 0;
    // (the served model, then each steering vector as a model of its own: the served one steered by it)
    byId("model").replaceChildren(...models.data.map((m) => el("option", { value: m.id },
      m.parent ? `${m.id} (${m.parent}, steered)` : m.id)));
    byId("model-row").hidden = models.data.length < 2;
    byId("model-line").textContent = `Model: ${info.model}`;
    return info;
  }

  // Each run, and each reload of a view, draws only if it is still the latest: an answer overtaken by a
  // newer request (another prompt, layer or latent) is dropped, never shown as the new one's.
  let runId = 0;
  let steerId = 0;
  const latest = { attention: 0, sae: 0, feature: 0 };

  function clearResults() {
    current = null;
    patterns.clear();
    clearAttention();
    for (const id of ["tokens-section", "lens-section", "attention-section", "sae-section"]) byId(id).hidden = true;
    for (const id of ["tokens", "lens-table", "lens-detail", "sae-table", "sae-strip", "steer-plain", "steer-steered"]) {
      byId(id).replaceChildren();
    }
    byId("completion").textContent = "";
    for (const id of ["prompt-error", "head-error", "sae-error", "steer-error"]) setError(id, "");
  }

  async function run() {
    const id = ++runId;
    steerId++; // a steering request of the earlier prompt still in flight is dropped too
    clearResults();
    status("Running\u2026");
    const prompt = byId("prompt").value;
    const maxTokens = Number(byId("max-tokens").value || 0);
    try {
      const meta = await serverInfo();
      server.model = byId("model").value || null; // every view of this run asks the same model
      const tuned = meta.tuned && byId("tuned-lens").checked;
      const capture = { hooks: "blocks.*.hook_resid_post", logit_lens: K, positions: "all", ...(tuned ? { tuned_lens: true } : {}) };
      const r = await server.complete(prompt, maxTokens, { capture });
      const t = await server.tensors(r.vlens.activations);
      if (id !== runId) return; // a newer run started meanwhile: this one's answer is stale
      const hooks = Object.keys(t).filter((n) => n.endsWith(".logit_lens.token_ids")).map((n) => n.slice(0, -".logit_lens.token_ids".length));
      const p = {
        model: server.model || meta.model, prompt, token_ids: t.token_ids.data, prompt_tokens: r.usage.prompt_tokens,
        completion: maxTokens > 0 ? r.choices[0].text : null, texts: {}, attention: [], sae: null, feature: null,
        lens: { k: K, tuned, layers: hooks.map((hook) => ({ layer: Number(/^blocks\.(\d+)\./.exec(hook)[1]), hook, positions: t.positions.data,
          ids: nested(t[`${hook}.logit_lens.token_ids`]), logprobs: nested(t[`${hook}.logit_lens.logprobs`]) }))
          .sort((a, b) => a.layer - b.layer) },
      };
      await server.nameTokens(p, [...p.token_ids, ...p.lens.layers.flatMap((l) => l.ids.flat())]);
      if (id !== runId) return;
      current = p;
      renderTokens(p);
      renderLens(p);
      byId("attention-section").hidden = false;
      await Promise.all([showAttention(), meta.saes.length ? loadSae(id) : null]);
      if (id === runId) status("Done.");
    } catch (e) {
      if (id !== runId) return;
      clearResults();
      status("");
      setError("prompt-error", e.message);
    }
  }

  async function loadSae(id) {
    setError("sae-error", "");
    for (const table of ["sae-table", "sae-strip"]) byId(table).replaceChildren();
    if (!current) return setError("sae-error", "run a prompt first");
    const p = current;
    const name = byId("sae-name").value;
    const ticket = ++latest.sae;
    byId("sae-section").hidden = false;
    try {
      const r = await server.complete(p.token_ids, 0, { capture: { sae: name, top_k: K, positions: "all" } });
      if (id !== runId || ticket !== latest.sae) return;
      const [hook] = Object.keys(r.vlens.sae_features);
      const f = r.vlens.sae_features[hook];
      p.sae = { name, hook, positions: f.positions, ids: f.ids, values: f.values };
      p.feature = null;
      renderSae(p);
    } catch (e) {
      if (id === runId && ticket === latest.sae) setError("sae-error", e.message);
    }
  }

  async function loadFeature(id) {
    setError("sae-error", "");
    byId("sae-strip").replaceChildren();
    if (!current || !current.sae) return setError("sae-error", "run a prompt first");
    const p = current;
    const feature = Number(byId("sae-feature").value);
    const ticket = ++latest.feature;
    try {
      const r = await server.complete(p.token_ids, 0, { capture: { sae: p.sae.name, features: [feature], positions: "all" } });
      if (id !== runId || ticket !== latest.feature) return;
      const f = Object.values(r.vlens.sae_features)[0];
      p.feature = { feature, positions: f.positions, values: f.values.map((row) => row[0]) };
      renderFeature(p);
    } catch (e) {
      if (id === runId && ticket === latest.feature) setError("sae-error", e.message);
    }
  }

  async function meanResidual(text, hook) {
    const r = await server.complete(text, 0, { capture: { hooks: hook, reduce: "mean", dtype: "float32", positions: "all" } });
    return (await server.tensors(r.vlens.activations))[hook].data;
  }

  async function steer() {
    const id = ++steerId;
    for (const out of ["steer-plain", "steer-steered"]) byId(out).replaceChildren();
    setError("steer-error", "");
    const prompt = byId("prompt").value;
    const maxTokens = Number(byId("steer-tokens").value || 0);
    const scale = Number(byId("steer-scale").value || 0);
    try {
      const meta = await serverInfo();
      let steering;
      if (byId("steer-by-vector").checked) {
        steering = { steering: [{ name: byId("steer-vector").value, multiplier: scale }] };
      } else if (byId("steer-by-sae").checked) {
        const sae = meta.saes.find((s) => s.name === byId("sae-name").value);
        steering = { interventions: [{ type: "steer", hook: sae.hook, sae: sae.name, feature: Number(byId("steer-feature").value), scale }] };
      } else {
        const hook = byId("steer-hook").value;
        const [plus, minus] = await Promise.all([meanResidual(byId("steer-plus").value, hook), meanResidual(byId("steer-minus").value, hook)]);
        steering = { interventions: [{ type: "steer", hook, vector: plus.map((x, i) => x - minus[i]), scale }] };
      }
      const [plain, steered] = await Promise.all([server.complete(prompt, maxTokens),
        server.complete(prompt, maxTokens, steering)]);
      if (id !== steerId) return;
      byId("steer-plain").textContent = plain.choices[0].text;
      byId("steer-steered").textContent = steered.choices[0].text;
    } catch (e) {
      if (id === steerId) setError("steer-error", e.message);
    }
  }

  function submit(form, action) {
    byId(form).addEventListener("submit", (event) => {
      event.preventDefault();
      action();
    });
  }

  // ---- start -----------------------------------------------------------------------------------------------

  const embedded = byId("vlens-payload");
  patternEvents();
  submit("attention-form", showAttention);
  if (embedded) {
    renderAll(JSON.parse(embedded.textContent));
    byId("sae-show").addEventListener("click", showStaticFeature);
  } else {
    byId("ask").hidden = false;
    byId("steer-section").hidden = false;
    submit("ask-form", run);
    submit("steer-form", steer);
    byId("sae-show").addEventListener("click", () => loadFeature(runId));
    byId("sae-name").addEventListener("change", () => loadSae(runId));
    byId("prompt").addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) {
        event.preventDefault();
        run();
      }
    });
    byId("prompt").focus();
    serverInfo().catch(() => {}); // fills the layer and hook choices now if the server needs no key (else on Run)
  }
  function showFeature() {
    return embedded ? showStaticFeature() : loadFeature(runId);
  }
})();
