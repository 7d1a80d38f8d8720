"""Experiments and their records: ablation grids (:mod:`.ablate`) run on executors (:mod:`.executors`,
in-process or Ray), the tables and plots rendered from the rows they write (:mod:`.results`; the rows
themselves are :mod:`zoo.rows`, on zoo's ground floor), and the claims ledger that judges published claims
by those tables (:mod:`.claims`)."""
