// Rota's dashboard: refresh the page's live region every 2 s (paused with the button,
// remembered across pages), and ask before a form marked data-confirm is sent. While the
// server does not answer, the region is dimmed under a banner that says how old it is.
(function () {
  "use strict";
  var EVERY = window.ROTA_REFRESH_MS || 2000;  // tests set it lower before the page loads
  var live = document.getElementById("live");
  var button = document.getElementById("poll");
  var state = document.getElementById("poll-state");
  var paused = localStorage.getItem("rota.paused") === "1";
  var busy = false;
  // A button of the live region is held down: a refresh that replaced it now would lose
  // the click (its mouseup would land on a new element), so it waits for the release.
  var pressed = false;
  var banner = document.getElementById("stale");
  var shownAt = Date.now();  // when what the page shows came from the server
  var trouble = null;  // why the last refresh failed, while it does
  var TIMEOUT = Math.max(10000, 4 * EVERY);  // a server that hangs is as down as one that is off

  function age() {
    var s = Math.max(0, Math.round((Date.now() - shownAt) / 1000));
    if (s < 120) return s + " s";
    if (s < 7200) return Math.round(s / 60) + " min";
    return Math.round(s / 3600) + " h";
  }

  // What the page shows is old: dim it, and say since when (updated every second).
  function stale(why) {
    trouble = why;
    show(why);
    if (!banner || !live) return;
    banner.textContent = why + " — showing data from " + age() + " ago";
    banner.hidden = false;
    live.classList.add("stale");
  }

  function fresh() {
    trouble = null;
    shownAt = Date.now();
    if (!banner || !live) return;
    banner.hidden = true;
    live.classList.remove("stale");
  }

  function show(text) {
    if (button) {
      button.textContent = paused ? "Resume updates" : "Pause updates";
      button.setAttribute("aria-pressed", paused ? "true" : "false");
    }
    if (state) state.textContent = paused ? "paused" : text;
  }

  function typing() {
    var el = document.activeElement;
    return el && live.contains(el) && /^(INPUT|SELECT|TEXTAREA)$/.test(el.tagName);
  }

  function refresh() {
    // A page with nothing live (the login form, a confirmation) is not fetched again.
    if (paused || busy || pressed || document.hidden || !live || !live.firstElementChild ||
        typing()) return;
    busy = true;
    var abort = new AbortController();
    var timer = setTimeout(function () { abort.abort(); }, TIMEOUT);
    fetch(location.href, {headers: {"X-Rota-Live": "1"}, credentials: "same-origin",
                          cache: "no-store", signal: abort.signal})
      .then(function (response) {
        // Paused while this was fetched: the page stays as it was when the button was
        // pressed, whatever the answer (the next refresh after Resume shows it).
        if (paused) return;
        // Sent to the login form (the session ended): show it.
        if (response.redirected || response.status === 401) { location.reload(); return; }
        // 5xx: the server (or a proxy before it) cannot answer now. A 4xx page (a bad
        // filter, a job not found) is the answer itself: the server is there.
        if (response.status >= 500) { stale("server answered " + response.status); return; }
        if (!response.ok) { fresh(); show("error " + response.status); return; }
        return response.text().then(function (html) {
          // Pressed, or paused, while this was read: the next refresh shows it.
          if (pressed || paused) return;
          if (html !== live.dataset.last) {
            var open = [];
            live.querySelectorAll("details[open][data-key]").forEach(function (d) {
              open.push(d.dataset.key);
            });
            // A wide table or the chart scrolled sideways (on a phone) stays where it was.
            var boxes = ".scroll, .chart-box";
            var lefts = Array.prototype.map.call(live.querySelectorAll(boxes),
                                                 function (box) { return box.scrollLeft; });
            live.innerHTML = html;
            open.forEach(function (key) {
              var d = live.querySelector('details[data-key="' + CSS.escape(key) + '"]');
              if (d) d.open = true;
            });
            live.querySelectorAll(boxes).forEach(function (box, i) {
              if (i < lefts.length) box.scrollLeft = lefts[i];
            });
            live.dataset.last = html;
          }
          fresh();
          show("live · " + new Date().toLocaleTimeString());
        });
      })
      .catch(function () { if (!paused) stale("server unreachable"); })
      .finally(function () { clearTimeout(timer); busy = false; });
  }

  if (button) {
    button.addEventListener("click", function () {
      paused = !paused;
      localStorage.setItem("rota.paused", paused ? "1" : "0");
      show("live");
      refresh();
    });
  }
  if (live) {
    live.addEventListener("pointerdown", function () { pressed = true; });
    ["pointerup", "pointercancel"].forEach(function (name) {
      // After the click that follows the release has been dispatched.
      document.addEventListener(name, function () {
        setTimeout(function () { pressed = false; }, 0);
      }, true);
    });
  }
  // The workers page's by-label form: what it will do, to which label, and to how many
  // of the workers listed (counted as it is sent: the list is live).
  function byLabel(form) {
    var label = form.elements.label.value;
    var state = form.elements.state;
    var verb = state.options[state.selectedIndex].text;
    var n = 0;
    document.querySelectorAll("#live td[data-labels]").forEach(function (td) {
      if (JSON.parse(td.dataset.labels).indexOf(label) >= 0) n += 1;
    });
    var whom = "the " + n + " worker" + (n === 1 ? "" : "s") + " labelled \u201c" + label + "\u201d";
    if (form.hasAttribute("data-shared")) {
      whom += " here (and those with it on the other servers of this database)";
    }
    var after = state.value === "terminate" ? " They finish their running jobs and exit." : "";
    return "Tell " + whom + " to " + verb + "?" + after;
  }

  document.addEventListener("submit", function (event) {
    var form = event.target;
    var message = form.hasAttribute("data-confirm-by-label") ? byLabel(form)
      : form.getAttribute("data-confirm");
    if (message && !window.confirm(message)) event.preventDefault();
  });
  // The label chosen stays chosen when the page is loaded again (the server reads it).
  document.addEventListener("change", function (event) {
    var el = event.target;
    if (el.name !== "label" || !el.form || !el.form.hasAttribute("data-confirm-by-label")) return;
    var url = new URL(location.href);
    url.searchParams.set("label", el.value);
    history.replaceState(null, "", url);
  });
  show("live");
  setInterval(refresh, EVERY);
  setInterval(function () { if (trouble) stale(trouble); }, 1000);  // the age goes on
})();
