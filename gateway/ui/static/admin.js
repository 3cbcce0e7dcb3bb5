// Keyboard shortcuts for labeling: j/k move between turns; u, d, x press the focused turn's
// buttons; o, c, t, n focus its fields; / focuses the search box; Esc leaves a field.
(function () {
  "use strict";
  function cards() { return Array.from(document.querySelectorAll("[data-turn]")); }
  function current() { return document.querySelector("[data-turn].focused") || cards()[0] || null; }
  function focusCard(card) {
    cards().forEach(function (c) { c.classList.remove("focused"); });
    if (!card) return;
    card.classList.add("focused");
    card.scrollIntoView({ block: "nearest", behavior: "smooth" });
  }
  function move(step) {
    var all = cards(), cur = document.querySelector("[data-turn].focused");
    var i = cur ? all.indexOf(cur) + step : 0;
    focusCard(all[Math.max(0, Math.min(all.length - 1, i))]);
  }
  document.addEventListener("click", function (e) {
    var card = e.target.closest && e.target.closest("[data-turn]");
    if (card) focusCard(card);
    if (e.target.id === "help-toggle") { var h = document.getElementById("help"); h.hidden = !h.hidden; }
  });
  document.addEventListener("keydown", function (e) {
    var t = e.target, typing = t && (t.tagName === "INPUT" || t.tagName === "TEXTAREA" || t.tagName === "SELECT");
    if (typing) { if (e.key === "Escape") t.blur(); return; }
    if (e.ctrlKey || e.metaKey || e.altKey) return;
    var key = e.key, card;
    if (key === "j") { move(1); } else if (key === "k") { move(-1); }
    else if (key === "/") { var q = document.getElementById("q"); if (q) { q.focus(); } else return; }
    else if (key === "?") { var h = document.getElementById("help"); h.hidden = !h.hidden; }
    else if ("udxoctn".indexOf(key) >= 0 && (card = current())) {
      focusCard(card);
      var el = card.querySelector('[data-shortcut="' + key + '"]');
      if (!el) return;
      if (el.tagName === "BUTTON") { el.click(); }
      else { var d = el.closest("details"); if (d) d.open = true; el.focus(); }
    } else { return; }
    e.preventDefault();
  });
  // after htmx swaps a turn's labels, keep that turn focused
  document.addEventListener("htmx:afterSwap", function (e) {
    var card = e.target.closest && e.target.closest("[data-turn]");
    if (card) card.classList.add("focused");
  });
  // copy-as-JSON: fetch the /api JSON the button names (same login) and put it on the clipboard
  document.addEventListener("click", function (e) {
    var btn = e.target.closest && e.target.closest("[data-copy-json]");
    if (!btn) return;
    e.preventDefault();
    var label = btn.textContent;
    fetch(btn.getAttribute("data-copy-json"), { credentials: "same-origin", headers: { Accept: "application/json" } })
      .then(function (r) { if (!r.ok) throw new Error("HTTP " + r.status); return r.json(); })
      .then(function (data) { return navigator.clipboard.writeText(JSON.stringify(data, null, 2)); })
      .then(function () { btn.textContent = "copied"; }, function (err) { btn.textContent = "copy failed (" + err.message + ")"; })
      .finally(function () { setTimeout(function () { btn.textContent = label; }, 1500); });
  });
  // a #turn-<id> in the URL: show that turn focused
  if (location.hash.indexOf("#turn-") === 0) {
    var target = document.getElementById(location.hash.slice(1));
    if (target && target.matches("[data-turn]")) { target.classList.add("focused"); target.scrollIntoView({ block: "start" }); }
  }
})();
