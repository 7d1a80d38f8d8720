"""Experiments and their records: ablation grids (:mod:`.ablate`) run on executors (:mod:`.executors`,
in-process or Ray), the rows they write (:mod:`.rows`), the tables and plots rendered from them
(:mod:`.results`), and the claims ledger that judges published claims by those tables (:mod:`.claims`)."""
