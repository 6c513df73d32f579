// apportion dashboard: keeps the live part of a page fresh by polling /ui/live.
// No build step, no dependencies. The page names what to poll in <main data-live="...">.
(function () {
  "use strict";
  var main = document.querySelector("main[data-live]");
  var target = document.getElementById("live");
  if (!main || !target) return;
  var spec = main.getAttribute("data-live");
  var q = spec.indexOf("?");
  var url = "/ui/live?page=" + (q < 0 ? spec : spec.slice(0, q) + "&" + spec.slice(q + 1));
  var last = target.innerHTML;
  var every = 2000;

  function busy() {
    // never replace a form the user is typing in
    var a = document.activeElement;
    return a && target.contains(a) && /^(INPUT|SELECT|TEXTAREA)$/.test(a.tagName);
  }

  function poll() {
    if (document.hidden || busy()) return schedule();
    fetch(url, { credentials: "same-origin", cache: "no-store" })
      .then(function (r) {
        if (r.status === 401) {
          window.location = "/ui/login?next=" + encodeURIComponent(location.pathname + location.search);
          return null;
        }
        return r.ok ? r.json() : null;
      })
      .then(function (data) {
        if (data && typeof data.html === "string" && data.html !== last && !busy()) {
          target.innerHTML = data.html;
          last = data.html;
          document.body.setAttribute("data-updated", String(Date.now()));
        }
        document.body.setAttribute("data-input-seq", data ? String(data.input_seq) : "");
      })
      .catch(function () {})
      .then(schedule);
  }

  function schedule() { window.setTimeout(poll, every); }
  schedule();
})();
