"""Checkpoints: sharded, atomic, asynchronous saves on ``torch.distributed.checkpoint`` that load under any plan
(:func:`meshplan.save`, :func:`meshplan.load`, :class:`meshplan.CheckpointManager`), and full safetensors exports
a plain torch or transformers program loads (:func:`meshplan.export_safetensors`). See ``docs/checkpoints.md``.
"""
