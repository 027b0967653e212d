"""Pipeline parallelism over the ``pp`` axis: the plan's ``pipeline`` section, a unit (:mod:`.unit`).

* :mod:`.unit` (torch-free): :data:`~meshplan.pipeline.unit.AXIS`, the one value the rest of meshplan reaches it
  through; :mod:`.costs` (torch-free): its terms in the solver's cost model;
* :mod:`.check`: the section in ``meshplan check`` (schedule, split, one line per stage);
* :mod:`.apply`: the split resolved (no model change), this rank's stages pruned, the stage objects built;
* :mod:`.split`, :mod:`.probe`, :mod:`.ends`, :mod:`.order`: the eager split of a block-stack model;
* :mod:`.trace`, :mod:`.traced`: ``split: trace`` (stages traced on the first step);
* :mod:`.stages`: the record, boundary hooks and schedules; :mod:`.step`: :func:`meshplan.train_step`'s schedule.
"""
