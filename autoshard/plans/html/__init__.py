"""The plan as one self-contained HTML page (inline SVG and CSS, no script): ``page.py`` assembles the sections
(``write_html``); ``charts.py`` draws memory, step time, collectives and recipes; ``layouts.py`` draws tensors as
tiles over the mesh; ``schedule.py`` draws a pipeline schedule; ``svg.py`` is the drawing kit they share."""
