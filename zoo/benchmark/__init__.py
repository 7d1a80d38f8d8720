"""Benchmarking: ``zoo bench`` (:mod:`.runner`, the sweep over mixers and lengths) and the measurements
of one mixer at one length (:mod:`.measure`: forward, forward+backward, memory, decode step)."""
