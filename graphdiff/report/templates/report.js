// Interactivity only; the report reads fine without it (sections just stay as rendered).
(function () {
  var regions = Array.prototype.slice.call(document.querySelectorAll("details.region"));
  function setAll(open) { regions.forEach(function (d) { d.open = open; }); }
  var expand = document.getElementById("expand-all"), collapse = document.getElementById("collapse-all");
  if (expand) expand.addEventListener("click", function () { setAll(true); });
  if (collapse) collapse.addEventListener("click", function () { setAll(false); });

  // Following a link to a region (or into one) opens its section.
  function openTarget() {
    if (!location.hash) return;
    var el = document.getElementById(decodeURIComponent(location.hash.slice(1)));
    var d = el && el.closest ? el.closest("details") : null;
    if (d) { d.open = true; el.scrollIntoView(); }
  }
  window.addEventListener("hashchange", openTarget);
  openTarget();

  // Hovering a site row outlines its nodes in the picture (both sides).
  document.querySelectorAll("tr.site[data-nodes]").forEach(function (row) {
    var ids = row.getAttribute("data-nodes").split(" ").filter(Boolean);
    function mark(on) {
      ids.forEach(function (id) {
        var g = document.getElementById(id);
        if (g) g.classList.toggle("hl", on);
      });
    }
    row.addEventListener("mouseenter", function () { mark(true); });
    row.addEventListener("mouseleave", function () { mark(false); });
  });

  // Pictures open at natural size (scrollable), or fitted to the page when that keeps the text
  // readable (decided when a section first opens); the button switches.
  document.querySelectorAll("button.fit-toggle").forEach(function (b) {
    var fig = document.getElementById(b.getAttribute("data-fig"));
    if (!fig) return;
    var decided = false;
    function show(fit) { fig.classList.toggle("fit", fit); b.textContent = fit ? "natural size" : "fit to width"; }
    function autofit() {
      var svg = fig.querySelector("svg");
      if (decided || !svg || fig.clientWidth === 0) return;
      decided = true;
      var ratio = (fig.clientWidth - 20) / svg.getBoundingClientRect().width;
      show(ratio < 1 && ratio > 0.6);
    }
    var d = fig.closest("details");
    if (d) d.addEventListener("toggle", autofit);
    autofit();
    b.addEventListener("click", function () { decided = true; show(!fig.classList.contains("fit")); });
  });
  document.documentElement.setAttribute("data-ready", "1");
})();
