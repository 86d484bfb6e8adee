"""The status page of ``aggsrv serve --dashboard-port N``: ``status`` builds the JSON document
(``/api/status``), ``web`` serves it with the page, and ``static/`` holds the page itself (plain
HTML, CSS and a dependency-free script that draws its charts as SVG; no build step)."""
