"""The bottom layer, shared by every other package and importing none of ours: the maths (:mod:`.core`, pure torch)
and the logged metric names with their reductions (:mod:`.metrics`)."""
