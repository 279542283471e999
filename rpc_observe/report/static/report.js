// rpc_observe report: renders the inline JSON (#report-data) as tables, heat maps and uPlot charts.
"use strict";
(function () {
  const data = JSON.parse(document.getElementById("report-data").textContent);
  const root = document.getElementById("report");
  const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
                   "#bcbd22", "#17becf"];
  const color = (i) => PALETTE[i % PALETTE.length];

  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (k === "class") node.className = v;
      else if (k === "style") node.style.cssText = v;
      else node.setAttribute(k, v);
    }
    for (const c of children) {
      if (c === null || c === undefined) continue;
      node.append(c instanceof Node ? c : String(c));
    }
    return node;
  }
  const fmt = (v, digits) => (v === null || v === undefined ? "-" : Number(v).toLocaleString("en-US", {
    maximumFractionDigits: digits === undefined ? 2 : digits}));
  const ms = (v) => (v === null || v === undefined ? "-" : fmt(v, v < 1 ? 3 : 2));
  const pct = (v) => (v === null || v === undefined ? "-" : Math.round(v * 100) + "%");
  function bytes(v) {
    if (v === null || v === undefined) return "-";
    const units = ["B", "kB", "MB", "GB", "TB"];
    let i = 0;
    while (v >= 1000 && i < units.length - 1) { v /= 1000; i++; }
    return fmt(v, i ? 1 : 0) + " " + units[i];
  }
  function section(id, title, note) {
    const s = el("section", {id}, el("h2", {}, title));
    if (note) s.append(el("p", {class: "note"}, note));
    root.append(s);
    return s;
  }
  function table(headers, rows, attrs) {
    const t = el("table", attrs || {});
    t.append(el("thead", {}, el("tr", {}, ...headers.map((h) => el("th", {}, h)))));
    const body = el("tbody");
    for (const r of rows) body.append(r instanceof Node ? r : el("tr", {}, ...r.map((c) => el("td", {}, c))));
    t.append(body);
    return t;
  }
  function chart(parent, title, opts, series) {
    const box = el("div", {class: "chart"}, el("h3", {}, title));
    parent.append(box);
    const width = Math.max(320, Math.min(parent.clientWidth || 900, 1100));
    return new uPlot(Object.assign({width, height: 220, legend: {live: true}}, opts), series, box);
  }

  // Overview
  const start = data.start_unix_ns ? new Date(data.start_unix_ns / 1e6).toISOString().replace("T", " ").slice(0, 19)
    + " UTC" : "-";
  document.getElementById("overview").textContent = `${fmt(data.spans, 0)} spans of ${data.workers.length} workers `
    + `(${data.workers.join(", ")}), ${fmt(data.duration_s)} s from ${start}; run id ${data.run_id || "-"}; `
    + `report made in ${fmt(data.elapsed_s)} s.`;

  // Per method
  const methods = section("methods", "Per method",
    "Client: the caller's time for a call; server: the callee's time running it. client = server + outside " +
    "for the calls whose server span was seen (outside: queueing in the callee's pool, (de)serialization, the wire). " +
    "Latency quantiles are interpolated within fixed buckets; max is exact. Bytes and tensors per request " +
    "message come from saved /metrics scrapes (metrics/*.prom)" + (data.files.scrapes.length ? "." : ": none here."));
  methods.append(table(
    ["method", "calls", "errors", "client p50 ms", "p90", "p99", "max", "server calls", "server p50 ms", "p99",
     "mean ms: client = server + outside", "outside share", "bytes/msg", "tensors/msg"],
    data.methods.map((m) => {
      const split = m.paired ? `${ms(m.paired_client_mean_ms)} = ${ms(m.paired_server_mean_ms)} + `
        + `${ms(m.paired_client_mean_ms - m.paired_server_mean_ms)}` : "-";
      const row = el("tr", {"data-method": m.method},
        el("td", {class: "name"}, m.method), el("td", {class: "calls"}, fmt(m.calls, 0)),
        el("td", {class: m.errors ? "errors bad" : "errors"}, fmt(m.errors, 0)),
        ...[m.client.p50_ms, m.client.p90_ms, m.client.p99_ms, m.client.max_ms].map((v) => el("td", {}, ms(v))),
        el("td", {}, fmt(m.server_calls, 0)), el("td", {}, ms(m.server.p50_ms)), el("td", {}, ms(m.server.p99_ms)),
        el("td", {}, split), el("td", {}, pct(m.outside_share)),
        el("td", {}, m.bytes_per_message === null ? "-" : bytes(m.bytes_per_message)),
        el("td", {}, m.tensors_per_message === null ? "-" : fmt(m.tensors_per_message, 1)));
      return row;
    }), {id: "methods-table"}));

  const dist = el("div", {class: "charts"});
  methods.append(el("h3", {}, "Latency distributions (calls per bucket, client and server)"), dist);
  const xs = data.buckets.map((_, i) => i);
  const bars = uPlot.paths && uPlot.paths.bars ? uPlot.paths.bars({size: [0.8, 40]}) : undefined;
  for (const m of data.methods.slice(0, 8)) {
    chart(dist, m.method, {
      width: 520, height: 180,
      scales: {x: {time: false, range: [-0.5, data.buckets.length - 0.5]}},
      axes: [{values: (u, ticks) => ticks.map((t) => data.buckets[t] || ""), rotate: -30, size: 60}, {}],
      series: [{label: "bucket", value: (u, v) => (v === null ? "-" : data.buckets[v])},
        {label: "client", stroke: color(0), fill: color(0) + "99", paths: bars, points: {show: false}},
        {label: "server", stroke: color(1), fill: color(1) + "99", paths: bars, points: {show: false}}],
    }, [xs, m.client.counts, m.server.counts]);
  }

  // Traffic between workers
  const traffic = section("traffic", "Traffic between workers",
    "Client calls (and bytes sent, from saved /metrics scrapes) from each worker (rows) to each peer (columns).");
  const workers = data.traffic.workers;
  const cells = new Map(data.traffic.cells.map((c) => [c.src + "\t" + c.dst, c]));
  for (const [what, key, show] of [["calls", "calls", (v) => fmt(v, 0)], ["bytes sent", "bytes", bytes]]) {
    const values = data.traffic.cells.map((c) => c[key] || 0);
    const top = Math.max(1, ...values);
    if (key === "bytes" && !values.some((v) => v)) {
      traffic.append(el("p", {class: "note"}, "bytes: no /metrics scrapes saved in this run"));
      continue;
    }
    const rows = workers.map((src) => el("tr", {}, el("th", {}, src), ...workers.map((dst) => {
      const c = cells.get(src + "\t" + dst);
      const v = c ? c[key] : null;
      const heat = v ? 0.12 + 0.88 * Math.sqrt(v / top) : 0;
      const td = el("td", {class: "heat", style: `background: rgba(31,119,180,${heat.toFixed(3)});`
        + (heat > 0.55 ? "color: #fff;" : ""), title: `${src} -> ${dst}: ${what}`}, v ? show(v) : "");
      if (c && c.errors && key === "calls") td.append(el("span", {class: "bad"}, ` (${fmt(c.errors, 0)} failed)`));
      return td;
    })));
    traffic.append(el("h3", {}, what), table(["from \\ to", ...workers], rows, {class: "matrix", id: "matrix-" + key}));
  }

  // Timeline
  const tl = data.timeline;
  const timeline = section("timeline", "Workers over the run",
    tl ? `Client calls started and failed per second, and calls in flight (time-weighted mean), `
      + `in ${tl.t_s.length} bins of ${fmt(tl.bin_s, 3)} s on each worker's own clock.` : "No client calls.");
  if (tl) {
    const box = el("div", {class: "charts"});
    timeline.append(box);
    for (const [title, key] of [["calls / s", "calls_per_s"], ["errors / s", "errors_per_s"],
      ["calls in flight", "in_flight"]]) {
      chart(box, title, {scales: {x: {time: false}}, axes: [{label: "seconds"}, {}],
        series: [{label: "s"}, ...tl.workers.map((w, i) => ({label: w, stroke: color(i), width: 1.5,
          points: {show: false}}))]},
      [tl.t_s, ...tl.workers.map((w) => tl[key][w])]);
    }
  }

  // Slowest calls
  const slow = section("slowest", "Slowest calls",
    "Each call's trace across the workers, on the reference clock: client spans (caller) and server spans " +
    "(callee), nested calls indented. The trace id finds it in the span files, merged.json or Jaeger.");
  for (const call of data.slowest) {
    const end = Math.max(...call.rows.map((r) => r.start_ms + r.duration_ms), 1e-6);
    const box = el("div", {class: "waterfall", "data-trace": call.trace_id});
    box.append(el("h3", {}, `${call.method} (${call.caller} -> ${call.callee}) ${ms(call.duration_ms)} ms`),
      el("p", {class: "trace"}, "trace id ", el("code", {}, call.trace_id)));
    for (const r of call.rows) {
      const left = (100 * r.start_ms / end).toFixed(3), width = Math.max(0.2, 100 * r.duration_ms / end).toFixed(3);
      const bar = el("div", {class: `bar ${r.kind}${r.error ? " failed" : ""}${r.slow ? " slow" : ""}`,
        style: `left:${left}%;width:${width}%`, title: `${r.name}: ${ms(r.duration_ms)} ms`});
      box.append(el("div", {class: "wrow"},
        el("span", {class: "label", style: `padding-left:${r.depth * 0.8}em`}, `${r.worker} ${r.kind} ${r.method}`),
        el("span", {class: "track"}, bar), el("span", {class: "dur"}, `+${ms(r.start_ms)} / ${ms(r.duration_ms)} ms`)));
    }
    slow.append(box);
  }

  // Clocks
  const clock = section("clocks", "Clock offsets",
    `Estimated from the paired calls as rpc-observe merge does (a server span lies inside its client span); `
    + `added to each worker's clock to put it on ${data.clock.reference || "-"}'s. `
    + `${fmt(data.unpaired_spans, 0)} span(s) had no peer span to pair with.`);
  clock.append(table(["worker", "offset us", "± us", "paired calls", "spans"], data.workers.map((w) => [
    w, fmt(data.clock.offsets_us[w], 1),
    w === data.clock.reference ? "reference" : data.clock.bounds_us[w] === null ? "not aligned" : fmt(data.clock.bounds_us[w], 1),
    fmt(data.clock.pairs[w] || 0, 0), fmt(data.worker_spans[w] || 0, 0)]), {id: "clock-table"}));
  for (const [a, b] of data.clock.inconsistent) {
    clock.append(el("p", {class: "bad"}, `RPC timings between ${a} and ${b} are inconsistent (clock drift?)`));
  }

  // Files
  const files = section("files", "Files", "What rpc-observe merge would make of the span files.");
  files.append(el("p", {}, `${fmt(data.files.span_file_count, 0)} span file(s) read`
    + (data.files.span_file_count > data.files.span_files.length ? `, the first ${data.files.span_files.length}:` : ":")),
    el("ul", {}, ...data.files.span_files.map((f) => el("li", {}, el("code", {}, f)))));
  if (data.files.skipped.length) {
    files.append(el("h3", {}, `Left out or cut (${fmt(data.files.skipped_count, 0)})`), table(["file", "why"],
      data.files.skipped.map((s) => [el("code", {}, s.file), s.reason]), {id: "skipped-table"}));
  } else {
    files.append(el("p", {}, "No file was left out, foreign, unreadable or cut."));
  }
  for (const note of data.files.ignored.concat(data.files.scrape_problems)) files.append(el("p", {class: "note"}, note));

  // Flight recorder
  const doc = data.doctor;
  const rec = section("recorder", "Flight recorder", doc ? `${doc.dumps} dump(s) under debug/, read by rpc-observe doctor.`
    : "No flight recorder dumps under debug/.");
  if (doc) rec.append(el("pre", {class: doc.status ? "bad" : ""}, doc.text));

  document.body.setAttribute("data-rendered", "1");
})();
