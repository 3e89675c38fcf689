// Sorting and filtering of the leaderboard tables: click a header to sort (numbers by their
// data-value, best first on the first click), type in the box above a table to filter its rows.
(function () {
  "use strict";
  function cellValue(row, index, numeric) {
    var cell = row.cells[index];
    var raw = cell.getAttribute("data-value");
    if (raw === null) { raw = cell.textContent.trim(); }
    if (!numeric) { return raw.toLowerCase(); }
    var value = parseFloat(raw);
    return isNaN(value) ? null : value;
  }
  function sortBy(table, header, index) {
    var numeric = header.getAttribute("data-type") === "number";
    var lowerFirst = header.getAttribute("data-higher") === "no" || header.textContent.trim() === "rank";
    var descending = header.classList.contains("sorted-desc") ? false
      : header.classList.contains("sorted-asc") ? true : (numeric && !lowerFirst);
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows);
    rows.sort(function (a, b) {
      var x = cellValue(a, index, numeric), y = cellValue(b, index, numeric);
      if (x === null && y === null) { return 0; }
      if (x === null) { return 1; }  // missing values last, whichever the direction
      if (y === null) { return -1; }
      var order = x < y ? -1 : x > y ? 1 : 0;
      return descending ? -order : order;
    });
    rows.forEach(function (row) { body.appendChild(row); });
    Array.prototype.forEach.call(header.parentNode.children, function (th) {
      th.classList.remove("sorted-asc", "sorted-desc");
    });
    header.classList.add(descending ? "sorted-desc" : "sorted-asc");
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    Array.prototype.forEach.call(table.tHead.rows[0].cells, function (header, index) {
      header.addEventListener("click", function () { sortBy(table, header, index); });
    });
  });
  document.querySelectorAll("input.filter").forEach(function (input) {
    var table = input.nextElementSibling.querySelector("table");
    input.addEventListener("input", function () {
      var needle = input.value.toLowerCase();
      Array.prototype.forEach.call(table.tBodies[0].rows, function (row) {
        row.hidden = needle !== "" && row.textContent.toLowerCase().indexOf(needle) < 0;
      });
    });
  });
}());
