// Rota's dashboard: refresh the page's live region every 2 s (paused with the button,
// remembered across pages), and ask before a form marked data-confirm is sent.
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
    fetch(location.href, {headers: {"X-Rota-Live": "1"}, credentials: "same-origin",
                          cache: "no-store"})
      .then(function (response) {
        // Sent to the login form (the session ended): show it.
        if (response.redirected || response.status === 401) { location.reload(); return; }
        if (!response.ok) { show("error " + response.status); return; }
        return response.text().then(function (html) {
          if (pressed) return;  // pressed while this was fetched: the next refresh shows it
          if (html !== live.dataset.last) {
            var open = [];
            live.querySelectorAll("details[open][data-key]").forEach(function (d) {
              open.push(d.dataset.key);
            });
            live.innerHTML = html;
            open.forEach(function (key) {
              var d = live.querySelector('details[data-key="' + CSS.escape(key) + '"]');
              if (d) d.open = true;
            });
            live.dataset.last = html;
          }
          show("live · " + new Date().toLocaleTimeString());
        });
      })
      .catch(function () { show("server unreachable"); })
      .finally(function () { busy = false; });
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
  document.addEventListener("submit", function (event) {
    var message = event.target.getAttribute("data-confirm");
    if (message && !window.confirm(message)) event.preventDefault();
  });
  show("live");
  setInterval(refresh, EVERY);
})();
