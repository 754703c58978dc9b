"""Reproduction benchmark (``lcsb-benchmark``): arms and resume rules (:mod:`.spec`), the resumable driver
(:mod:`.runner`), its studies (quality and ablations, recipe-loop speed, memory, 4-bit stability, the step-cost
model) and their tables (:mod:`.report`, :mod:`.time_to_quality`) and plots (:mod:`.plots`)."""
