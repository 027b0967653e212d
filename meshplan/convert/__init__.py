"""Plans to and from the other ecosystems (``meshplan convert IN --from F --to T``).

Every direction goes through a meshplan plan: ``read_<format>`` turns a source into plan data, ``write_<format>``
turns a validated :class:`~meshplan.plan_file.document.Plan` into the target's text. What a target cannot hold is
listed, one line per item, in a :class:`~meshplan.convert.common.Notes` (``meshplan convert`` prints them on
stderr); nothing is dropped silently.

* :mod:`meshplan.convert.torch_source`: torch ``parallelize_module`` plans as Python source (read with ``ast``,
  never run);
* :mod:`meshplan.convert.hf_document`: transformers' ``tp_plan`` / ``pp_plan`` / ``ep_plan`` and degrees
  (``DistributedConfig``), or a model type / ``config.json`` (:func:`meshplan.hf.convert.from_hf`);
* :mod:`meshplan.convert.deepspeed`: DeepSpeed AutoTP's ``tensor_parallel.partition_config.layer_specs``;
* :mod:`meshplan.convert.accelerate`: accelerate's ``ParallelismConfig`` degrees;
* :mod:`meshplan.convert.formats`: the dispatch and the meshplan YAML.
"""
