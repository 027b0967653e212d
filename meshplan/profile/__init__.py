"""Measuring this machine for the cost model: ``meshplan profile`` (:mod:`.run` launches :mod:`.worker`)."""
