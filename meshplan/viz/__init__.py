"""Pictures of layouts, plans and pipeline schedules (``meshplan ranks|check --format svg|png``).

Every picture is built once as a :class:`~meshplan.viz.drawing.Drawing` (rectangles, lines and text in pixel
units, torch-free) and then written as SVG (:meth:`Drawing.to_svg`, no dependency) or PNG
(:func:`meshplan.viz.png.to_png`, matplotlib: ``pip install 'meshplan[viz]'``): both formats show the same shapes.

* :mod:`meshplan.viz.rank_grid`: the rank grid, one panel per group kind, node boundaries marked;
* :mod:`meshplan.viz.model`: the model as its blocks, each layer's style, weight and activation shardings and the
  collectives at each boundary (from ``meshplan check``'s explain rows);
* :mod:`meshplan.viz.timeline`: the executed pipeline schedule as a timeline per pp rank.
"""
