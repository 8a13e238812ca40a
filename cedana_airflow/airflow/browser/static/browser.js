/* The checkpoint browser's one script; templates/base.html inlines it into every page (a Jinja2
   include: so no brace here may be followed by another brace, a % or a #). No value from the store
   reaches it: it reads only data-* attributes and the user's Airflow settings.

   The pages run in Airflow's iframe, sandboxed with scripts and same origin but without top
   navigation, so this script does what a plain page cannot do there:
   - shows Airflow's theme (its light/dark class and its colour and font variables, copied live);
   - hands the server the user's Airflow timezone (localStorage "timezone", else the browser's) in
     the cedana_tz cookie, and reloads once when the page was rendered in another;
   - follows links to Airflow's own pages (a[data-top]) in Airflow's window, as its router does;
   - asks before deleting (button[data-delete]). */
(function () {
  "use strict";
  var airflow = null;
  try { if (window.top !== window && window.top.document.documentElement) airflow = window.top; } catch (e) { airflow = null; }

  /* 1. the theme: ours is a name in data-theme, plus Airflow's own colours and font when we can read them */
  var VARS = [["--fg", "--chakra-colors-fg"], ["--bg", "--chakra-colors-bg"], ["--muted", "--chakra-colors-fg-muted"],
              ["--line", "--chakra-colors-border"], ["--subtle", "--chakra-colors-bg-subtle"],
              ["--font", "--chakra-fonts-body"]];
  function stored(key) { try { return window.localStorage.getItem(key); } catch (e) { return null; } }
  function theme() {
    var root = document.documentElement, dark;
    if (airflow) {
      dark = airflow.document.documentElement.classList.contains("dark");
      var cs = airflow.getComputedStyle(airflow.document.documentElement);
      VARS.forEach(function (pair) {
        var v = cs.getPropertyValue(pair[1]).trim();
        if (v) root.style.setProperty(pair[0], v); else root.style.removeProperty(pair[0]);
      });
    } else {
      var t = stored("theme");
      dark = t === "dark" || (t !== "light" && window.matchMedia("(prefers-color-scheme: dark)").matches);
    }
    root.setAttribute("data-theme", dark ? "dark" : "light");
  }
  theme();
  if (airflow && window.MutationObserver) {
    new MutationObserver(theme).observe(airflow.document.documentElement, {attributes: true, attributeFilter: ["class", "style"]});
  }

  /* 2. the timezone the server renders times in */
  var tz = null;
  try { tz = JSON.parse(stored("timezone") || "null"); } catch (e) { tz = null; }
  if (typeof tz !== "string" || !/^[A-Za-z0-9_+\-\/]+$/.test(tz)) tz = Intl.DateTimeFormat().resolvedOptions().timeZone || "UTC";
  document.cookie = "cedana_tz=" + tz + "; path=/; SameSite=Lax";  /* IANA names need no quoting in a cookie */
  var asked = document.documentElement.getAttribute("data-tz"), once = "cedana_tz_reloaded", reloaded = tz;
  var utc = /^(Etc\/)?(UTC|GMT|UCT|Universal|Zulu)$/;
  try { reloaded = window.sessionStorage.getItem(once); } catch (e) { reloaded = tz; }  /* no storage: no reload */
  if (asked !== tz && !(utc.test(asked) && utc.test(tz)) && !/[?&]tz=/.test(window.location.search) && reloaded !== tz) {
    window.sessionStorage.setItem(once, tz);  /* at most once: a browser that keeps no cookie still gets UTC */
    window.location.reload();  /* the cookie now names it, and the server echoes what it was asked */
  } else {
    document.documentElement.setAttribute("data-ready", "");  /* this page stays: what tests wait for */
  }

  /* 3. links to Airflow's pages, and the delete button */
  document.addEventListener("click", function (ev) {
    var a = ev.target.closest && ev.target.closest("a[data-top]");
    if (a && airflow && !ev.ctrlKey && !ev.metaKey && !ev.shiftKey && ev.button === 0) {
      ev.preventDefault();
      var idx = ((airflow.history.state && airflow.history.state.idx) || 0) + 1;
      airflow.history.pushState({usr: null, key: Math.random().toString(36).slice(2, 10), idx: idx}, "", a.href);
      airflow.dispatchEvent(new PopStateEvent("popstate", {state: airflow.history.state}));
      return;
    }
    var b = ev.target.closest && ev.target.closest("button[data-delete]");
    if (b && window.confirm(b.getAttribute("data-confirm"))) {
      var out = document.getElementById("deleted");
      fetch(b.getAttribute("data-delete"), {method: "DELETE"}).then(function (r) { return r.json(); }).then(function (j) {
        out.textContent = j.detail || ("deleted " + j.deleted_checkpoints + " checkpoint(s)");
      });
    }
  });
})();
