"""``meshplan train``: a plan file with a ``training`` section (or overrides) and a data folder train a model on any
layout, starting from the meta device (:mod:`meshplan.trainer.loop`)."""
