// qtool's HTML report: the per-weight table (decoded from the page, sorted, filtered, drawn a
// screenful at a time so 60,000 rows stay fast) and the links from charts and findings to rows.
// Text from the model's files is only ever set with textContent.
// Cells wrap (a long name is shown whole, on several lines), so rows differ in height: each
// row's height is measured once drawn and estimated from its name's length until then, and the
// spacers above and below the drawn rows stand for the sums of the others' heights.
"use strict";
(function () {
  const payload = document.getElementById("table-data");
  if (!payload) {
    // a page without a weights table (qtool eval's): nothing to draw, ready as it is
    document.documentElement.dataset.ready = "1";
    return;
  }
  const scroller = document.getElementById("table-scroll");
  const table = document.getElementById("weights-table");
  const body = table.tBodies[0];
  const filter = document.getElementById("filter");
  const count = document.getElementById("row-count");
  const OVERSCAN = 12;
  let columns = [];
  let rows = [];
  let shown = [];
  let heights = new Float64Array(0); // by row index: the measured height, 0 until drawn
  let offsets = new Float64Array(1); // offsets[i]: where shown[i] starts; offsets[shown.length]: the total
  let lineHeight = 0; // a one-line row's height, then one more text line's, and a name line's characters
  let extraLine = 0;
  let perLine = 0;
  let sortKey = null;
  let sortDir = 1;
  let target = null;
  let drawn = "";

  function display(name) {
    // control and invisible characters as escapes, as the CLI shows names
    return String(name).replace(/[\\]|[\p{C}\p{Zl}\p{Zp}]|[^\P{Zs} ]/gu, (c) => {
      const named = { "\\": "\\\\", "\t": "\\t", "\n": "\\n", "\r": "\\r" }[c];
      if (named) return named;
      const code = c.codePointAt(0);
      if (code < 0x100) return "\\x" + code.toString(16).padStart(2, "0");
      if (code < 0x10000) return "\\u" + code.toString(16).padStart(4, "0");
      return "\\U" + code.toString(16).padStart(8, "0");
    });
  }

  function bytes(n) {
    let value = n;
    for (const unit of ["B", "KiB", "MiB", "GiB", "TiB"]) {
      if (Math.abs(value) < 1024 || unit === "TiB") return unit === "B" ? value + " B" : value.toFixed(1) + " " + unit;
      value /= 1024;
    }
    return n + " B";
  }

  function number(v) {
    if (v === 0) return "0";
    const a = Math.abs(v);
    return a >= 1e5 || a < 1e-3 ? v.toExponential(3) : String(Number(v.toPrecision(4)));
  }

  async function decode(text) {
    const raw = Uint8Array.from(atob(text.trim()), (c) => c.charCodeAt(0));
    const stream = new Blob([raw]).stream().pipeThrough(new DecompressionStream("gzip"));
    return JSON.parse(await new Response(stream).text());
  }

  function unpack(doc) {
    columns = doc.columns;
    rows = new Array(doc.rows);
    heights = new Float64Array(doc.rows);
    for (let i = 0; i < doc.rows; i++) rows[i] = { index: i };
    for (const column of columns) {
      const stored = doc.data[column.key];
      if (column.type === "name") {
        let previous = "";
        for (let i = 0; i < doc.rows; i++) {
          previous = previous.slice(0, stored.prefix[i]) + stored.suffix[i];
          rows[i][column.key] = previous;
          rows[i].lower = previous.toLowerCase();
        }
      } else if (column.type === "text") {
        for (let i = 0; i < doc.rows; i++) rows[i][column.key] = stored.values[stored.index[i]];
      } else {
        for (let i = 0; i < doc.rows; i++) rows[i][column.key] = stored[i];
      }
    }
  }

  function sortValue(column, row) {
    const value = row[column.key];
    if (value !== null && value !== undefined) return value;
    if (column.type === "db" || column.type === "number" || column.type === "bytes") {
      // a null SQNR: an exact weight (or an equal integer tensor) sorts after every measured
      // one, a finding (or no signal) before
      const status = column.status ? row[column.status] || "" : "";
      return status === "exact" || status.startsWith("integer") ? Infinity : -Infinity;
    }
    return "";
  }

  function compare(column, dir) {
    return (x, y) => {
      const a = sortValue(column, x);
      const b = sortValue(column, y);
      if (a < b) return -dir;
      if (a > b) return dir;
      return x.index - y.index;
    };
  }

  function apply() {
    const query = filter.value.trim().toLowerCase();
    shown = query ? rows.filter((row) => row.lower.includes(query)) : rows.slice();
    if (sortKey !== null) {
      const column = columns.find((c) => c.key === sortKey);
      shown.sort(compare(column, sortDir));
    }
    count.textContent = (query ? shown.length.toLocaleString("en") + " of " : "") + rows.length.toLocaleString("en") + " weights" + (query ? " match" : "");
    for (const th of table.tHead.rows[0].cells) {
      th.setAttribute("aria-sort", th.dataset.key === sortKey ? (sortDir > 0 ? "ascending" : "descending") : "none");
    }
    layout();
    drawn = "";
    draw();
  }

  function estimate(row) {
    const base = lineHeight || 28;
    if (!perLine) return base;
    const lines = Math.ceil(row.lower.length / perLine) || 1;
    return base + (lines - 1) * extraLine;
  }

  function layout() {
    // offsets of the shown rows: linear in their number, done once per sort, filter or measure
    if (offsets.length !== shown.length + 1) offsets = new Float64Array(shown.length + 1);
    let at = 0;
    for (let i = 0; i < shown.length; i++) {
      offsets[i] = at;
      const row = shown[i];
      at += heights[row.index] || estimate(row);
    }
    offsets[shown.length] = at;
  }

  function rowAt(y) {
    // the last shown row starting at or above y (binary search over the offsets)
    let low = 0;
    let high = shown.length;
    while (low < high) {
      const middle = (low + high + 1) >> 1;
      if (offsets[middle] <= y) low = middle;
      else high = middle - 1;
    }
    return Math.min(low, Math.max(shown.length - 1, 0));
  }

  function measure() {
    // one-line height, one more line's, and a name line's characters, for rows not drawn yet
    const probe = body.querySelector("tr:not(.spacer) td.t-name");
    if (!probe) return;
    const tr = probe.parentElement;
    const saved = probe.textContent;
    probe.textContent = "0";
    const one = tr.getBoundingClientRect().height;
    probe.textContent = "0\n0";
    probe.style.whiteSpace = "pre";
    const two = tr.getBoundingClientRect().height;
    probe.style.whiteSpace = "";
    const range = document.createRange();
    probe.textContent = "0".repeat(200);
    probe.style.whiteSpace = "nowrap";
    range.selectNodeContents(probe);
    const width = range.getBoundingClientRect().width / 200;
    probe.style.whiteSpace = "";
    probe.textContent = saved;
    const style = getComputedStyle(probe);
    const room = probe.clientWidth - parseFloat(style.paddingLeft) - parseFloat(style.paddingRight);
    lineHeight = one || 28;
    extraLine = Math.max(two - one, 0);
    perLine = width > 0 ? Math.max(1, Math.floor(room / width)) : 0;
  }

  function cell(column, row) {
    const td = document.createElement("td");
    const value = row[column.key];
    td.className = "t-" + column.type;
    if (value === null || value === undefined) {
      const status = column.status ? row[column.status] || "" : "";
      td.textContent = column.type === "db" ? status.split(":")[0] || "—" : "—";
      if (status) td.title = status;
      return td;
    }
    if (column.type === "db" || column.type === "number" || column.type === "bytes") td.dataset.value = String(value);
    if (column.type === "db") {
      td.textContent = value.toFixed(2);
      td.title = value + " dB";
    } else if (column.type === "bytes") {
      td.textContent = bytes(value);
      td.title = value.toLocaleString("en") + " bytes";
    } else if (column.type === "number") {
      td.textContent = Number.isInteger(value) && column.key === "layer" ? String(value) : number(value);
      td.title = String(value) + (column.unit ? " " + column.unit : "");
    } else {
      if (column.type === "name") nameInto(td, display(value));
      else td.textContent = String(value);
      td.title = td.textContent;
    }
    return td;
  }

  function nameInto(td, name) {
    // a name wraps after its dots first (<wbr>), anywhere else only where a part is too long
    const parts = name.split(/(?<=[./])/);
    for (let i = 0; i < parts.length; i++) {
      if (i) td.appendChild(document.createElement("wbr"));
      td.appendChild(document.createTextNode(parts[i]));
    }
  }

  function spacer(height) {
    const tr = document.createElement("tr");
    tr.className = "spacer";
    tr.setAttribute("aria-hidden", "true");
    const td = document.createElement("td");
    td.colSpan = columns.length;
    tr.appendChild(td);
    tr.style.height = height + "px";
    return tr;
  }

  function draw(again = 0) {
    const top = scroller.scrollTop;
    // the scroller may still be short from a narrower filter: draw for its largest height
    const view = Math.max(scroller.clientHeight, window.innerHeight);
    const first = Math.max(0, rowAt(top) - OVERSCAN);
    const last = shown.length ? Math.min(shown.length, rowAt(top + view) + 1 + OVERSCAN) : 0;
    const key = first + ":" + last + ":" + (target ? target.index : "");
    if (key === drawn) return;
    drawn = key;
    const fragment = document.createDocumentFragment();
    fragment.appendChild(spacer(offsets[first]));
    const drawnRows = [];
    for (let i = first; i < last; i++) {
      const row = shown[i];
      const tr = document.createElement("tr");
      tr.dataset.name = row.name;
      tr.dataset.row = String(i);
      if (target === row) {
        tr.className = "target";
        tr.tabIndex = -1;
      }
      for (const column of columns) tr.appendChild(cell(column, row));
      fragment.appendChild(tr);
      drawnRows.push([tr, row]);
    }
    const below = spacer(offsets[shown.length] - offsets[last]);
    fragment.appendChild(below);
    body.replaceChildren(fragment);
    if (!lineHeight && drawnRows.length) measure();
    let changed = false;
    for (const [tr, row] of drawnRows) {
      const height = tr.getBoundingClientRect().height;
      if (height && Math.abs(height - heights[row.index]) > 0.01) {
        heights[row.index] = height;
        changed = true;
      }
    }
    if (changed) {
      // the rows above the first drawn are unchanged, so nothing drawn moves; the rows below
      // and the screenful may have: set the lower spacer, and draw again where rows were missing
      layout();
      below.style.height = offsets[shown.length] - offsets[last] + "px";
      if (again < 3) {
        drawn = "";
        draw(again + 1);
      }
    }
  }

  function goTo(name) {
    let at = shown.findIndex((row) => row.name === name);
    if (at < 0 && filter.value) {
      filter.value = "";
      apply();
      at = shown.findIndex((row) => row.name === name);
    }
    if (at < 0) return;
    target = shown[at];
    document.getElementById("weights").scrollIntoView({ block: "start" });
    scroller.scrollTop = Math.max(0, offsets[at] - scroller.clientHeight / 3);
    drawn = "";
    draw();
    const tr = body.querySelector("tr.target");
    if (tr) tr.focus({ preventScroll: true });
  }

  function fromHash() {
    const hash = location.hash;
    if (hash.startsWith("#weight=")) goTo(decodeURIComponent(hash.slice(8)));
  }

  function sortBy(key) {
    const column = columns.find((c) => c.key === key);
    const first = column.sort === "desc" ? -1 : 1;
    sortDir = sortKey === key ? -sortDir : first;
    sortKey = key;
    apply();
  }

  async function start() {
    try {
      if (typeof DecompressionStream === "undefined") throw new Error("this browser has no DecompressionStream (Chromium 80+, Firefox 113+, Safari 16.4+)");
      unpack(await decode(payload.textContent));
    } catch (error) {
      count.textContent = "The table could not be read: " + error.message;
      document.documentElement.dataset.ready = "error";
      return;
    }
    for (const th of table.tHead.rows[0].cells) {
      th.querySelector("button").addEventListener("click", () => sortBy(th.dataset.key));
    }
    let width = 220; // the name column's least width (names wrap), then every fixed column's
    for (const col of table.querySelectorAll("col:not(.c-name)")) width += parseFloat(getComputedStyle(col).width) || 0;
    table.style.minWidth = width + "px";
    let pending = 0;
    filter.addEventListener("input", () => {
      clearTimeout(pending);
      pending = setTimeout(apply, rows.length > 20000 ? 150 : 30);
    });
    scroller.addEventListener("scroll", () => requestAnimationFrame(draw), { passive: true });
    window.addEventListener("resize", () => {
      // columns change width, so rows wrap anew: measure again
      heights.fill(0);
      lineHeight = extraLine = perLine = 0;
      layout();
      drawn = "";
      draw();
    });
    window.addEventListener("hashchange", fromHash);
    document.addEventListener("click", (event) => {
      const mark = event.target.closest(".mark[data-name]");
      if (mark) goTo(decodeURIComponent(mark.dataset.name));
    });
    document.addEventListener("keydown", (event) => {
      const mark = event.target.closest && event.target.closest(".mark[data-name]");
      if (mark && (event.key === "Enter" || event.key === " ")) {
        event.preventDefault();
        goTo(decodeURIComponent(mark.dataset.name));
      }
    });
    apply();
    fromHash();
    performance.mark("qtool-table-drawn");
    document.documentElement.dataset.ready = "1";
  }

  start();
})();
