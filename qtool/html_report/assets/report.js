// qtool's HTML report: the per-weight table (decoded from the page, sorted, filtered, drawn a
// screenful at a time so 60,000 rows stay fast) and the links from charts and findings to rows.
// Text from the model's files is only ever set with textContent.
"use strict";
(function () {
  const payload = document.getElementById("table-data");
  const scroller = document.getElementById("table-scroll");
  const table = document.getElementById("weights-table");
  const body = table.tBodies[0];
  const filter = document.getElementById("filter");
  const count = document.getElementById("row-count");
  const OVERSCAN = 12;
  let columns = [];
  let rows = [];
  let shown = [];
  let rowHeight = 0;
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
      // a null SQNR: an exact weight sorts after every measured one, a finding before
      const status = column.status ? row[column.status] || "" : "";
      return status.startsWith("exact") ? Infinity : -Infinity;
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
    drawn = "";
    draw();
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
      td.textContent = column.type === "name" ? display(value) : String(value);
      td.title = td.textContent;
    }
    return td;
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

  function draw() {
    const height = rowHeight || 28;
    const first = Math.max(0, Math.floor(scroller.scrollTop / height) - OVERSCAN);
    // the scroller may still be short from a narrower filter: draw for its largest height
    const view = Math.max(scroller.clientHeight, window.innerHeight);
    const last = Math.min(shown.length, Math.ceil((scroller.scrollTop + view) / height) + OVERSCAN);
    const key = first + ":" + last + ":" + (target ? target.index : "");
    if (key === drawn) return;
    drawn = key;
    const fragment = document.createDocumentFragment();
    fragment.appendChild(spacer(first * height));
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
    }
    fragment.appendChild(spacer((shown.length - last) * height));
    body.replaceChildren(fragment);
    if (!rowHeight && last > first) {
      rowHeight = body.rows[1].getBoundingClientRect().height || 28;
      drawn = "";
      draw();
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
    scroller.scrollTop = Math.max(0, at * (rowHeight || 28) - scroller.clientHeight / 3);
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
    let width = 280; // the name column's least width, then every fixed column's
    for (const col of table.querySelectorAll("col:not(.c-name)")) width += parseFloat(getComputedStyle(col).width) || 0;
    table.style.minWidth = width + "px";
    let pending = 0;
    filter.addEventListener("input", () => {
      clearTimeout(pending);
      pending = setTimeout(apply, rows.length > 20000 ? 150 : 30);
    });
    scroller.addEventListener("scroll", () => requestAnimationFrame(draw), { passive: true });
    window.addEventListener("resize", () => { drawn = ""; draw(); });
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
