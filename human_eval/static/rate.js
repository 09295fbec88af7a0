// Keyboard for the rating page: 1 / 2 / 3 answer the highlighted question (then the next
// question is highlighted), Enter submits once both are answered. Clicks work as usual.
(function () {
  "use strict";
  var form = document.getElementById("vote");
  if (!form) { return; }
  var sets = Array.prototype.slice.call(form.querySelectorAll("fieldset"));
  var focused = 0;
  var sent = false;
  function highlight(i) {
    focused = Math.max(0, Math.min(sets.length - 1, i));
    sets.forEach(function (s, k) { s.classList.toggle("focused", k === focused); });
  }
  function answered(s) { return s.querySelector("input:checked") !== null; }
  sets.forEach(function (s, k) {
    s.addEventListener("click", function () { highlight(k); });
    s.addEventListener("change", function () { if (k + 1 < sets.length) { highlight(k + 1); } });
  });
  form.addEventListener("submit", function (e) {
    if (sent) { e.preventDefault(); return; }  // one submission per page
    sent = true;
  });
  document.addEventListener("keydown", function (e) {
    if (e.altKey || e.ctrlKey || e.metaKey) { return; }
    if (e.key === "1" || e.key === "2" || e.key === "3") {
      var inputs = sets[focused].querySelectorAll("input[type=radio]");
      inputs[Number(e.key) - 1].checked = true;
      if (focused + 1 < sets.length) { highlight(focused + 1); }
      e.preventDefault();
    } else if (e.key === "Enter") {
      e.preventDefault();
      var missing = sets.findIndex(function (s) { return !answered(s); });
      if (missing >= 0) { highlight(missing); return; }
      if (!sent) { sent = true; HTMLFormElement.prototype.submit.call(form); }
    } else if (e.key === "ArrowUp" || e.key === "ArrowDown") {
      highlight(focused + (e.key === "ArrowDown" ? 1 : -1));
      e.preventDefault();
    }
  });
}());
