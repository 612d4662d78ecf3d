// cl-bench site: sorting and filtering the leaderboard, the compare selector and the
// prediction browser's filter. Plain JS, no library; works from file://.
(function () {
  "use strict";

  // Sorting: a click on a header sorts the ranked rows of its table (the reference
  // rows stay apart, below); a second click reverses. Cells sort by data-sort
  // (numbers where the column is numeric), empty values last.
  function sortKey(cell, numeric) {
    var v = cell ? cell.getAttribute("data-sort") : null;
    if (v === null || v === "" || v === "None") return null;
    if (numeric) { var n = parseFloat(v); return isNaN(n) ? null : n; }
    return v.toLowerCase();
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    var headers = table.querySelectorAll("thead th");
    headers.forEach(function (th, col) {
      th.addEventListener("click", function () {
        var numeric = th.getAttribute("data-type") === "number";
        var desc = th.classList.contains("asc");  // asc first, then desc
        headers.forEach(function (h) { h.classList.remove("asc", "desc"); });
        th.classList.add(desc ? "desc" : "asc");
        var body = table.querySelector("tbody.ranked");
        var rows = Array.prototype.slice.call(body.rows);
        rows.sort(function (a, b) {
          var x = sortKey(a.cells[col], numeric), y = sortKey(b.cells[col], numeric);
          if (x === null && y === null) return 0;
          if (x === null) return 1;
          if (y === null) return -1;
          var c = x < y ? -1 : x > y ? 1 : 0;
          return desc ? -c : c;
        });
        rows.forEach(function (r) { body.appendChild(r); });
      });
    });
  });

  // Filters: profile, precision and method family, over every table.
  var filters = document.querySelectorAll("select[data-filter]");
  function applyFilters() {
    var shown = 0, total = 0;
    document.querySelectorAll("table.leaderboard tbody tr[data-profile]").forEach(function (tr) {
      var ok = true;
      filters.forEach(function (s) {
        if (s.value && tr.getAttribute("data-" + s.getAttribute("data-filter")) !== s.value) ok = false;
      });
      tr.style.display = ok ? "" : "none";
      total += 1; if (ok) shown += 1;
    });
    var note = document.getElementById("shown");
    if (note) note.textContent = shown + " of " + total + " rows shown";
  }
  filters.forEach(function (s) { s.addEventListener("change", applyFilters); });
  if (filters.length) applyFilters();

  // "every column": the leaderboard's secondary columns (class "more"), hidden by default.
  var all = document.getElementById("all-columns");
  if (all) {
    all.addEventListener("change", function () { document.body.classList.toggle("all-columns", all.checked); });
  }

  // The compare selector: the pre-computed pages, either way round.
  var data = document.getElementById("pairs-data");
  if (data) {
    var pairs = JSON.parse(data.textContent);
    var root = document.querySelector('link[rel="stylesheet"]').getAttribute("href").replace("static/site.css", "");
    document.getElementById("pick-go").addEventListener("click", function () {
      var a = document.getElementById("pick-a").value, b = document.getElementById("pick-b").value;
      var page = pairs[a + "|" + b] || pairs[b + "|" + a];
      var note = document.getElementById("pick-note");
      if (page) { window.location.href = root + page; return; }
      note.textContent = a === b ? "choose two different runs" :
        "not pre-computed (the site holds each run against the baseline runs of its profile and precision); " +
        "run: cl-bench compare " + a.replace(/__/g, "/") + " " + b.replace(/__/g, "/");
    });
  }

  // The prediction browser: show the items of one kind (forgotten, kept, never, unseen).
  var kind = document.getElementById("kind-filter");
  if (kind) {
    kind.addEventListener("change", function () {
      document.querySelectorAll("#items tbody tr").forEach(function (tr) {
        tr.style.display = !kind.value || tr.getAttribute("data-kind") === kind.value ? "" : "none";
      });
    });
  }
})();
