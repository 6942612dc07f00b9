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

  // Pictures open at natural size (scrollable); "fit" scales one to the page width.
  document.querySelectorAll("button.fit-toggle").forEach(function (b) {
    b.addEventListener("click", function () {
      var fig = document.getElementById(b.getAttribute("data-fig"));
      if (fig) b.textContent = fig.classList.toggle("fit") ? "natural size" : "fit to width";
    });
  });
  document.documentElement.setAttribute("data-ready", "1");
})();
