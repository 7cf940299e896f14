"""Seeing an arena: what its journal says (``vramlock stats``), as Prometheus metrics.

Above arena/ (it reads the journal, the records and the budget) and below serve/ and
cli/, which show what it computes.

stats       the journal's statistics: residency, waits, switches, thrash, a timeline
prometheus  the arena as Prometheus metrics (a textfile, or a /metrics endpoint)
"""
