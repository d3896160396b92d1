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

  // A shade for a value in [0, 1], with text that stays readable on it (the value is always written too).
  function shade(cell, x) {
    const v = Math.max(0, Math.min(1, x));
    cell.style.background = `hsl(212, 75%, ${Math.round(98 - 68 * v)}%)`;
    cell.style.color = v > 0.7 ? "#fff" : "#111";
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

  function renderAttention(p, entry, heads) {
    const box = byId("attention");
    box.replaceChildren();
    const keys = Math.max(...entry.positions) + 1;
    for (const head of heads) {
      const h = entry.heads.indexOf(head);
      const table = el("table", { class: "heat", "data-layer": entry.layer, "data-head": head });
      table.append(el("caption", {}, `Layer ${entry.layer}, head ${head}`));
      table.append(tokenHeader(p, range(keys), "query \\ key"));
      const body = el("tbody");
      entry.positions.forEach((query, r) => {
        const tr = el("tr");
        tr.append(el("th", { scope: "row", title: `position ${query}` }, tokenText(p, p.token_ids[query])));
        for (let key = 0; key < keys; key++) {
          if (key > query) {
            tr.append(el("td", { class: "masked", "aria-hidden": "true" }));
            continue;
          }
          const w = entry.weights[r][h][key];
          const td = el("td", { tabindex: "-1", "data-layer": entry.layer, "data-head": head, "data-query": query, "data-key": key,
            "data-weight": w, title: `head ${head}: position ${query} attends to ${key} with ${w.toFixed(4)}`,
            "aria-label": `query ${query}, key ${key}: ${fixed(w)}` }, fixed(w));
          shade(td, w);
          tr.append(td);
        }
        body.append(tr);
      });
      table.append(body);
      box.append(table);
      gridKeys(table);
    }
    byId("attention-section").hidden = false;
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

  function headOf() {
    const text = byId("head").value.trim();
    return text === "" ? null : Number(text);
  }

  function showStaticAttention() {
    setError("head-error", "");
    const entry = current.attention.find((a) => String(a.layer) === byId("layer").value);
    const head = headOf();
    if (head !== null && !entry.heads.includes(head)) {
      byId("attention").replaceChildren();
      setError("head-error", `head ${byId("head").value}: this view has heads ${entry.heads.join(", ")} of layer ${entry.layer}`);
      return;
    }
    renderAttention(current, entry, head === null ? entry.heads : [head]);
  }

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
      showStaticAttention();
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
    // Greedy; max_tokens 0 reads the prompt only (the API asks for echo then).
    complete(prompt, maxTokens, vlens) {
      const body = { prompt, max_tokens: maxTokens, temperature: 0 };
      if (maxTokens === 0) body.echo = true;
      if (vlens) body.vlens = vlens;
      return this.json("POST", "v1/completions", body);
    },
    async tensors(activations) {
      const buf = activations.data !== undefined
        ? Uint8Array.from(atob(activations.data), (c) => c.charCodeAt(0)).buffer
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
    const [models, hooks, saes] = await Promise.all([server.json("GET", "v1/models"), server.json("GET", "v1/hooks"),
      server.json("GET", "v1/saes")]);
    const layers = 1 + Math.max(...hooks.data.map((h) => Number((/^blocks\.(\d+)\./.exec(h.name) || [0, -1])[1])));
    const residual = hooks.data.filter((h) => h.shape.length === 1 && h.shape[0] > 1).map((h) => h.name);
    info = { model: models.data[0].id, layers, residual, saes: saes.data };
    fillLayers(range(layers));
    const hookSelect = byId("steer-hook");
    hookSelect.replaceChildren(...residual.map((h) => el("option", { value: h }, h)));
    const middle = `blocks.${Math.floor(layers / 2)}.hook_resid_post`;
    if (residual.includes(middle)) hookSelect.value = middle;
    byId("sae-name").replaceChildren(...info.saes.map((s) => el("option", { value: s.name }, `${s.name} (${s.hook}, ${s.d_sae} latents)`)));
    byId("steer-sae-row").hidden = info.saes.length === 0;
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
    for (const id of ["tokens-section", "lens-section", "attention-section", "sae-section"]) byId(id).hidden = true;
    for (const id of ["tokens", "lens-table", "lens-detail", "attention", "sae-table", "sae-strip", "steer-plain", "steer-steered"]) {
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
      const capture = { hooks: "blocks.*.hook_resid_post", logit_lens: K, positions: "all" };
      const r = await server.complete(prompt, maxTokens, { capture });
      const t = await server.tensors(r.vlens.activations);
      if (id !== runId) return; // a newer run started meanwhile: this one's answer is stale
      const hooks = Object.keys(t).filter((n) => n.endsWith(".logit_lens.token_ids")).map((n) => n.slice(0, -".logit_lens.token_ids".length));
      const p = {
        model: meta.model, prompt, token_ids: t.token_ids.data, prompt_tokens: r.usage.prompt_tokens,
        completion: maxTokens > 0 ? r.choices[0].text : null, texts: {}, attention: [], sae: null, feature: null,
        lens: { k: K, layers: hooks.map((hook) => ({ layer: Number(/^blocks\.(\d+)\./.exec(hook)[1]), hook, positions: t.positions.data,
          ids: nested(t[`${hook}.logit_lens.token_ids`]), logprobs: nested(t[`${hook}.logit_lens.logprobs`]) }))
          .sort((a, b) => a.layer - b.layer) },
      };
      await server.nameTokens(p, [...p.token_ids, ...p.lens.layers.flatMap((l) => l.ids.flat())]);
      if (id !== runId) return;
      current = p;
      renderTokens(p);
      renderLens(p);
      byId("attention-section").hidden = false;
      await Promise.all([loadAttention(id), meta.saes.length ? loadSae(id) : null]);
      if (id === runId) status("Done.");
    } catch (e) {
      if (id !== runId) return;
      clearResults();
      status("");
      setError("prompt-error", e.message);
    }
  }

  async function loadAttention(id) {
    setError("head-error", "");
    byId("attention").replaceChildren();
    if (!current) return setError("head-error", "run a prompt first");
    const p = current;
    const ticket = ++latest.attention;
    const layer = Number(byId("layer").value);
    const head = headOf();
    const hook = `blocks.${layer}.attn.hook_pattern`;
    const capture = { hooks: hook, dtype: "float32", positions: "all" };
    if (head !== null) capture.heads = [head];
    try {
      const r = await server.complete(p.token_ids, 0, { capture });
      const t = await server.tensors(r.vlens.activations);
      if (id !== runId || ticket !== latest.attention) return;
      const heads = head === null ? range(t[hook].shape[1]) : [head];
      const entry = { layer, heads, positions: t.positions.data, weights: nested(t[hook]) };
      p.attention = [entry];
      renderAttention(p, entry, heads);
    } catch (e) {
      if (id === runId && ticket === latest.attention) setError("head-error", e.message);
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
      if (byId("steer-by-sae").checked) {
        const sae = meta.saes.find((s) => s.name === byId("sae-name").value);
        steering = { type: "steer", hook: sae.hook, sae: sae.name, feature: Number(byId("steer-feature").value), scale };
      } else {
        const hook = byId("steer-hook").value;
        const [plus, minus] = await Promise.all([meanResidual(byId("steer-plus").value, hook), meanResidual(byId("steer-minus").value, hook)]);
        steering = { type: "steer", hook, vector: plus.map((x, i) => x - minus[i]), scale };
      }
      const [plain, steered] = await Promise.all([server.complete(prompt, maxTokens),
        server.complete(prompt, maxTokens, { interventions: [steering] })]);
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
  if (embedded) {
    renderAll(JSON.parse(embedded.textContent));
    submit("attention-form", showStaticAttention);
    byId("sae-show").addEventListener("click", showStaticFeature);
  } else {
    byId("ask").hidden = false;
    byId("steer-section").hidden = false;
    submit("ask-form", run);
    submit("attention-form", () => loadAttention(runId));
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
